"""Copies of every rank's checkpoint part on other hosts, so that a run survives a host that loses its disk.

After each checkpoint every rank sends its part (its file and checksum line) to the first rank of each of the next
`--checkpoint-replicas` hosts, on a thread of its own and a process group of its own, paced to a share of the link
between hosts, while training goes on; the receivers keep the copies in the same step directory, under the same
names, once they match their checksum lines. A part travels and lands a piece at a time, never whole in memory.
Once every copy of a step is kept, every host marks the step REPLICATED. A rank whose host lost its part (a wiped
disk, a new machine) fetches it from a copy before it resumes (`fetch_missing`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from aqpipe.disk import write_atomic
from aqpipe.pipeline import comm
from aqpipe.pipeline.grid import Grid
from aqpipe.runtime.checkpoints.parts import rank_file, step_dir

COPYING = "COPYING"  # a step directory's marker: copies of its parts are kept (written before COMPLETE); the step
# counts as copied only once REPLICATED, and one never copied (its predecessor's copies were travelling) keeps COPYING alone
REPLICATED = "REPLICATED"  # a step directory's marker: every part of the step is on its host and on its copies' hosts
CHUNK_BYTES = 1 << 20  # a copy travels in pieces of at most this size, each paced (a fetch, unpaced, in these)
MIN_PIECE_BYTES = 64 << 10
# A paced copy's pieces are what its pace sends in this long, so that one crosses the link at its full rate in a
# twentieth of that (a tenth of the link): a step's messages queued behind one on a shaped link wait milliseconds.
# 1 MiB pieces made a SmolLM2 step over 100 Mbit/s links 15% slower while copies travelled.
PIECE_SECONDS = 0.05
NICE = 19  # the copies' thread's nice value
LINK_SHARE = 0.1  # the share of the link between hosts (the highest rate measured on it) a host's copies may take
MIN_RATE = 256 << 10  # bytes/s a host's copies may take where no rate was measured, or a lower one (small messages)


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
    other ranks send it, on a thread (`start`; `busy` while it runs; `wait` for it)."""

    def __init__(self, out: str | Path, grid: Grid, hosts: list[str], copies: int, timeout) -> None:
        self.out, self.grid, self.hosts = Path(out), grid, hosts
        self.rank = grid.rank
        self.plan = copy_plan(hosts, copies)
        self.peak = 0.0  # the highest rate this rank measured on a link to another host (bytes/s)
        # every rank makes the group at once; only the copies' thread uses it (a communicator is never shared by
        # two threads)
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._thread: threading.Thread | None = None
        self.step: int | None = None  # the checkpoint whose parts were copied last (or are being copied)

    def observe(self, stats) -> None:
        """Take a step's link measurements (`StepStats`): the links whose other end is on another host."""
        for direction, peer_stage in (("fwd", self.grid.stage - 1), ("bwd", self.grid.stage + 1)):
            if not 0 <= peer_stage < self.grid.pp:
                continue
            peer = self.grid.rank_of(peer_stage, self.grid.replica)
            seconds = getattr(stats, f"{direction}_recv_seconds")
            if self.hosts[peer] != self.hosts[self.rank] and seconds > 0:
                self.peak = max(self.peak, getattr(stats, f"{direction}_recv_bytes") / seconds)

    def rate(self) -> float:
        """Bytes/s this rank's copies may take: its host's share of the link between hosts, split among its ranks."""
        host_ranks = self.hosts.count(self.hosts[self.rank])
        return max(LINK_SHARE * self.peak, MIN_RATE) / host_ranks

    def start(self, step: int, leader: bool) -> None:
        """Copy the parts of the checkpoint of `step` in the background (every rank calls it, after the checkpoint is
        marked complete on every host); `leader`: this rank marks its host's step directory."""
        self.wait()
        self.step = step
        marker = step_dir(self.out, step) / COPYING
        if leader and not marker.is_file():  # (a checkpoint's is written with it; a resumed one's may predate that)
            write_atomic(marker, b"", durable=True)
        self._thread = threading.Thread(target=self._run, args=(step, self.rate(), leader), daemon=True,
                                        name="aqpipe-checkpoint-copies")
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether copies are in flight."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the copies in flight are done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, step: int, rate: float, leader: bool) -> None:
        """One step's copies; a copy that cannot be kept (damaged on the way, a full disk) leaves the step without
        REPLICATED on every host, said once on stderr, and training goes on (the step then counts as complete only
        while every part is on its own host)."""
        problem = ""
        yield_to_training()
        try:
            copy_step(self.out, step, self.rank, self.plan, self.group, rate)
        except Exception as e:  # noqa: BLE001 - told to every rank below
            problem = f"rank {self.rank}: {type(e).__name__}: {e}"
        verdicts: list = [None] * len(self.plan)
        dist.all_gather_object(verdicts, problem, group=self.group)
        failed = [v for v in verdicts if v]
        if failed:
            if self.rank == 0:
                print(f"aqpipe: the copies of the checkpoint of step {step} to other hosts failed ({failed[0]}); it "
                      "counts as complete only while every part is on its own host", file=sys.stderr, flush=True)
        elif leader:
            write_atomic(step_dir(self.out, step) / REPLICATED, b"", durable=True)


def yield_to_training() -> None:
    """Run the calling thread (the copies') at the lowest CPU priority: where a host's cores are all busy training, its
    own work (reading, hashing, writing the pieces) waits for the step's; gloo's transport threads keep theirs."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)  # (Linux: one thread's own nice value)
    except (AttributeError, OSError):
        pass


def copy_step(out: Path, step: int, rank: int, plan: dict[int, list[int]], group, rate: float | None) -> int:
    """Send this rank's part of `step` to its copies' ranks and keep what the others send here, all pairs at once,
    piece by piece (this rank's sending paced to `rate` bytes/s); returns the bytes this rank sent (counted as
    checkpoint traffic as they go). Every rank of `group` calls it."""
    own = rank_file(step_dir(out, step), rank)
    line = own.with_suffix(".sha256").read_text()
    sizes: list = [None] * len(plan)
    dist.all_gather_object(sizes, (own.stat().st_size, line, piece_bytes(rate)), group=group)
    senders = [src for src, holders in plan.items() if rank in holders]
    landing = {src: Landing(out, step, src, sizes[src][1]) for src in senders}
    chunk_bytes = min(piece for _, _, piece in sizes)  # (every rank's pieces line up)
    pieces = max((size + chunk_bytes - 1) // chunk_bytes for size, _, _ in sizes)
    # A rank whose own disk fails it (its part unreadable, a copy it cannot write) goes on exchanging every piece, so
    # that no other rank waits for one that never comes; it keeps nothing and raises once the pieces are through.
    problems: list[str] = []
    own_size = sizes[rank][0]
    sent, start = 0, time.monotonic()
    part = _OwnPart(own, problems)
    try:
        for piece in range(pieces):
            lo = piece * chunk_bytes
            ops, inbound = [], {}
            length = max(0, min(chunk_bytes, own_size - lo))
            if length:
                chunk = part.read(length)
                outbound = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
                ops += [dist.P2POp(dist.isend, outbound, holder, group) for holder in plan[rank]]
            for src in senders:
                if lo < sizes[src][0]:
                    inbound[src] = torch.empty(min(chunk_bytes, sizes[src][0] - lo), dtype=torch.uint8)
                    ops.append(dist.P2POp(dist.irecv, inbound[src], src, group))
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
            if length:
                sent += length * len(plan[rank])
                comm.TRAFFIC.add(comm.CHECKPOINT, length * len(plan[rank]))
            if not problems:
                try:
                    for src, received in inbound.items():
                        landing[src].write(received.numpy().tobytes())
                except OSError as e:
                    problems.append(f"keeping a copy: {e}")
            if rate:  # (ahead of the pace: wait until the bytes sent so far fit it)
                time.sleep(max(0.0, sent / rate - (time.monotonic() - start)))
        if problems:
            raise RuntimeError(problems[0])
        for kept in landing.values():
            kept.keep()
    finally:
        part.close()
        for kept in landing.values():
            kept.discard()
    return sent


class _OwnPart:
    """This rank's part, read a piece at a time; once it cannot be read (noted in `problems`), zeros of the length
    asked, so the pieces keep their sizes."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.problems, self.file = problems, None
        try:
            self.file = open(path, "rb")
        except OSError as e:
            self._fail(str(e))

    def read(self, length: int) -> bytes:
        if self.file is not None:
            try:
                chunk = self.file.read(length)
                if len(chunk) == length:
                    return chunk
                self._fail(f"it ended {length - len(chunk)} bytes early")
            except OSError as e:
                self._fail(str(e))
        return bytes(length)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def _fail(self, why: str) -> None:
        self.problems.append(f"reading its part: {why}")
        self.close()
        self.file = None


def piece_bytes(rate: float | None) -> int:
    """The size of a copy's pieces at a pace of `rate` bytes/s (None: unpaced)."""
    if not rate:
        return CHUNK_BYTES
    return int(min(CHUNK_BYTES, max(MIN_PIECE_BYTES, rate * PIECE_SECONDS)))


class Landing:
    """A part arriving from another rank: written to a temporary file piece by piece (`write`) and hashed as it
    comes, kept under its own name with its checksum line (`keep`) only if it matches that line; `discard` removes
    what is left of one not kept."""

    def __init__(self, out: Path, step: int, rank: int, line: str) -> None:
        self.step, self.rank, self.line = step, rank, line
        self.path = rank_file(step_dir(out, step), rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(f".{self.path.name}.copy.tmp")
        self.file = open(self.tmp, "wb")
        self.sha = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.sha.update(data)
        self.file.write(data)

    def keep(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.sha.hexdigest() != self.line.split()[0]:
            raise RuntimeError(f"the copy of rank {self.rank}'s part of step {self.step} arrived damaged (its SHA-256 "
                               "differs)")
        os.replace(self.tmp, self.path)
        write_atomic(self.path.with_suffix(".sha256"), self.line.encode(), durable=True)

    def discard(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


def fetch_missing(out: str | Path, step: int, rank: int, needs: list[bool], holders: list[list[int]]) -> None:
    """Before a resume from `step` (every rank together): each rank that `needs` its part receives it — its file,
    a piece at a time, its checksum line and the step's record — from the first rank `holders` names for it, whose
    host keeps a copy, and writes them to its own disk, marking the step complete there."""
    out = Path(out)
    directory = step_dir(out, step)
    for needy, need in enumerate(needs):
        if not need:
            continue
        source = holders[needy][0]
        if rank == source:
            part = rank_file(directory, needy)
            record = directory / "run.json"
            size, line = part.stat().st_size, part.with_suffix(".sha256").read_text()
            record_bytes = record.read_bytes() if record.is_file() else b""
            dist.send_object_list([(size, line, record_bytes)], dst=needy)
            with open(part, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
                    dist.send(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), dst=needy)
            comm.TRAFFIC.add(comm.SETUP, size + len(line) + len(record_bytes))
        elif rank == needy:
            box: list = [None]
            dist.recv_object_list(box, src=source)
            size, line, record = box[0]
            landing = Landing(out, step, needy, line)
            try:
                for lo in range(0, size, CHUNK_BYTES):
                    piece = torch.empty(min(CHUNK_BYTES, size - lo), dtype=torch.uint8)
                    dist.recv(piece, src=source)
                    landing.write(piece.numpy().tobytes())
                landing.keep()
            finally:
                landing.discard()
            if record:
                write_atomic(directory / "run.json", record, durable=True)
            write_atomic(directory / "COMPLETE", f"{len(needs)}\n".encode(), durable=True)
            print(f"aqpipe: rank {needy} on {socket.gethostname()}: fetched its part of the checkpoint of step {step} "
                  f"from rank {source}'s host", flush=True)
