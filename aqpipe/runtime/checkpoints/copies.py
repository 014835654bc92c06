"""Copies of every rank's checkpoint part on other hosts, so that a run survives a host that loses its disk.

After each checkpoint every rank sends its part (its file and checksum line) to the first rank of each of the next
`--checkpoint-replicas` hosts, from a process of its own (`copier`), while training goes on: each copy on a TCP
stream of its own, paced by the kernel to a share of the link between hosts; the receivers keep the copies in the
same step directory, under the same names, once they match their checksum lines. A part travels and lands a piece
at a time, never whole in memory. Once every copy of a step is kept, every host marks the step REPLICATED. A rank
whose host lost its part (a wiped disk, a new machine) fetches it from a copy before it resumes (`fetch_missing`).

Why the kernel paces: a copy sent in bursts makes a shaped link hold packets back and wake for each, and a receiver
is woken for every packet unless told to wait for more. Paced packet by packet (SO_MAX_PACING_RATE) and read a
quarter MiB at a time, 10 MiB copies between 4 simulated hosts at 1.25 MB/s cost their processes and the kernel's
packet work 16 ms of CPU per MB (`benchmarks/copies_cost.py`). Sent 16 KiB at a time by the sender (TCP_NODELAY),
the packet work ran inside the lowest-priority copies' process instead of from timers that interrupt the ranks (0.19%
of two busy processes' CPU against 1.23%, `copies_cost.py --where`), but took 36 ms per MB, copies 30% longer, and
SmolLM2's steps while copies travelled were no faster (+6.6% against +5.5%, `copies_slowdown.py`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from aqpipe.disk import write_atomic
from aqpipe.pipeline.links.streams import open_streams
from aqpipe.pipeline.world import comm
from aqpipe.runtime.checkpoints.parts import rank_file, step_dir

COPYING = "COPYING"  # a step directory's marker: copies of its parts are kept (written before COMPLETE); the step
# counts as copied only once REPLICATED, and one never copied (its predecessor's copies were travelling) keeps COPYING alone
REPLICATED = "REPLICATED"  # a step directory's marker: every part of the step is on its host and on its copies' hosts
CHUNK_BYTES = 1 << 20  # a copy is read, sent and written in pieces of at most this size (a fetch, unpaced, in these)
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # (Linux's number, where Python does not name it)
UNLIMITED_PACING = 2**32 - 1  # SO_MAX_PACING_RATE's value for no limit (~0U)
RECEIVE_LOW_WATER = 256 << 10  # a copy's receiver is woken once this much has arrived (see `_receive`)
# Where the kernel cannot pace a stream, its sender sends pieces of what its pace sends in this long, so that one
# crosses the link at its full rate in the share's part of that (1/400 s at 0.05) and a step's messages queued behind
# one wait milliseconds. 1 MiB pieces made a SmolLM2 step over 100 Mbit/s links 15% slower while copies travelled.
PIECE_SECONDS = 0.05
MIN_PIECE_BYTES = 64 << 10
MIN_RATE = 256 << 10  # bytes/s a host's copies may take where no rate was measured, or a lower one (small messages)
STREAM_TIMEOUT = 300.0  # seconds a copy's stream may wait for its peer (the copies' process gives the run's time-out)


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
              sent: Callable[[int], None] | None = None, planned: Callable[[float], None] | None = None,
              timeout: float = STREAM_TIMEOUT, unpaced: threading.Event | None = None) -> int:
    """Send this rank's part of `step` to its copies' ranks and keep what the others send here, every copy at once on
    a TCP stream of its own (this rank's streams together paced to `rate` bytes/s, unpaced once `unpaced` is set);
    returns the bytes this rank sent, told to `sent` as they go (from several threads, one at a time; by default
    counted as checkpoint traffic), and tells `planned` the seconds the copy takes at that pace once the parts' sizes
    are known. A stream that waits `timeout` seconds for its peer fails the copy. Every rank of `group` calls it."""
    sent = sent or (lambda nbytes: comm.TRAFFIC.add(comm.CHECKPOINT, nbytes))
    # A rank whose own disk fails it (its part unreadable, a copy it cannot write) still sends what it announced or
    # closes its streams early, and reads every byte sent to it, so that no other rank waits for one that never comes;
    # it keeps nothing and raises once the streams are through.
    problems: list[str] = []
    own = rank_file(step_dir(out, step), rank)
    try:
        own_size, line = own.stat().st_size, own.with_suffix(".sha256").read_text()
    except OSError as e:
        problems.append(f"reading its part: {e}")
        own_size, line = 0, ""
    sizes: list = [None] * len(plan)
    dist.all_gather_object(sizes, (own_size, line), group=group)
    senders = [src for src, holders in plan.items() if rank in holders]
    if planned is not None and rate:  # (the largest part's copies, sent at this rank's pace)
        planned(max(size * len(plan[src]) for src, (size, _) in enumerate(sizes)) / rate)
    unreadable = [src for src in senders if not sizes[src][1]]
    if unreadable:
        problems.append(f"rank {unreadable[0]} could not read its part")
    streams = open_streams([_stream_name(step, src, rank) for src in senders],
                           [_stream_name(step, rank, holder) for holder in plan[rank]], group, timeout)
    landing: dict[int, Landing | None] = {}
    try:
        for src in senders:
            try:
                landing[src] = Landing(out, step, src, sizes[src][1])
            except OSError as e:  # (its stream is read all the same)
                problems.append(f"keeping a copy: {e}")
                landing[src] = None
        counted = _Counter(sent)
        share = rate / len(plan[rank]) if rate and plan[rank] else None
        workers = [threading.Thread(target=_send, args=(streams[_stream_name(step, rank, holder)], own, own_size,
                                                        share, counted, problems, timeout, unpaced or threading.Event()))
                   for holder in plan[rank]]
        workers += [threading.Thread(target=_receive, args=(streams[_stream_name(step, src, rank)], src, landing[src],
                                                            sizes[src][0], problems, timeout))
                    for src in senders]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if problems:
            raise RuntimeError(problems[0])
        for kept in landing.values():
            assert kept is not None  # (one that could not be made is a problem above)
            kept.keep()
    finally:
        for stream in streams.values():
            stream.close()
        for kept in landing.values():
            if kept is not None:
                kept.discard()
    return counted.total


def _stream_name(step: int, src: int, holder: int) -> str:
    return f"aqpipe-copy/{step}/{src}/{holder}"


class _Counter:
    """The bytes this rank's streams sent, told to `sent` as they go (from several threads, one at a time)."""

    def __init__(self, sent: Callable[[int], None]) -> None:
        self.sent, self.total, self.lock = sent, 0, threading.Lock()

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.total += nbytes
            self.sent(nbytes)


def _send(stream: socket.socket, part: Path, size: int, rate: float | None, counted: _Counter, problems: list[str],
          timeout: float, unpaced: threading.Event) -> None:
    """Send `size` bytes of `part` on `stream` at `rate` bytes/s, paced by the kernel packet by packet where it can be
    (Linux's SO_MAX_PACING_RATE) and, a piece at a time, by this thread, until `unpaced` is set (then at the link's
    whole rate); the stream closed early if the part cannot be read."""
    try:
        if not size:  # (nothing to send: the stream closes at once)
            return
        stream.settimeout(timeout)
        kernel_paced = rate is not None and pace(stream, rate)
        # (where the kernel paces, this thread only keeps the socket's buffer from running ahead of the pace)
        piece = CHUNK_BYTES if kernel_paced else piece_bytes(rate)
        with open(part, "rb") as file:
            done, start = 0, time.monotonic()
            while done < size:
                if rate and unpaced.is_set():
                    rate, piece = None, CHUNK_BYTES
                    if kernel_paced:
                        pace(stream, UNLIMITED_PACING)
                count = stream.sendfile(file, offset=done, count=min(piece, size - done))
                if count == 0:
                    problems.append(f"reading its part: it ended {size - done} bytes early")
                    return
                done += count
                counted.add(count)
                if rate:  # (ahead of the pace: wait until the bytes sent so far fit it, or the pace is lifted)
                    unpaced.wait(max(0.0, done / rate - (time.monotonic() - start)))
    except Exception as e:  # noqa: BLE001 - the copy fails with it, on every rank
        problems.append(f"sending its part: {e}")
    finally:
        stream.close()


def _receive(stream: socket.socket, src: int, landing: Landing | None, size: int, problems: list[str],
             timeout: float) -> None:
    """Read the `size` bytes of rank `src`'s part from `stream` into `landing` (None: one that could not be made);
    all of them even once they cannot be kept, so that the sender never waits."""
    try:
        stream.settimeout(timeout)
        buffer = memoryview(bytearray(CHUNK_BYTES))
        got = 0
        while got < size:
            want = min(CHUNK_BYTES, size - got)
            # (woken once a quarter MiB, or the part's last bytes, have arrived: not for every packet of a paced
            # stream, which took twice the CPU per MB)
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(RECEIVE_LOW_WATER, want))
            count = stream.recv_into(buffer[:want])
            if count == 0:
                problems.append(f"the copy of rank {src}'s part ended {size - got} bytes early")
                return
            got += count
            if landing is not None:
                try:
                    landing.write(buffer[:count])
                except Exception as e:  # noqa: BLE001 - kept nowhere, read to its end all the same
                    problems.append(f"keeping a copy: {e}")
                    landing = None
    except Exception as e:  # noqa: BLE001 - the copy fails with it, on every rank
        problems.append(f"receiving rank {src}'s part: {e}")


def pace(stream: socket.socket, rate: float) -> bool:
    """Have the kernel send at most `rate` bytes/s on `stream`, spread packet by packet (UNLIMITED_PACING: no limit);
    returns whether it does (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        # (an unsigned 32-bit value: a C int, as Python passes an int, cannot hold the upper half)
        stream.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=I", int(min(max(rate, 1), UNLIMITED_PACING))))
        return True
    except OSError:
        return False


def piece_bytes(rate: float | None) -> int:
    """The size of the pieces a sender paces itself by at `rate` bytes/s, where the kernel cannot (None: unpaced)."""
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

    def write(self, data: bytes | memoryview) -> None:
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
        try:
            if not self.file.closed:
                self.file.close()  # (its last bytes may fail to reach a failing disk: removed all the same)
        except OSError:
            pass
        finally:
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
