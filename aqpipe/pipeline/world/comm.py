"""Every collective a rank runs outside the link streams and the grad sync, counted in bytes by traffic class.

A run over slow links must account for every byte it puts on the wire, so no module calls `torch.distributed`'s
collectives directly: they go through here, naming the traffic class they belong to, and `TRAFFIC` adds up what
this rank sent. (The link streams count their messages themselves, payload and framing apart; a grad-sync method
counts its own `bytes_sent`, since what it sends depends on its compressor.)

What one rank sends in a collective depends on the algorithm the backend picks; the counts here are those of the
usual ones: a ring all-reduce sends 2·(n−1)/n of the tensor from every member, a ring all-gather (n−1) times each
member's part, a gather each non-root member's part once, a broadcast the root's tensor to each other member.
Objects count as the bytes of their pickle, which is what torch sends for them.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from aqpipe.compress.grad.wire import ring_all_reduce_bytes

# The traffic classes outside the links (one vocabulary: metrics fields are `<class>_bytes`).
GRAD_SYNC, TIED, CONTROL, EVALUATION, FINAL_WEIGHTS, SETUP, CHECKPOINT = (
    "grad_sync", "tied", "control", "evaluation", "final_weights", "setup", "checkpoint")
CLASSES = (GRAD_SYNC, TIED, CONTROL, EVALUATION, FINAL_WEIGHTS, SETUP, CHECKPOINT)


@dataclass
class Traffic:
    """Bytes this rank has sent so far, by traffic class."""

    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))

    def add(self, traffic: str, nbytes: int) -> None:
        """Count `nbytes` sent in class `traffic`."""
        if traffic not in self.sent:
            raise ValueError(f"unknown traffic class {traffic!r}; one of {', '.join(CLASSES)}")
        self.sent[traffic] += int(nbytes)

    def snapshot(self) -> dict[str, int]:
        """The counts so far (a copy: subtract two snapshots for what a span of work sent)."""
        return dict(self.sent)


TRAFFIC = Traffic()  # one rank per process


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, traffic: str, group=None, op=dist.ReduceOp.SUM) -> None:
    """`dist.all_reduce`, counted."""
    dist.all_reduce(tensor, op=op, group=group)
    TRAFFIC.add(traffic, ring_all_reduce_bytes(_nbytes(tensor), _size(group)))


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, traffic: str, group=None) -> None:
    """`dist.all_gather`, counted."""
    dist.all_gather(outputs, tensor, group=group)
    TRAFFIC.add(traffic, (_size(group) - 1) * _nbytes(tensor))


def ordered_sum(tensor: torch.Tensor, traffic: str, group=None) -> None:
    """`tensor` becomes the sum of every member's, added in the group's rank order: the same bits in every group of
    the same layout, whatever order a backend would add in (NCCL picks its algorithm and ring per communicator, from
    each one's topology, so two replicas' pipelines may add their stages' terms in different orders, and float sums
    of three terms or more depend on the order). An all-gather: (n − 1) times the tensor from each member, where a
    ring all-reduce sends 2·(n − 1)/n times."""
    parts = [torch.empty_like(tensor) for _ in range(_size(group))]
    all_gather(parts, tensor, traffic, group)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    tensor.copy_(total)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, traffic: str, dst: int = 0, group=None
           ) -> None:
    """`dist.gather` to global rank `dst`, counted."""
    dist.gather(tensor, gather_list, dst=dst, group=group)
    if dist.get_rank() != dst:
        TRAFFIC.add(traffic, _nbytes(tensor))


def all_gather_object(outputs: list, obj, traffic: str, group=None) -> None:
    """`dist.all_gather_object`, counted: torch pads every member's pickle to the largest, and each member sends
    its padded pickle to the others (and its size first)."""
    dist.all_gather_object(outputs, obj, group=group)
    largest = max(len(pickle.dumps(o)) for o in outputs)
    TRAFFIC.add(traffic, (_size(group) - 1) * (largest + 8))


def send_bytes(data: bytes, dst: int, traffic: str, device: torch.device, piece: int) -> None:
    """Send `data` to global rank `dst` (which receives it with `receive_bytes_from_all`, the same `piece`): its
    length, then its bytes in pieces of `piece` bytes (a piece's wait, not a transfer's, is what the process group's
    time-out bounds), as tensors on `device` (the collectives' device); counted."""
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst)
    view = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    for start in range(0, len(data), piece):
        dist.send(view[start : start + piece].to(device), dst)
        # one piece queued at a time: NCCL times a send from when it is queued, so pieces queued together would
        # wait out the whole transfer under one time-out
        finish_queued(device)
    TRAFFIC.add(traffic, 8 + len(data))


def receive_bytes_from_all(sources: list[int], device: torch.device, piece: int,
                           on_round: Callable[[int, int], None] | None = None) -> list[bytes]:
    """What each global rank of `sources` sends with `send_bytes`, taken from all of them at once: their lengths,
    then rounds of one piece from each that has bytes left, so that no sender waits for another's whole transfer (a
    piece's send waits at most for the rest of one round and its share of the next); `on_round(bytes received,
    bytes in all)` after each round."""
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in sources]
    for work in [_irecv(size, src) for size, src in zip(sizes, sources)]:
        work.wait()
    totals = [int(size.item()) for size in sizes]
    received = [bytearray() for _ in sources]
    while True:
        pieces = [(i, torch.empty(min(piece, totals[i] - len(received[i])), dtype=torch.uint8, device=device))
                  for i in range(len(sources)) if len(received[i]) < totals[i]]
        if not pieces:
            return [bytes(data) for data in received]
        works = [_irecv(buffer, sources[i]) for i, buffer in pieces]
        for (i, buffer), work in zip(pieces, works):
            work.wait()
            received[i] += buffer.cpu().numpy().tobytes()
        if on_round is not None:
            on_round(sum(map(len, received)), sum(totals))


def _irecv(tensor: torch.Tensor, src: int) -> dist.Work:
    work = dist.irecv(tensor, src)
    assert work is not None, "every rank is a member of the default group"
    return work


def finish_queued(device: torch.device) -> None:
    """Wait until what this rank queued on `device` — collectives, sends — has completed: under NCCL a call returns
    once queued, and a rank that then tore its process group down could cut a peer's transfer short (torch before
    2.6 aborted the communicators in `destroy_process_group`). On the host gloo's calls have completed already."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def leave_process_groups(failed: bool) -> None:
    """Tear this rank's process groups down: gracefully after a finished run, by abort after a failure. NCCL's graceful
    teardown (torch >= 2.6) waits for the work queued on its communicators; after a failure that is a collective the
    other ranks never join, so the rank would hang until the watchdog killed it and its error never reached anyone."""
    if not dist.is_initialized():
        return
    if failed:
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - the run's own error is the one to report, and the process ends anyway
            pass
    else:
        dist.destroy_process_group()


def broadcast_object_list(objects: list, traffic: str, src: int = 0) -> None:
    """`dist.broadcast_object_list` from global rank `src`, counted on the sender."""
    dist.broadcast_object_list(objects, src=src)
    if dist.get_rank() == src:
        TRAFFIC.add(traffic, (dist.get_world_size() - 1) * len(pickle.dumps(objects)))


def barrier(traffic: str = CONTROL) -> None:
    """`dist.barrier` (gloo: an all-reduce of one value; counted as such)."""
    dist.barrier()
    TRAFFIC.add(traffic, ring_all_reduce_bytes(4, dist.get_world_size()))
