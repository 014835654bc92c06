"""Ring collectives over one DP group with point-to-point sends, for codes no built-in collective can reduce.

Sign counts and sign bits travel packed to exactly the bits they need (gloo would sum uint8 with silent
wrap-around, and NCCL has no bitwise reduction), so the reduce-scatter and the all-gather are written here as N−1
steps of send-to-next / receive-from-previous. The vector is cut into N equal chunks (zero-padded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from aqpipe.compress.bitpack import pack, packed_bytes, unpack
from aqpipe.compress.grad.base import DPGroup

RING_TAG = 0x4752  # distinct from the pipeline's tags; ring peers hold the same stage, so they share no other traffic


def chunk_size(length: int, members: int) -> int:
    """Elements per chunk when a vector of `length` is cut into `members` equal chunks."""
    return -(-length // members) if length else 0


def split(codes: torch.Tensor, members: int) -> list[torch.Tensor]:
    """`members` equal chunks of a uint8 vector, the last zero-padded."""
    c = chunk_size(codes.numel(), members)
    padded = torch.zeros(c * members, dtype=torch.uint8, device=codes.device)
    padded[: codes.numel()] = codes
    return list(padded.view(members, c))


def exchange(dp: DPGroup, send: torch.Tensor, recv_bytes: int) -> torch.Tensor:
    """Send bytes to the next member while receiving `recv_bytes` from the previous one, as one batch of paired
    point-to-point ops (NCCL deadlocks on an unpaired isend-then-recv, and at dp=2 next and previous are one peer)."""
    import torch.distributed as dist

    recv = torch.empty(recv_bytes, dtype=torch.uint8, device=send.device)
    ops = [dist.P2POp(dist.isend, send.contiguous(), dp.next_rank, dp.group, RING_TAG),
           dist.P2POp(dist.irecv, recv, dp.prev_rank, dp.group, RING_TAG)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv


def reduce_scatter(dp: DPGroup, chunks: list[torch.Tensor], bits_at: Callable[[int], int],
                   combine: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[int, torch.Tensor, int]:
    """Ring reduction of per-chunk codes: at step s (0..N−2) member w sends its running codes of chunk (w−s) mod N,
    packed in `bits_at(s)` bits, and folds its own codes into the chunk it receives with `combine(s, received,
    own)`. Returns the chunk index this member ends up holding ((w+1) mod N), its fully reduced codes, and the
    bytes it sent."""
    n, w = dp.size, dp.index
    c = chunks[0].numel()
    current, sent = chunks[w], 0
    for s in range(n - 1):
        bits = bits_at(s)
        payload = pack(current.view(1, -1), bits).view(-1)
        received = unpack(exchange(dp, payload, packed_bytes(c, bits)).view(1, -1), bits, c).view(-1)
        current = combine(s, received, chunks[(w - s - 1) % n])
        sent += payload.numel()
    return (w + 1) % n, current, sent


def all_gather(dp: DPGroup, owned: int, codes: torch.Tensor, bits: int) -> tuple[list[torch.Tensor], int]:
    """Ring all-gather of one chunk of `bits`-bit codes per member (member w holds chunk `owned`); returns every
    chunk in order and the bytes this member sent."""
    n = dp.size
    c = codes.numel()
    chunks: list[torch.Tensor | None] = [None] * n
    chunks[owned] = codes
    current, sent = codes, 0
    for s in range(n - 1):
        payload = pack(current.view(1, -1), bits).view(-1)
        current = unpack(exchange(dp, payload, packed_bytes(c, bits)).view(1, -1), bits, c).view(-1)
        chunks[(owned - s - 1) % n] = current
        sent += payload.numel()
    filled = [chunk for chunk in chunks if chunk is not None]
    if len(filled) != n:
        raise RuntimeError(f"the ring all-gather ended with {n - len(filled)} of {n} chunks missing")
    return filled, sent
