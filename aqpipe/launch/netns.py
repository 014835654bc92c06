"""Throttled network topologies: every rank in its own network namespace, its link shaped by `tc tbf`.

One namespace per rank holds a veth end `aq0` with an address in a private /24; the peer ends sit in a bridge
inside a namespace of its own, so no interface, address or route is added to the machine's own namespace. A
`tbf` qdisc on both ends of each veth limits what a rank sends and what it receives to the same rate. A state
file per topology (owner pid, namespaces) lets `aqpipe netns down` and the next launch remove what a killed
launcher could not.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from aqpipe.config import ConfigError
from aqpipe.config.rates import MAX_RATE_BITS, MIN_RATE_BITS, format_rate, parse_rate  # noqa: F401 - also read as netns.*
from aqpipe.launch.signals import deferred_interrupts

PREFIX = "aqpipe-"
INTERFACE = "aq0"
SUBNET = "10.231.0"  # private; only the namespaces a topology creates hold addresses in it
MAX_RANKS = 250
# Each rank is a simulated host behind a throttled link, but NCCL knows the ranks share a machine, and would move
# their collectives over NVLink/PCIe peer copies, shared memory, NVLink SHARP or a network plugin's devices (shared
# across namespaces), past the throttling: it is sent over its own sockets on the shaped interface alone, as gloo is.
# The launcher sets these over any the user set: another value would defeat the throttle, or name an interface the
# namespace lacks.
THROTTLED_NCCL = {"NCCL_SOCKET_IFNAME": f"={INTERFACE}", "NCCL_NET": "Socket", "NCCL_P2P_DISABLE": "1",
                  "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}


class NetnsError(RuntimeError):
    """A topology cannot be made, used or removed; the text says what to do."""


def tbf_arguments(rate_bits: int) -> list[str]:
    """The tbf parameters for a rate: a bucket of 1 ms of traffic (at least 16 KiB), small so that a message after an
    idle pause does not ride a large burst (a larger one measured no better throughput at 100mbit..1gbit), and a
    queue of 100 ms, deep enough that TCP fills the link instead of collapsing on drops. (tbf splits GSO packets
    larger than the bucket, so the bucket need not hold 64 KiB.)"""
    rate_bytes = rate_bits / 8
    burst = max(16 * 1024, int(rate_bytes * 0.001))
    return ["rate", f"{rate_bits}bit", "burst", str(burst), "latency", "100ms"]


def can_throttle() -> str | None:
    """Why this process cannot build a topology (None if it can): needs root, iproute2 and netns support."""
    if os.geteuid() != 0:
        return "--bandwidth needs root (it creates network namespaces and tc qdiscs); run as root or leave it out"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"--bandwidth needs the `{tool}` command of iproute2; install iproute2 or leave --bandwidth out"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"--bandwidth needs network namespaces, and `ip netns list` failed: {probe.stderr.strip()}"
    return None


def require_throttling(bandwidth: str | None) -> None:
    """Raise ConfigError saying why, when a launch asks for --bandwidth and this process cannot build a topology."""
    problem = can_throttle() if bandwidth is not None else None
    if problem:
        raise ConfigError(problem)


def state_dir() -> Path:
    """Where topology state files live ($AQPIPE_NETNS_STATE, default /run/aqpipe/netns)."""
    return Path(os.environ.get("AQPIPE_NETNS_STATE", "/run/aqpipe/netns"))


@dataclass(frozen=True)
class Topology:
    """A throttled topology of `ranks` namespaces at `rate_bits` bits/s, named `aqpipe-<name>-…`."""

    name: str
    ranks: int
    rate_bits: int
    owner_pid: int = 0  # the launcher that removes it when done; 0 for one made by hand (`aqpipe netns up`)
    # > 0: two clusters (ranks below ranks/2 on one bridge, the rest on another) joined by a link of this rate
    slow_link_bits: int = 0

    def cluster(self, rank: int) -> int:
        """Which bridge a rank hangs on: 0, or 1 for the upper half when there is a slow link."""
        return int(self.slow_link_bits > 0 and rank >= (self.ranks + 1) // 2)

    def namespace(self, rank: int) -> str:
        """The namespace rank `rank` runs in."""
        return f"{PREFIX}{self.name}-{rank}"

    @property
    def bridge_namespace(self) -> str:
        return f"{PREFIX}{self.name}-br"

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_namespace] + [self.namespace(r) for r in range(self.ranks)]

    def address(self, rank: int) -> str:
        """Rank `rank`'s IPv4 address on the bridge."""
        return f"{SUBNET}.{rank + 1}"

    def exec_prefix(self, rank: int) -> list[str]:
        """The command prefix that runs a program inside rank `rank`'s namespace (it execs, keeping the pid)."""
        return exec_prefix(self.namespace(rank))


def exec_prefix(namespace: str) -> list[str]:
    """The command prefix that runs a program inside network namespace `namespace` (it execs, keeping the pid)."""
    return ["ip", "netns", "exec", namespace]


def _run(*args: str) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetnsError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _state_file(name: str) -> Path:
    return state_dir() / f"{name}.json"


@contextmanager
def _registry_lock() -> Iterator[None]:
    """Hold the machine-wide lock under which topologies are built, listed for removal and removed, so that one
    launch never sees another's topology half made or half removed."""
    state_dir().mkdir(parents=True, exist_ok=True)
    with open(state_dir() / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def new_name() -> str:
    """A fresh topology name (six hex digits)."""
    return secrets.token_hex(3)


def registered(name: str) -> bool:
    """Whether a topology of this name has its state file (written before anything is built, removed after all)."""
    return _state_file(name).exists()


def create(ranks: int, rate_bits: int, name: str | None = None, manual: bool = False,
           slow_link_bits: int = 0) -> Topology:
    """Build a topology (removing stale ones of dead launchers first); on any failure nothing is left behind.
    A `manual` one stays until `aqpipe netns down`; otherwise it belongs to this process. With `slow_link_bits`,
    the ranks form two clusters whose bridges are joined by one link of that rate (the slow link of a chain)."""
    if not 1 <= ranks <= MAX_RANKS:
        raise NetnsError(f"a throttled topology holds 1 to {MAX_RANKS} ranks, not {ranks}")
    problem = can_throttle()
    if problem:
        raise NetnsError(problem)
    name = name or new_name()
    if not re.fullmatch(r"[a-z0-9]{1,12}", name):
        raise NetnsError(f"bad topology name {name!r}: use 1 to 12 lower-case letters or digits")
    topo = Topology(name, ranks, rate_bits, 0 if manual else os.getpid(), slow_link_bits)
    with _registry_lock():
        _remove_stale()
        if _state_file(name).exists() or any(ns.startswith(f"{PREFIX}{name}-") for ns in _namespaces()):
            raise NetnsError(f"a topology named {name!r} exists already; remove it with `aqpipe netns down {name}`")
        try:
            # an interrupt is taken between `ip` commands, never inside one: raised while a command's process starts,
            # it escapes subprocess.run without killing it, and that process went on building after the cleanup;
            # nor while the state file is written (first, so a crash mid-way is still cleanable), which it outlived
            with deferred_interrupts() as received:
                _state_file(name).write_text(json.dumps(asdict(topo)))
                _build(topo, received)
            _stop_if(received)  # (one that came during the last command, or since)
        except BaseException:
            with deferred_interrupts():  # interrupted mid-way (Ctrl-C, SIGTERM): remove what was built, whatever comes
                _destroy(name)
            raise
    return topo


def _build(topo: Topology, interrupted: list[int]) -> None:
    """Make the topology's namespaces, links and qdiscs, one `ip` or `tc` command at a time; a KeyboardInterrupt
    before the next command once `interrupted` (the signals received meanwhile) is not empty."""
    def run(*args: str) -> None:
        _stop_if(interrupted)
        _run(*args)

    br = topo.bridge_namespace
    run("ip", "netns", "add", br)
    run("ip", "-n", br, "link", "set", "lo", "up")
    bridges = ["br0", "br1"] if topo.slow_link_bits else ["br0"]
    for bridge in bridges:
        run("ip", "-n", br, "link", "add", bridge, "type", "bridge", "forward_delay", "0", "stp_state", "0")
        run("ip", "-n", br, "link", "set", bridge, "up")
    if topo.slow_link_bits:  # the slow link between the clusters, shaped on both ends
        run("ip", "-n", br, "link", "add", "xa", "type", "veth", "peer", "name", "xb")
        for end, bridge in (("xa", "br0"), ("xb", "br1")):
            run("ip", "-n", br, "link", "set", end, "master", bridge)
            run("ip", "-n", br, "link", "set", end, "up")
            run("tc", "-n", br, "qdisc", "add", "dev", end, "root", "tbf", *tbf_arguments(topo.slow_link_bits))
    tbf = tbf_arguments(topo.rate_bits)
    for rank in range(topo.ranks):
        ns, port = topo.namespace(rank), f"r{rank}"
        run("ip", "netns", "add", ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "link", "add", INTERFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", br)
        run("ip", "-n", ns, "addr", "add", f"{topo.address(rank)}/24", "dev", INTERFACE)
        run("ip", "-n", ns, "link", "set", INTERFACE, "up")
        run("ip", "-n", br, "link", "set", port, "master", bridges[topo.cluster(rank)])
        run("ip", "-n", br, "link", "set", port, "up")
        run("tc", "-n", ns, "qdisc", "add", "dev", INTERFACE, "root", "tbf", *tbf)
        run("tc", "-n", br, "qdisc", "add", "dev", port, "root", "tbf", *tbf)


def _stop_if(interrupted: list[int]) -> None:
    """Raise the KeyboardInterrupt a signal in `interrupted` (received while interrupts were deferred) stands for."""
    if interrupted:
        raise KeyboardInterrupt(f"signal {interrupted[0]}")


def destroy(topo: Topology | str) -> list[str]:
    """Remove a topology's namespaces (their links and qdiscs go with them) and its state file; returns what was
    removed. Safe to call on a half-built or already removed topology."""
    name = topo if isinstance(topo, str) else topo.name
    with _registry_lock():
        return _destroy(name)


def _destroy(name: str) -> list[str]:
    removed, errors = [], []
    for ns in _namespaces():
        if ns.startswith(f"{PREFIX}{name}-"):
            proc = subprocess.run(["ip", "netns", "delete", ns], capture_output=True, text=True)
            (removed.append(ns) if proc.returncode == 0 else errors.append(f"{ns}: {proc.stderr.strip()}"))
    if errors:
        raise NetnsError("could not remove namespaces: " + "; ".join(errors))
    _state_file(name).unlink(missing_ok=True)
    return removed


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def topologies() -> list[Topology]:
    """Every topology with a state file, plus namespaces named like ours that have none (orphans, owner pid -1)."""
    # Namespaces first: a state file is written before its namespaces and removed after them, so every
    # namespace listed here either has its state file below or is an orphan.
    namespaces = [ns for ns in _namespaces() if ns.startswith(PREFIX)]
    found: dict[str, Topology] = {}
    if state_dir().is_dir():
        for path in sorted(state_dir().glob("*.json")):
            try:
                found[path.stem] = Topology(**json.loads(path.read_text()))
            except (ValueError, TypeError):
                found[path.stem] = Topology(path.stem, 0, 0, -1)
    for ns in namespaces:
        name = ns[len(PREFIX):].rsplit("-", 1)[0]
        found.setdefault(name, Topology(name, 0, 0, -1))
    return list(found.values())


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(topo: Topology) -> bool:
    """Left behind: the launcher named in its state file is gone (killed before it could clean up). Namespaces
    without a state file here are not stale: another registry ($AQPIPE_NETNS_STATE) may own them; `aqpipe netns
    down` removes them by name."""
    return topo.owner_pid > 0 and not _alive(topo.owner_pid)


def remove_stale() -> list[str]:
    """Remove every stale topology; returns their names."""
    with _registry_lock():
        return _remove_stale()


def _remove_stale() -> list[str]:
    stale = [t.name for t in topologies() if is_stale(t)]
    for name in stale:
        _destroy(name)
    return stale


def describe(topo: Topology) -> str:
    """A few lines per namespace: its address and the qdisc shaping it."""
    owner = {0: "made by hand", -1: "no state file"}.get(topo.owner_pid, f"launcher pid {topo.owner_pid}")
    slow = (f", two clusters joined at {format_rate(topo.slow_link_bits)}" if topo.slow_link_bits else "")
    lines = [f"topology {topo.name}: {topo.ranks} ranks at {format_rate(topo.rate_bits)}{slow}, {owner}"
             + (" (stale)" if is_stale(topo) else "")]
    present = [ns for ns in _namespaces() if ns.startswith(f"{PREFIX}{topo.name}-") and not ns.endswith("-br")]
    expected = [topo.namespace(r) for r in range(topo.ranks)] or sorted(present)
    for ns in expected:
        if ns not in present:
            lines.append(f"  {ns}: missing")
            continue
        address = f"{SUBNET}.{int(ns.rsplit('-', 1)[1]) + 1}"
        qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", INTERFACE], capture_output=True, text=True)
        lines.append(f"  {ns}: {address} on {INTERFACE}; {qdisc.stdout.strip() or 'no qdisc'}")
    return "\n".join(lines)


@contextmanager
def throttled(ranks: int, rate_bits: int, slow_link_bits: int = 0) -> Iterator[Topology]:
    """A topology for the duration of a `with` block, removed on every way out of it."""
    topo = create(ranks, rate_bits, slow_link_bits=slow_link_bits)
    try:
        yield topo
    finally:
        destroy(topo)
