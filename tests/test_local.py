"""The local launcher's rendezvous port: held for the run, so that no other socket on this machine is given it."""

import subprocess
import sys
import textwrap

import pytest

# In a network namespace of its own whose ephemeral ports are only two, reserve the rendezvous port, let other
# sockets take every port the kernel hands out (gloo's listeners and other launches bind port 0), then bind the
# reserved port as rank 0's rendezvous does.
_CROWDED_LOOPBACK = textwrap.dedent("""
    import socket, subprocess
    from aqpipe.launch.local import reserved_port
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
        f.write("40000 40001")
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
        assert port not in taken, f"the reserved port {port} was given to another socket ({taken})"
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
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok")
