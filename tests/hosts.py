"""Simulated hosts on one machine, for tests and benchmarks of real multi-host runs.

Each host is a network namespace of a throttled topology, named `host<h>` in a UTS namespace of its own, a name
every host resolves to its address (an /etc/hosts of their own) (`aqpipe.launch.netns`: its link to the others shaped
by `tc tbf` in both directions; the ranks of one host talk over that namespace's own addresses, unshaped), with a
private disk: a per-host directory bind-mounted, in a mount namespace of its own, at one path every host shares.
So a run directory or `$AQPIPE_CACHE` has the same path on every host and different contents, as on separate
machines. Each host runs one `torchrun … -m aqpipe launch …`, exactly the command the README's "Across hosts"
gives users (`Hosts.command` prints it). Needs root (namespaces, mounts, tc).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from aqpipe.launch import netns
from aqpipe.runtime.checkpoints.copier import set_priority
from aqpipe.runtime.checkpoints.preforked import PROCESS_NAME

# What torchrun's elastic (c10d) rendezvous needs so that aqpipe's ranks can restart: a store of its own per round
# (see aqpipe.pipeline.links.rendezvous.elastic_attempt)
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

# `sh -c` inside the host's mount and UTS namespaces: take the host's name, bind its disk at the shared path and the
# hosts' /etc/hosts over the machine's (every host's name resolves to its address, as on a real cluster's DNS), then
# become the command
MOUNT_THEN_EXEC = 'hostname "$3" && mount --bind "$1" "$2" && mount --bind "$4" /etc/hosts && shift 4 && exec "$@"'


@dataclass
class Hosts:
    """H simulated hosts with `ranks_per_host` ranks each; host h's disk is `root/host-h`, seen at `mount`."""

    topology: netns.Topology
    root: Path
    mount: Path
    ranks_per_host: int
    port: int

    @property
    def count(self) -> int:
        return self.topology.ranks

    def disk(self, host: int) -> Path:
        """Host `host`'s private disk, as this (the root) namespace sees it."""
        return self.root / f"host-{host}"

    def on_disk(self, host: int, path: Path | str) -> Path:
        """Where a path under the shared mount point lives on host `host`'s disk."""
        return self.disk(host) / Path(path).relative_to(self.mount)

    def torchrun(self, host: int, *aqpipe_args: str, max_restarts: int | None = None) -> list[str]:
        """The command a user types on host `host` (the README's), for `aqpipe <aqpipe_args>`: with `max_restarts`,
        the elastic one (torchrun's c10d rendezvous at host 0, which restarts every rank after a failure; its
        environment wants `ELASTIC_ENV`), else the static one."""
        if max_restarts is None:
            where = ["--node-rank", str(host), "--master-addr", self.name(0), "--master-port", str(self.port)]
        else:
            where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.name(0)}:{self.port}", "--rdzv-id", "aqpipe",
                     "--max-restarts", str(max_restarts)]
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.count),
                "--nproc-per-node", str(self.ranks_per_host), *where, "-m", "aqpipe", *aqpipe_args]

    def command(self, host: int, argv: list[str]) -> list[str]:
        """`argv` run on host `host`: in its network namespace, with its disk at the shared mount point."""
        return [*self.topology.exec_prefix(host), "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", MOUNT_THEN_EXEC, "sh", str(self.disk(host)), str(self.mount), self.name(host),
                str(self.hosts_file), *argv]

    @property
    def hosts_file(self) -> Path:
        """The /etc/hosts every host sees: localhost, and each host's name at its address."""
        return self.root / "etc-hosts"

    @staticmethod
    def name(host: int) -> str:
        """Host `host`'s name (its UTS namespace's hostname), as the docs' commands name hosts (host0, host1, ...)."""
        return f"host{host}"

    def start(self, host: int, *aqpipe_args: str, env: dict | None = None, log: Path | None = None,
              max_restarts: int | None = None) -> subprocess.Popen:
        """Start `torchrun … -m aqpipe <aqpipe_args>` on host `host` (its own session, output to `log`; elastic with
        `max_restarts`, see `torchrun`)."""
        out = open(log or self.disk(host) / "torchrun.log", "ab")
        elastic = ELASTIC_ENV if max_restarts is not None else {}
        try:
            return subprocess.Popen(self.command(host, self.torchrun(host, *aqpipe_args, max_restarts=max_restarts)),
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, **elastic, **(env or {})})
        finally:
            out.close()

    def kill_ranks(self, proc: subprocess.Popen) -> list[int]:
        """SIGKILL the ranks of a host's torchrun `proc`, leaving torchrun itself (a process that crashed); returns
        their pids."""
        ranks = [pid for pid in descendants(proc.pid) if _is_rank(pid)]
        _signal(ranks, signal.SIGKILL)
        return ranks

    @contextmanager
    def paused(self, procs: list[subprocess.Popen]) -> Iterator[None]:
        """Every rank of the torchruns `procs` stopped (SIGSTOP) inside; on the way out those still alive go on
        (SIGCONT)."""
        ranks = [pid for proc in procs for pid in descendants(proc.pid) if _is_rank(pid)]
        _signal(ranks, signal.SIGSTOP)
        try:
            yield
        finally:
            _signal(ranks, signal.SIGCONT)

    def hurry_copies(self, procs: list[subprocess.Popen]) -> None:
        """The checkpoint copies' processes of the torchruns `procs` at their ranks' priority, as a rank whose copy
        outlasts its time puts them (a stopped rank cannot; and on a machine shared with other work their SCHED_IDLE
        would keep them waiting)."""
        for pid, _ in [found for proc in procs for found in copies_processes(proc)]:
            set_priority(pid, idle=False)

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL a host's whole process tree (torchrun and every rank it started), as when a machine dies."""
        _signal([*descendants(proc.pid), proc.pid], signal.SIGKILL)
        proc.wait()


def _argv(pid: int) -> list[bytes]:
    """Process `pid`'s command line (empty once it has ended)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _is_rank(pid: int) -> bool:
    """Whether process `pid` is an aqpipe rank torchrun started (not torchrun itself, nor a rank's copies' process)."""
    argv = _argv(pid)
    return b"aqpipe" in argv and b"torch.distributed.run" not in argv and not _is_copies(pid)


def _is_copies(pid: int) -> bool:
    """Whether process `pid` is a rank's checkpoint copies' process (forked from its rank, whose command line it
    shows, or started afresh)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_bytes().strip()
    except OSError:
        return False
    return name == PROCESS_NAME or b"aqpipe.runtime.checkpoints.copier" in _argv(pid)


def copies_processes(proc: subprocess.Popen) -> list[tuple[int, bool]]:
    """The checkpoint copies' processes under a host's torchrun `proc`: each one's pid, and whether its rank forked
    it (rather than starting an interpreter of its own)."""
    return [(pid, b"aqpipe.runtime.checkpoints.copier" not in _argv(pid)) for pid in descendants(proc.pid)
            if _is_copies(pid)]


def _signal(pids: list[int], number: int) -> None:
    """Send signal `number` to each of `pids` that is still alive."""
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first found, then theirs), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def wipe(disk: Path) -> None:
    """A host's disk that comes back empty: everything on it gone, the directory kept."""
    for path in disk.iterdir():
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def verify_stores(hosts: Hosts, run: Path) -> subprocess.CompletedProcess:
    """`aqpipe store verify` of the run in `run` as a user runs it across hosts: `aqpipe store digest` on every host
    but host 0, each digest file copied to host 0's disk, and `verify` there given them all."""
    digests = []
    for host in range(1, hosts.count):
        digest = hosts.mount / f"host-{host}.digests.json"
        subprocess.run(hosts.command(host, [sys.executable, "-m", "aqpipe", "store", "digest", str(run), "--out",
                                            str(digest)]), check=True, capture_output=True, timeout=120)
        hosts.on_disk(0, digest).write_bytes(hosts.on_disk(host, digest).read_bytes())
        digests.append(str(digest))
    return subprocess.run(hosts.command(0, [sys.executable, "-m", "aqpipe", "store", "verify", str(run), *digests]),
                          capture_output=True, text=True, timeout=120)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Every host's exit code, waiting at most `timeout` seconds in all (then killing what is left: -9)."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            _signal([*descendants(proc.pid), proc.pid], signal.SIGKILL)
            proc.wait()
            codes.append(-9)
    return codes


@contextmanager
def simulated_hosts(root: Path, count: int, ranks_per_host: int, rate_bits: int, port: int = 29517
                    ) -> Iterator[Hosts]:
    """`count` hosts with private disks under `root`, joined by links of `rate_bits`; everything is removed on the
    way out (the namespaces; the mounts lived only in the hosts' processes)."""
    mount = root / "mnt"
    mount.mkdir(parents=True, exist_ok=True)
    for host in range(count):
        (root / f"host-{host}").mkdir(parents=True, exist_ok=True)
    with netns.throttled(count, rate_bits) as topology:
        hosts = Hosts(topology, root, mount, ranks_per_host, port)
        names = "".join(f"{topology.address(h)} {hosts.name(h)}\n" for h in range(count))
        hosts.hosts_file.write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")
        yield hosts
