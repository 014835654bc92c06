"""The local launcher's rendezvous port: held for the run, so that no other socket on this machine is given it."""

import subprocess
import sys
import textwrap

import pytest

from aqpipe.launch.local import CommandStarter, launch_local

SKIP = 77  # the script's exit status where the namespace's port range cannot be set

# In a network namespace of its own whose ephemeral ports are only two, reserve the rendezvous port, let other
# sockets take every port the kernel hands out (gloo's listeners and other launches bind port 0), then bind the
# reserved port as rank 0's rendezvous does. (Loopback may stay down: binding 127.0.0.1 needs no traffic.)
_CROWDED_LOOPBACK = textwrap.dedent(f"""
    import socket, sys
    from aqpipe.launch.local import reserved_port
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
            f.write("40000 40001")
    except OSError as e:  # /proc/sys read-only (a container without the privilege)
        print(e)
        sys.exit({SKIP})
    with reserved_port() as port:
        others = []
        for _ in range(3):  # one more than the free ports: the kernel refuses the last
            other = socket.socket()
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                other.bind(("127.0.0.1", 0))
            except OSError:
                break
            other.listen()
            others.append(other)
        taken = [other.getsockname()[1] for other in others]
        assert port not in taken, f"the reserved port {{port}} was given to another socket ({{taken}})"
        assert len(taken) == 1, taken  # the other port went, and then none was left
        rendezvous = socket.socket()
        rendezvous.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rendezvous.bind(("127.0.0.1", port))
        rendezvous.listen()
    print("ok", port, taken)
""")


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -n` (root) for a network namespace of its own")
def test_the_rendezvous_port_is_not_given_to_another_socket_before_rank_0_binds_it():
    """The GPU suite's launches, 12 at once on one machine, lost a run to `Address already in use`: the port was
    probed free, released, and taken by another process's socket before rank 0 bound it."""
    proc = subprocess.run(["unshare", "-n", sys.executable, "-c", _CROWDED_LOOPBACK], capture_output=True, text=True,
                          timeout=60)
    if proc.returncode == SKIP:
        pytest.skip(f"the namespace's port range cannot be set: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok")


# A rank that reports whether its MASTER_PORT is still held when it starts (a plain bind, as another process's
# socket would make, is refused), then binds it as rank 0's rendezvous does.
_RANK = textwrap.dedent("""
    import os, socket
    port = int(os.environ["MASTER_PORT"])
    plain = socket.socket()
    try:
        plain.bind(("127.0.0.1", port))
        print("port free")
    except OSError:
        print("port held")
    plain.close()
    rendezvous = socket.socket()
    rendezvous.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    rendezvous.bind(("127.0.0.1", port))
    rendezvous.listen()
    print("rendezvous listens")
""")


def test_a_launch_holds_its_rendezvous_port_until_rank_0_binds_it(tmp_path):
    result = launch_local(CommandStarter([sys.executable, "-c", _RANK]), 1, lambda rank: f"rank {rank}", {}, 0,
                          stall_timeout=60, progress=False, log_dir=tmp_path)
    log = (tmp_path / "rank-0.log").read_text()
    assert result.code == 0, (result.message, log)
    assert "port held" in log and "rendezvous listens" in log, log


def test_under_a_topology_nccl_goes_over_the_throttled_interface(tmp_path, monkeypatch):
    """Ranks of one machine with a GPU each pick NCCL, which between them copies over NVLink/PCIe and shared memory,
    never the network: under a topology (each rank a simulated host behind a throttled link) the grad sync, clip
    norm and tied copies would skip the throttling. Each rank is told to use sockets over the shaped interface, as
    gloo does — over a setting the user made, which would defeat the throttle (or name an interface the namespace
    lacks)."""
    from types import SimpleNamespace

    from aqpipe.launch.netns import INTERFACE

    seen = {}

    class Recording(CommandStarter):
        def start(self, rank, env, netns=None):
            seen[rank] = (env, netns)
            return super().start(rank, env)  # (run here: the namespaces are the topology's stand-ins)

    topology = SimpleNamespace(address=lambda rank: f"10.99.0.{rank + 1}", namespace=lambda rank: f"aqpipe-test-{rank}")
    monkeypatch.setenv("NCCL_IB_DISABLE", "0")  # the user's own, for the cluster's real links
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    launch_local(Recording([sys.executable, "-c", "pass"]), 2, lambda rank: f"rank {rank}", {}, 0,
                 stall_timeout=60, progress=False, topology=topology, log_dir=tmp_path)
    assert sorted(seen) == [0, 1]
    for rank, (env, netns) in seen.items():
        assert netns == f"aqpipe-test-{rank}" and env["GLOO_SOCKET_IFNAME"] == INTERFACE
        assert env["NCCL_SOCKET_IFNAME"] == f"={INTERFACE}" and env["NCCL_NET"] == "Socket"  # (exactly that one)
        assert env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == env["NCCL_IB_DISABLE"] == "1"
        assert env["NCCL_NVLS_ENABLE"] == "0"


def test_on_one_machine_without_a_topology_nccl_stays_on_loopback(tmp_path):
    seen = {}

    class Recording(CommandStarter):
        def start(self, rank, env, netns=None):
            seen[rank] = env
            return super().start(rank, env, netns)

    launch_local(Recording([sys.executable, "-c", "pass"]), 1, lambda rank: f"rank {rank}", {}, 0,
                 stall_timeout=60, progress=False, log_dir=tmp_path)
    assert seen[0]["NCCL_SOCKET_IFNAME"] == "lo" and "NCCL_P2P_DISABLE" not in seen[0]


# A rank that trains one step, then spends 2.5 s in a phase that reports its progress twice a second, as the held-out
# pass and the final weights' way to rank 0 do, then ends.
_LONG_PHASE = textwrap.dedent("""
    import json, time
    def event(**e):
        print("@@aqpipe " + json.dumps(e), flush=True)
    event(event="start", total_steps=1, rank=0, first_step=0)
    event(event="step", step=1, total_steps=1, loss=1.0, samples_per_second=1.0)
    for done in range(1, 6):
        time.sleep(0.5)
        event(event="progress", phase="final weights", done=done * 1_000_000, total=5_000_000, unit="bytes")
""")


def test_a_phase_that_reports_progress_may_outlast_the_stall_timeout(tmp_path):
    """The launcher's side of the protocol the held-out pass and the final weights rely on: any event but `alive`
    counts as progress."""
    result = launch_local(CommandStarter([sys.executable, "-c", _LONG_PHASE]), 1, lambda rank: f"rank {rank}", {}, 1,
                          stall_timeout=1.5, progress=False, log_dir=tmp_path)
    assert result.code == 0, result.message


def test_without_a_bar_a_long_phase_is_printed_every_ten_seconds_once_it_has_lasted_that_long(monkeypatch, capsys):
    from types import SimpleNamespace

    from aqpipe.launch import local

    now = [0.0]
    monkeypatch.setattr(local, "time", SimpleNamespace(monotonic=lambda: now[0]))  # (this module's clock only)
    phases: dict[str, float] = {}
    for second, done in ((0, 1), (5, 2), (10, 3), (15, 4), (21, 5), (22, 6)):
        now[0] = float(second)
        local._on_event({"event": "progress", "phase": "final weights", "done": done * 10**6, "total": 6 * 10**6,
                         "unit": "bytes"}, [], None, phases)
    assert capsys.readouterr().err.splitlines() == ["final weights: 3.0 of 6.0 MB", "final weights: 5.0 of 6.0 MB"]
    assert phases == {}  # the phase ended: a later one starts its own count
    assert local.phase_text({"phase": "held-out pass", "done": 3, "total": 40, "unit": "batches"}) == \
        "held-out pass: 3 of 40 batches"


# Ranks in start-up (no `start` event yet): each is silent for `quiet` seconds (importing), then beats its heart twice
# a second; rank 1 stops beating after `beats` beats (a stopped or hung process) but lives on. Both end after
# `seconds`.
_START_UP = textwrap.dedent("""
    import json, os, sys, time
    quiet, beats, seconds = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    time.sleep(quiet)
    end = time.monotonic() + seconds - quiet
    n = 0
    while time.monotonic() < end:
        if os.environ["RANK"] == "0" or n < beats:
            print("@@aqpipe " + json.dumps({"event": "alive"}), flush=True)
        n += 1
        time.sleep(0.5)
""")


def _start_up(tmp_path, monkeypatch, quiet: float, beats: int, seconds: float):
    import time

    from aqpipe.launch import local

    monkeypatch.setattr(local, "STARTUP_SILENCE_SECONDS", 0.0)  # (at least a minute in earnest)
    start = time.monotonic()
    result = launch_local(CommandStarter([sys.executable, "-c", _START_UP, str(quiet), str(beats), str(seconds)]), 2,
                          lambda rank: f"rank {rank}", {}, 1, stall_timeout=2.0, progress=False, log_dir=tmp_path)
    return result, time.monotonic() - start


def test_a_rank_that_falls_silent_during_start_up_ends_the_run(tmp_path, monkeypatch):
    """Until training begins the ranks' collectives wait up to half an hour for each other (a host may be downloading
    its weights), so the launcher ends a run whose rank stopped beating its heart for --stall-timeout."""
    result, seconds = _start_up(tmp_path, monkeypatch, quiet=0.0, beats=2, seconds=15)
    assert result.code == 1 and "rank 1 stopped responding during start-up (no heartbeat for 2 s)" in result.message
    assert seconds < 12


def test_a_rank_still_importing_is_not_taken_for_a_silent_one(tmp_path, monkeypatch):
    """A rank's heartbeat begins once it has imported what it runs, which may take longer than the stall time-out."""
    # (silent for twice the 2 s time-out, then beating for twice as long again before the ranks end)
    result, _ = _start_up(tmp_path, monkeypatch, quiet=4.0, beats=10**6, seconds=8)
    assert result.code == 0, result.message


# Rank 0 in training prints what NCCL's watchdog prints when a collective outlives its time-out, and aborts as the
# watchdog does; rank 1 (the one it waited for) goes on beating its heart.
_WATCHDOG = textwrap.dedent("""
    import json, os, resource, sys, time
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    def event(**e):
        print("@@aqpipe " + json.dumps(e), flush=True)
    event(event="start", total_steps=2, rank=int(os.environ["RANK"]), first_step=0)
    event(event="step", step=1, total_steps=2, loss=1.0, samples_per_second=1.0)
    if os.environ["RANK"] == "0":
        time.sleep(1.0)
        print("[rank0]:[E1128 04:00:00.000000000 ProcessGroupNCCL.cpp:685] [Rank 0] Watchdog caught collective "
              "operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, "
              "Timeout(ms)=300000) ran for 300012 milliseconds before timing out.", flush=True)
        os.abort()
    for _ in range(30):
        event(event="alive")
        time.sleep(0.5)
""")


def test_a_rank_aborted_by_nccls_watchdog_is_named_with_the_collective_and_the_ranks_still_running(tmp_path):
    """NCCL's watchdog aborts a rank (SIGABRT) whose collective outlived --stall-timeout; the rank it waited for is
    alive and beating its heart, so "killed by signal SIGABRT" alone named the victim, never the cause."""
    result = launch_local(CommandStarter([sys.executable, "-c", _WATCHDOG]), 2, lambda rank: f"rank {rank}", {}, 2,
                          stall_timeout=60, progress=False, log_dir=tmp_path)
    assert result.code == 1
    assert ("rank 0 died: NCCL's watchdog aborted it when its ALLREDUCE had waited 300 s for its peers (--stall-timeout "
            "once training has begun); still running: rank 1") in result.message, result.message


# A resumed rank: it says so, then waits (beating its heart) for the other replica to be ready to train, then trains.
_RESUMED_THEN_WAITS = textwrap.dedent("""
    import json, time
    def event(**e):
        print("@@aqpipe " + json.dumps(e), flush=True)
    event(event="resumed", step=4, rank=0, reseeded=0)
    for _ in range(8):
        event(event="alive")
        time.sleep(0.5)
    event(event="start", total_steps=5, rank=0, first_step=4)
    event(event="step", step=5, total_steps=5, loss=1.0, samples_per_second=1.0)
""")


def test_a_resumed_rank_waiting_for_the_others_to_start_is_not_stalled(tmp_path):
    """A resumed rank reports it before every rank is ready to train (another replica may still be loading); its
    wait is start-up, not a stalled step."""
    result = launch_local(CommandStarter([sys.executable, "-c", _RESUMED_THEN_WAITS]), 1, lambda rank: f"rank {rank}",
                          {}, 5, stall_timeout=1.5, progress=False, log_dir=tmp_path)
    assert result.code == 0, result.message
