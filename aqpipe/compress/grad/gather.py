"""All-gather of per-replica byte payloads, equal or not in size: the communicator of the compressors whose
messages cannot be summed on the wire (quantized codes, sparse values and indices)."""

from __future__ import annotations

import torch

from aqpipe.compress.grad.base import DPGroup
from aqpipe.compress.grad.wire import gathered_message_bytes


def all_gather_bytes_payloads(dp: DPGroup, payload: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Every replica's uint8 payload, in replica order, and the bytes this replica sent. Sizes may differ: the
    lengths go first, then every payload padded to the longest (torch.distributed gathers equal shapes only)."""
    import torch.distributed as dist

    n = dp.size
    if n == 1:
        return [payload], 0
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    lengths = [torch.zeros_like(length) for _ in range(n)]
    dist.all_gather(lengths, length, group=dp.group)
    sizes = [int(x) for x in lengths]
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=payload.device)
    padded[: payload.numel()] = payload
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded, group=dp.group)
    sent = gathered_message_bytes(longest, n)
    return [o[:size] for o, size in zip(out, sizes)], sent
