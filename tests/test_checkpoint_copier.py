"""The process that copies a rank's checkpoint parts to other hosts (aqpipe.runtime.checkpoints.copier): the pace it
takes from the links to other hosts, and the CPU priority it copies at."""

import datetime
import os
from pathlib import Path

import pytest
import torch

from aqpipe.runtime.checkpoints import parts as ck
from tests.distributed import run_ranks

SETTINGS = {"model": "llama-tiny", "seed": 0}


def _pacing_copier(grid, hosts: list[str]):
    """A copier of rank 1 as it is built, minus its directory and process: what its pace reads (no copies started)."""
    from aqpipe.runtime.checkpoints.copier import CheckpointCopier

    copier = CheckpointCopier.__new__(CheckpointCopier)
    copier.grid, copier.rank, copier.hosts, copier.peak, copier.burst_peak = grid, 1, hosts, 0.0, 0.0
    copier.share = 0.1
    copier._process, copier._pending = None, False
    return copier


def test_the_rate_counts_only_links_to_other_hosts_and_is_split_among_a_hosts_ranks():
    """Two stages on one host and one on another: the middle stage's fast link on its own host does not set the
    pace; where no link to another host was measured, the least rate; a host's ranks share its pace."""
    from aqpipe.pipeline.vocab.step_stats import StepStats
    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.checkpoints.copies import MIN_RATE

    copier = _pacing_copier(Grid(3, 1, 1), ["a", "a", "b"])
    assert copier.rate() == MIN_RATE / 2
    copier.observe(StepStats(fwd_recv_bytes=10**9, fwd_arrived_bytes=10**8, fwd_recv_seconds=1.0, bwd_recv_bytes=10**7,
                             bwd_arrived_bytes=10**7, bwd_recv_seconds=1.0))
    assert copier.peak == 10**7 and copier.rate() == 0.1 * 10**7 / 2
    copier.share = 0.05  # (--checkpoint-share 0.05)
    assert copier.rate() == 0.05 * 10**7 / 2


def test_a_step_whose_bodies_all_waited_in_the_kernel_never_sets_the_pace_over_a_measured_one():
    """A step whose every body was already queued when its header was read (a receiver that came late) reads at
    memory speed; the copies keep the pace of a rate measured from bytes that arrived while timed. Only where no
    such rate exists (small messages: each body one burst with its header) does the bodies' rate set it."""
    from aqpipe.pipeline.vocab.step_stats import StepStats
    from aqpipe.pipeline.world.grid import Grid
    copier = _pacing_copier(Grid(2, 1, 1), ["a", "b"])
    copier.observe(StepStats(fwd_recv_bytes=10**7, fwd_arrived_bytes=0, fwd_recv_seconds=0.001))  # 10 GB/s
    assert copier.rate() == 0.1 * 10**10
    copier.observe(StepStats(fwd_recv_bytes=10**7, fwd_arrived_bytes=10**6, fwd_recv_seconds=0.1))  # 10 MB/s
    copier.observe(StepStats(fwd_recv_bytes=10**7, fwd_arrived_bytes=0, fwd_recv_seconds=0.0001))
    assert copier.rate() == 0.1 * 10**7


def _copies_process(rank: int, world: int, root: str):
    """A copier whose process is started (a step copied): its process id, its nice value, the scheduling policy of
    each of its threads and the threads of this rank's process before and after."""
    import threading

    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.checkpoints.copier import NICE, CheckpointCopier

    out = Path(root) / f"host-{rank}"
    ck.save_rank(out, 4, rank, {"model": {"w": torch.randn(1000)}}, SETTINGS)
    ck.mark_complete(out, 4, world, SETTINGS)
    threads = threading.active_count()
    copier = CheckpointCopier(out, Grid(world, 1, rank), [f"host-{r}" for r in range(world)], 1,
                              datetime.timedelta(seconds=60), 0.1)
    copier.start(4, leader=True)
    copier.wait()
    assert copier._process is not None
    pid = copier._process.pid
    policies = [os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]
    return pid, os.getpriority(os.PRIO_PROCESS, pid), NICE, policies, threading.active_count() - threads


def test_the_copies_run_in_a_process_of_their_own_at_the_lowest_priority_that_ends_with_its_rank(tmp_path):
    """No thread of the training process copies (a thread's reads, hashes and writes held Python's lock against the
    step's own Python: 12% slower steps); every thread of the copies' process (gloo's too) runs under SCHED_IDLE, which
    any waking rank preempts at once (at nice 19 alone, SmolLM2's LoRA steps ran 11% slower while copies travelled,
    3-9% in four runs under SCHED_IDLE), and at nice 19; the process does not outlive its rank."""
    import time

    results = run_ranks(_copies_process, 2, str(tmp_path))
    for status, value in results:
        assert status == "ok", value
        pid, nice, wanted, policies, new_threads = value
        assert nice == wanted == 19 and new_threads == 0
        assert len(policies) > 1 and set(policies) == {os.SCHED_IDLE}, policies
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _may_leave_sched_idle() -> bool:
    """Whether this process has CAP_SYS_NICE (a process leaves SCHED_IDLE for nice 0 only with it, or `ulimit -e 20`)."""
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").is_file() else ""
    capabilities = next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), "0")
    return bool(int(capabilities, 16) >> 23 & 1)


def _waited_copy(rank: int, world: int, root: str):
    """Parts of 6 and 12 MB, paced at the least rate (256 KiB/s: no link was measured; 46 s for the larger), whose
    rank waits for them 4 s after they started, as it does at the end of a run: the seconds from the start of the
    copy to the end of the wait, and why the copy failed ("" where it did not)."""
    import time

    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.checkpoints.copier import CheckpointCopier

    out = Path(root) / f"host-{rank}"
    ck.save_rank(out, 4, rank, {"model": {"w": torch.randn(1_500_000 * (rank + 1))}}, SETTINGS)
    ck.mark_complete(out, 4, world, SETTINGS)
    copier = CheckpointCopier(out, Grid(world, 1, rank), [f"host-{r}" for r in range(world)], 1,
                              datetime.timedelta(seconds=60), 0.05)
    start = time.monotonic()
    copier.start(4, leader=True)
    time.sleep(4.0)
    copier.wait()
    took = time.monotonic() - start
    copier.close()
    return took, copier.problem


@pytest.mark.skipif(not _may_leave_sched_idle(), reason="needs CAP_SYS_NICE (a waited-for copy leaves SCHED_IDLE with it)")
def test_copies_the_run_waits_for_go_at_the_links_whole_rate(tmp_path):
    """Once training waits for the copies in flight (the run's last checkpoint, its end) nothing else shares the link,
    and a pace would only make the wait longer: the copy in flight goes unpaced from then on, and the wait ends within
    half the larger part's paced time. (A run across three hosts ended 25 s after its last step while two checkpoints'
    copies crossed at a twentieth of the link.)"""
    from aqpipe.runtime.checkpoints.copies import MIN_RATE

    results = run_ranks(_waited_copy, 2, str(tmp_path))
    for status, value in results:
        assert status == "ok", value
        took, problem = value
        assert problem == "" and took < 0.5 * 12_000_000 / MIN_RATE, value
    for host in range(2):
        assert (ck.step_dir(tmp_path / f"host-{host}", 4) / "REPLICATED").is_file()
        ck.check_rank(tmp_path / f"host-{host}", 4, 1 - host, SETTINGS)


def test_a_copies_process_whose_orders_fail_exits_1_with_the_traceback(tmp_path):
    """An error in a copies' process started afresh, while the thread that reads its orders waits on stdin, ends it
    with exit 1 and the traceback on stderr (the interpreter's shutdown aborted it: SIGABRT, "Fatal Python error")."""
    import json
    import subprocess
    import sys

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    where = {"parent": os.getpid(), "rank": 0, "plan": {"0": []}, "name": "orders", "timeout": 60, "out": str(tmp_path)}
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    proc = subprocess.Popen([sys.executable, "-m", "aqpipe.runtime.checkpoints.copier", json.dumps(where)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    assert proc.stdin is not None
    proc.stdin.write(b'{"rate": 1.0, "leader": true}\n')  # (an order that names no step; stdin stays open)
    proc.stdin.flush()
    try:
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.stderr is not None
    said = proc.stderr.read().decode(errors="replace")
    assert code == 1 and "KeyError: 'step'" in said and "Fatal Python error" not in said, (code, said[-2000:])


def _policies(pid: int) -> set[int]:
    policies = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            policies.add(os.sched_getscheduler(int(tid)))
        except ProcessLookupError:  # (a thread that ended meanwhile)
            pass
    return policies


def _starved_copy(rank: int, world: int, root: str, may_hurry: bool):
    """A copy whose copies' processes get no CPU (stopped once they idle, as on a host whose cores are all busy): the
    scheduling policies and nice value of the process's threads while it is starved past `STARVED_SECONDS` (2 s
    here), then once the copy is done; the rank's own nice value; and what the rank printed (`may_hurry`: whether
    Linux lets it raise its process)."""
    import contextlib
    import io
    import signal
    import time

    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.checkpoints import copier as copier_module

    out = Path(root) / f"host-{rank}"
    ck.save_rank(out, 4, rank, {"model": {"w": torch.randn(1000)}}, SETTINGS)
    ck.mark_complete(out, 4, world, SETTINGS)
    copier_module.STARVED_SECONDS = 2.0
    set_priority = copier_module.set_priority
    if not may_hurry:  # (as Linux answers a process without CAP_SYS_NICE or `ulimit -e 20`)
        copier_module.set_priority = lambda pid, idle: set_priority(pid, idle) if idle else False
    copier = copier_module.CheckpointCopier(out, Grid(world, 1, rank), [f"host-{r}" for r in range(world)], 1,
                                            datetime.timedelta(seconds=60), 0.1)
    assert copier._process is not None
    pid = copier._process.pid
    deadline = time.monotonic() + 60
    while _policies(pid) != {os.SCHED_IDLE} and time.monotonic() < deadline:  # (it lowers itself once started)
        time.sleep(0.05)
    os.kill(pid, signal.SIGSTOP)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        copier.start(4, leader=True)
        assert copier.busy
        starved = _policies(pid), os.getpriority(os.PRIO_PROCESS, pid)
        time.sleep(2.5)
        assert copier.busy and copier.busy
        hurried = _policies(pid), os.getpriority(os.PRIO_PROCESS, pid)
    os.kill(pid, signal.SIGCONT)
    if not may_hurry:  # (the copy itself then ends at the rank's priority: on a busy machine it might not at idle)
        copier_module.set_priority, copier.can_hurry = set_priority, True
    copier.wait()
    done = _policies(pid), os.getpriority(os.PRIO_PROCESS, pid)
    copier.close()
    return starved, hurried, done, os.getpriority(os.PRIO_PROCESS, 0), said.getvalue(), copier.problem


@pytest.mark.skipif(not _may_leave_sched_idle(), reason="needs CAP_SYS_NICE (a process leaves SCHED_IDLE with it)")
def test_a_copy_starved_of_cpu_runs_at_its_ranks_priority_until_it_ends_then_idles_again(tmp_path):
    """On a host whose cores are never idle a SCHED_IDLE process never ran: a run ended, or its host failed, before
    any copy was kept (the fresh-host test failed so with the suite on three workers). A copy that outlasts twice its
    paced time runs at its rank's priority until it ends; the next starts on idle cores again."""
    results = run_ranks(_starved_copy, 2, str(tmp_path), True)
    for status, value in results:
        assert status == "ok", value
        starved, hurried, done, own_nice, said, problem = value
        assert starved == ({os.SCHED_IDLE}, 19)
        assert hurried == ({os.SCHED_OTHER}, own_nice)
        assert done == ({os.SCHED_IDLE}, 19) and said == "" and problem == ""
    assert (ck.step_dir(tmp_path / "host-0", 4) / "REPLICATED").is_file()


def test_a_starved_copy_a_rank_may_not_raise_says_so_once(tmp_path):
    """Where Linux refuses to take the copies' process out of SCHED_IDLE (no CAP_SYS_NICE, `ulimit -e` below 20) the
    rank says so once, and its copies go on at the lowest priority."""
    results = run_ranks(_starved_copy, 2, str(tmp_path), False)
    for rank, (status, value) in enumerate(results):
        assert status == "ok", value
        starved, hurried, done, _, said, problem = value
        assert starved == hurried == ({os.SCHED_IDLE}, 19) and problem == ""
        assert said.count("\n") == 1 and said.startswith(f"aqpipe: rank {rank} may not raise the CPU priority of its "
                                                          "checkpoint copies"), said
        assert "`ulimit -e 20`" in said


def test_a_copies_process_hurried_before_it_lowered_itself_is_hurried_again(monkeypatch):
    """The copies' process lowers itself once it has imported torch; a rank that hurried it before (the run's last
    checkpoint, waited for, in a run shorter than that import) raises it again when it says it is ready, and lowers
    it once the copy is done; the copy's planned time sets when it counts as starved."""
    from aqpipe.runtime.checkpoints import copier as copier_module

    calls = []
    monkeypatch.setattr(copier_module, "set_priority", lambda pid, idle: calls.append((pid, idle)) or True)
    read, write = os.pipe()

    class Process:
        pid = 4242
        stdout = os.fdopen(read, "rb")

        def wait(self):
            return 0

    copier = copier_module.CheckpointCopier.__new__(copier_module.CheckpointCopier)
    copier._process, copier._unread, copier.can_hurry, copier._hurried = Process(), b"", True, False
    copier._pending, copier._asked, copier._starved_after, copier.problem = True, 100.0, 105.0, ""
    copier._hurry()
    os.write(write, b'{"ready": true}\n{"expect": 30.0}\n')
    copier._read(block=True)
    assert calls == [(4242, False), (4242, False)] and copier._starved_after == 160.0
    os.write(write, b'{"sent": 0, "done": 4, "problem": ""}\n')
    copier._read(block=True)
    assert calls[-1] == (4242, True) and not copier._hurried and not copier._pending
    os.close(write)


PREFORK = """
import json, os, signal, socket, sys, time
from pathlib import Path
from aqpipe.launch.fork_safety import fork, unsafe_to_fork
from aqpipe.runtime.checkpoints import preforked
from aqpipe.runtime.checkpoints.copier import serve
assert unsafe_to_fork() is None, unsafe_to_fork()
preforked.prefork(fork, serve)
forked = preforked._preforked
pid = forked.pid
deadline = time.monotonic() + 30
while Path(f"/proc/{pid}/comm").read_text().strip() != "aqpipe-copies" and time.monotonic() < deadline:
    time.sleep(0.01)  # (it names itself once forked)
seen = {"pid": pid, "parent": int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]),
        "comm": Path(f"/proc/{pid}/comm").read_text().strip(), "own": os.getpid(),
        "threads": len(os.listdir("/proc/self/task"))}
if sys.argv[1] == "release":
    preforked.release_preforked()
    seen["code"] = forked.returncode
    print(json.dumps(seen), flush=True)
    os._exit(0)
# busy: its part of a run given, it waits to meet the other copies' processes at a store nobody serves
with socket.socket() as unused:
    unused.bind(("127.0.0.1", 0))
    port = unused.getsockname()[1]
where = {"out": sys.argv[2], "rank": 0, "plan": {"0": [1], "1": [0]}, "name": "x", "timeout": 120.0, "parent": os.getpid(),
         "env": {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}}
forked.stdin.write(json.dumps(where).encode() + b"\\n")
forked.stdin.flush()
time.sleep(1)
print(json.dumps(seen), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _prefork(how: str, tmp_path) -> dict:
    import json
    import subprocess
    import sys

    from aqpipe.launch.forkserver import SERVER_ENV

    done = subprocess.run([sys.executable, "-c", PREFORK, how, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **SERVER_ENV})
    assert done.returncode == (0 if how == "release" else -9), done.stderr
    return json.loads(done.stdout)


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie its new parent has not reaped counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_rank_forks_its_copies_process_which_waits_for_its_part_and_exits_unused_once_let_go(tmp_path):
    """A rank under torchrun forks its copies' process from itself before it meets the others (it has imported torch
    by then, and holds no thread): the copies' process starts without importing torch again (2-3 s of a core each)
    and is named for what it does; one the run does not need exits when its rank lets it go."""
    seen = _prefork("release", tmp_path)
    assert seen["parent"] == seen["own"] and seen["comm"] == "aqpipe-copies"
    assert seen["threads"] == 1  # (the fork leaves the rank as it was: no thread to wait for it)
    assert seen["code"] == 0 and _gone(seen["pid"])


def test_a_forked_copies_process_dies_with_its_rank_even_while_it_copies(tmp_path):
    """Its rank SIGKILLed while the copies' process waits (up to its 120 s time-out) to meet the others: it ends at
    once, as a started one does."""
    import time

    seen = _prefork("busy", tmp_path)
    deadline = time.monotonic() + 10
    while not _gone(seen["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(seen["pid"])


def test_a_torchrun_ranks_imports_leave_it_free_to_fork_its_copies_process(tmp_path):
    """A rank under torchrun, with no OMP_NUM_THREADS to keep numpy's BLAS to one thread (torchrun sets none for one
    process a host): its imports start no thread, so it forks its copies' process (here one whose run is refused
    as it starts: the fork comes first)."""
    import subprocess
    import sys

    script = ("import sys\nfrom aqpipe.cli import main\n"
              "code = main(['launch', '--model', 'llama-tiny', '--pp', '2', '--out', sys.argv[1]])\n"
              "from aqpipe.runtime.checkpoints import preforked\nprint(code, preforked._preforked is not None)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.stdout.split() == ["2", "True"], (done.stdout, done.stderr)
    assert "needs 2" in done.stderr
