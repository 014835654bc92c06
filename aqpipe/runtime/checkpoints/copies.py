"""Copies of every rank's checkpoint part on other hosts, so that a run survives a host that loses its disk.

After each checkpoint every rank sends its part (its file and checksum line) to the first rank of each of the next
`--checkpoint-replicas` hosts, from a process of its own (`copier`), paced to a share of the link between hosts,
while training goes on; the receivers keep the copies in the same step directory, under the same
names, once they match their checksum lines. A part travels and lands a piece at a time, never whole in memory.
Once every copy of a step is kept, every host marks the step REPLICATED. A rank whose host lost its part (a wiped
disk, a new machine) fetches it from a copy before it resumes (`fetch_missing`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from aqpipe.disk import write_atomic
from aqpipe.pipeline.world import comm
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


def copy_step(out: Path, step: int, rank: int, plan: dict[int, list[int]], group, rate: float | None,
              sent: Callable[[int], None] | None = None, planned: Callable[[float], None] | None = None) -> int:
    """Send this rank's part of `step` to its copies' ranks and keep what the others send here, all pairs at once,
    piece by piece (this rank's sending paced to `rate` bytes/s); returns the bytes this rank sent, told to `sent`
    as they go (by default counted as checkpoint traffic), and tells `planned` the seconds the copy takes at that
    pace once the parts' sizes are known. Every rank of `group` calls it."""
    sent = sent or (lambda nbytes: comm.TRAFFIC.add(comm.CHECKPOINT, nbytes))
    # A rank whose own disk fails it (its part unreadable, a copy it cannot write) goes on exchanging every piece, so
    # that no other rank waits for one that never comes; it keeps nothing and raises once the pieces are through.
    problems: list[str] = []
    own = rank_file(step_dir(out, step), rank)
    try:
        own_size, line = own.stat().st_size, own.with_suffix(".sha256").read_text()
    except OSError as e:
        problems.append(f"reading its part: {e}")
        own_size, line = 0, ""
    sizes: list = [None] * len(plan)
    dist.all_gather_object(sizes, (own_size, line, piece_bytes(rate)), group=group)
    senders = [src for src, holders in plan.items() if rank in holders]
    landing = {src: Landing(out, step, src, sizes[src][1]) for src in senders}
    chunk_bytes = min(piece for _, _, piece in sizes)  # (every rank's pieces line up)
    if planned is not None and rate:  # (the largest part's copies, sent at this rank's pace)
        planned(max(size * len(plan[src]) for src, (size, _, _) in enumerate(sizes)) / rate)
    pieces = max((size + chunk_bytes - 1) // chunk_bytes for size, _, _ in sizes)
    unreadable = [src for src in senders if not sizes[src][1]]
    if unreadable:
        problems.append(f"rank {unreadable[0]} could not read its part")
    total, start = 0, time.monotonic()
    part = _OwnPart(own, problems) if own_size else None
    try:
        for piece in range(pieces):
            lo = piece * chunk_bytes
            ops, inbound = [], {}
            length = max(0, min(chunk_bytes, own_size - lo))
            if length and part is not None:
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
                total += length * len(plan[rank])
                sent(length * len(plan[rank]))
            if not problems:
                try:
                    for src, received in inbound.items():
                        landing[src].write(received.numpy().tobytes())
                except OSError as e:
                    problems.append(f"keeping a copy: {e}")
            if rate:  # (ahead of the pace: wait until the bytes sent so far fit it)
                time.sleep(max(0.0, total / rate - (time.monotonic() - start)))
        if problems:
            raise RuntimeError(problems[0])
        for kept in landing.values():
            kept.keep()
    finally:
        if part is not None:
            part.close()
        for kept in landing.values():
            kept.discard()
    return total


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
