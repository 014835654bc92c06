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
