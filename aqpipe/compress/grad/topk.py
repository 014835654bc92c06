"""`--grad-sync topk:F`: keep the largest fraction F of the compensated gradient by magnitude, error feedback for
the rest; replicas all-gather (value, index) pairs and average the scattered sums."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aqpipe.compress.grad.base import DPGroup
from aqpipe.compress.grad.feedback import FeedbackCompressor
from aqpipe.compress.grad.gather import all_gather_bytes_payloads
from aqpipe.compress.grad.methods import GradSpec
from aqpipe.compress.grad.wire import SyncBytes, gathered_message_bytes


def sparse_payload(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """fp32 values then int32 indices, as bytes."""
    return torch.cat([values.float().contiguous().view(torch.uint8), indices.to(torch.int32).contiguous().view(torch.uint8)])


def scatter_payloads(payloads: list[torch.Tensor], numel: int) -> torch.Tensor:
    """The mean over replicas of their sparse vectors, densified."""
    total = torch.zeros(numel, device=payloads[0].device)
    for payload in payloads:
        k = payload.numel() // 8
        values = payload[: 4 * k].view(torch.float32)
        indices = payload[4 * k :].view(torch.int32).long()
        if k and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            raise ValueError(f"a replica sent indices outside 0..{numel - 1}")
        total.index_add_(0, indices, values)
    return total.div_(len(payloads))


class SparseFeedback(FeedbackCompressor):
    """A sparsifier with error feedback whose replicas all-gather (value, index) pairs, keeping about the fraction of
    the gradient its spec's last argument gives (topk: exactly; sidco: its target, approached from below)."""

    pattern = "all-gather"
    kept_copies, peak_copies = 1.0, 5.1

    @classmethod
    def step_bytes(cls, spec: GradSpec, dp: int, shapes: Sequence[tuple[int, ...]], freeze_after: int) -> SyncBytes:
        """fp32 values and int32 indices of the kept fraction."""
        kept = max(1, math.ceil(spec.args[-1] * sum(math.prod(shape) for shape in shapes)))
        return SyncBytes.every_step(gathered_message_bytes(8 * kept, dp))

    @classmethod
    def memory_copies(cls, spec: GradSpec, dp: int) -> tuple[float, float]:
        """Its residual, and the kept fraction's values and indices, its own and every replica's, on top of the peak."""
        if dp < 2:
            return 0.0, 0.0
        fraction = spec.args[-1]
        return cls.kept_copies, cls.peak_copies + 9 * fraction + 2.5 * fraction * dp


class TopK(SparseFeedback):
    """Top-k sparsification with error feedback, all-gather pattern."""

    def __init__(self, dp: DPGroup, fraction: float) -> None:
        super().__init__(dp)
        self.fraction = fraction
        self.name = f"topk:{fraction:g}"

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        compensated = self.feedback.compensate(flat)
        k = max(1, math.ceil(self.fraction * flat.numel()))
        indices = compensated.abs().topk(k, sorted=False).indices
        values = compensated[indices]
        transmitted = torch.zeros_like(compensated).index_put_((indices,), values)
        self.feedback.update(compensated, transmitted)
        payloads, sent = all_gather_bytes_payloads(self.dp, sparse_payload(values, indices))
        self.bytes_sent += sent
        return scatter_payloads(payloads, flat.numel())

