"""Copies of every rank's checkpoint part on other hosts, so that a run survives a host that loses its disk.

After each checkpoint every rank sends its part (its file and checksum line) to the first rank of each of the next
`--checkpoint-replicas` hosts, on a thread of its own and a process group of its own, paced to a share of the
link, while training goes on; the receivers keep the copies in the same step directory, under the same names, and
check them against the checksum line. Once every copy of a step is on its disk, every host marks the step
REPLICATED. A rank whose host lost its part (a wiped disk, a new machine) fetches it from a copy before it resumes
(`fetch_missing`).
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from aqpipe.disk import write_atomic
from aqpipe.pipeline import comm
from aqpipe.runtime.checkpoint import rank_file, step_dir

COPYING = "COPYING"  # a step directory's marker: the step's parts are being copied (complete only once REPLICATED)
REPLICATED = "REPLICATED"  # a step directory's marker: every part of the step is on its host and on its copies' hosts
CHUNK_BYTES = 1 << 20  # a copy travels in pieces of this size, each paced
LINK_SHARE = 0.1  # the share of a rank's link rate (the highest it measured) its copies may take
MIN_RATE = 256 << 10  # bytes/s copies may always take (a link of small messages measures less than it carries)


def host_order(hosts: list[str]) -> list[str]:
    """The distinct hosts of the ranks' host names (rank order), in the order of each one's first rank."""
    return list(dict.fromkeys(hosts))


def copy_plan(hosts: list[str], copies: int) -> dict[int, list[int]]:
    """Rank -> the ranks that keep a copy of its part: the first rank of each of the `copies` hosts after its own
    (in `host_order`), so that no copy lies on the host it copies."""
    order = host_order(hosts)
    if copies > len(order) - 1:
        raise ValueError(f"--checkpoint-replicas {copies} needs {copies + 1} hosts, the ranks span {len(order)}")
    first = {host: hosts.index(host) for host in order}
    return {rank: [first[order[(order.index(host) + k) % len(order)]] for k in range(1, copies + 1)]
            for rank, host in enumerate(hosts)}


def default_copies(hosts: list[str], asked: int | None) -> int:
    """--checkpoint-replicas as given, else 1 where the ranks span several hosts and 0 on one."""
    return asked if asked is not None else int(len(host_order(hosts)) > 1)


class CheckpointCopier:
    """One rank's side of the copies: sends its part of each checkpoint to its copies' ranks and keeps the parts
    other ranks send it, on a thread (`start`, then `wait` before the next checkpoint or the run's end)."""

    def __init__(self, out: str | Path, rank: int, hosts: list[str], copies: int, timeout) -> None:
        self.out, self.rank, self.hosts = Path(out), rank, hosts
        self.plan = copy_plan(hosts, copies)
        # every rank makes the group at once; only the copies' thread uses it (a communicator is never shared by
        # two threads)
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def active(self) -> bool:
        return any(self.plan.values())

    def start(self, step: int, link_bytes_per_second: float | None, leader: bool) -> None:
        """Copy the parts of the checkpoint of `step` in the background (every rank calls it after the checkpoint is
        marked complete); `link_bytes_per_second`: this rank's measured link rate (None: unpaced); `leader`: this
        rank marks its host's step directory REPLICATED."""
        self.wait()
        if leader:
            write_atomic(step_dir(self.out, step) / COPYING, b"", durable=True)
        rate = max(LINK_SHARE * link_bytes_per_second, MIN_RATE) if link_bytes_per_second else None
        self._thread = threading.Thread(target=self._run, args=(step, rate, leader), daemon=True,
                                        name="aqpipe-checkpoint-copies")
        self._thread.start()

    def wait(self) -> None:
        """Until the copies in flight are done; raises the error that stopped them."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"rank {self.rank}: copying a checkpoint to other hosts failed: {error}") from error

    def _run(self, step: int, rate: float | None, leader: bool) -> None:
        try:
            copy_step(self.out, step, self.rank, self.plan, self.group, rate)
            done = torch.ones(1)
            dist.all_reduce(done, group=self.group)  # every copy of the step is on its disk
            if leader:
                write_atomic(step_dir(self.out, step) / REPLICATED, b"", durable=True)
        except BaseException as e:  # noqa: BLE001 - raised by `wait`, on the rank's own thread
            self._error = e


def copy_step(out: Path, step: int, rank: int, plan: dict[int, list[int]], group, rate: float | None,
              progress: Callable[[int], None] | None = None) -> int:
    """Send this rank's part of `step` to its copies' ranks and keep what the others send here, all pairs at once,
    piece by piece (each rank's sending paced to `rate` bytes/s); returns the bytes this rank sent (counted as
    checkpoint traffic). Every rank of `group` calls it."""
    own = rank_file(step_dir(out, step), rank)
    part = own.read_bytes()
    line = own.with_suffix(".sha256").read_bytes()
    sizes: list = [None] * len(plan)
    dist.all_gather_object(sizes, (len(part), line.decode()), group=group)
    senders = [src for src, holders in plan.items() if rank in holders]
    received = {src: bytearray() for src in senders}
    pieces = max((size + CHUNK_BYTES - 1) // CHUNK_BYTES for size, _ in sizes)
    sent, start = 0, time.monotonic()
    for piece in range(pieces):
        lo = piece * CHUNK_BYTES
        ops, inbound = [], {}
        if lo < len(part):
            outbound = torch.frombuffer(bytearray(part[lo:lo + CHUNK_BYTES]), dtype=torch.uint8)
            ops += [dist.P2POp(dist.isend, outbound, holder, group) for holder in plan[rank]]
            sent += outbound.numel() * len(plan[rank])
            comm.TRAFFIC.add(comm.CHECKPOINT, outbound.numel() * len(plan[rank]))
        for src in senders:
            if lo < sizes[src][0]:
                inbound[src] = torch.empty(min(CHUNK_BYTES, sizes[src][0] - lo), dtype=torch.uint8)
                ops.append(dist.P2POp(dist.irecv, inbound[src], src, group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for src, piece_in in inbound.items():
            received[src] += piece_in.numpy().tobytes()
        if progress is not None:
            progress(sent)
        if rate:  # (ahead of the pace: wait until the bytes sent so far fit it)
            time.sleep(max(0.0, sent / rate - (time.monotonic() - start)))
    for src, whole in received.items():
        keep_copy(out, step, src, bytes(whole), sizes[src][1])
    return sent


def keep_copy(out: Path, step: int, rank: int, part: bytes, line: str) -> None:
    """Write rank `rank`'s part of `step`, received from elsewhere, under its own name, once it matches its
    checksum line (a RuntimeError otherwise)."""
    if hashlib.sha256(part).hexdigest() != line.split()[0]:
        raise RuntimeError(f"the copy of rank {rank}'s part of step {step} arrived damaged (its SHA-256 differs)")
    path = rank_file(step_dir(out, step), rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, part, durable=True)
    write_atomic(path.with_suffix(".sha256"), line.encode(), durable=True)


def fetch_missing(out: str | Path, step: int, rank: int, needs: list[bool], holders: list[list[int]]) -> None:
    """Before a resume from `step` (every rank together): each rank that `needs` its part receives it — its file,
    checksum line and the step's record — from the first rank `holders` names for it, whose host keeps a copy,
    and writes them to its own disk, marking the step complete there."""
    out = Path(out)
    directory = step_dir(out, step)
    for needy, need in enumerate(needs):
        if not need:
            continue
        source = holders[needy][0]
        if rank == source:
            files = [rank_file(directory, needy), rank_file(directory, needy).with_suffix(".sha256"),
                     directory / "run.json"]
            contents = [path.read_bytes() for path in files]
            dist.send_object_list([contents], dst=needy)
            comm.TRAFFIC.add(comm.SETUP, sum(len(b) for b in contents))
        elif rank == needy:
            box: list = [None]
            dist.recv_object_list(box, src=source)
            part, line, record = box[0]
            keep_copy(out, step, needy, part, line.decode())
            write_atomic(directory / "run.json", record, durable=True)
            write_atomic(directory / "COMPLETE", f"{len(needs)}\n".encode(), durable=True)
            print(f"aqpipe: rank {needy} on {socket.gethostname()}: fetched its part of the checkpoint of step {step} "
                  f"from rank {source}'s host", flush=True)
