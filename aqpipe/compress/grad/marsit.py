"""`--grad-sync marsit:K`: Marsit (Sign Bit is Enough, DAC 2022, Algorithms 1 and 2).

Every step each replica adds its compensation to its gradient, u = g + c, and the replicas synchronize the sign
bits of u over a ring: the member that is the m-th to fold its bits into a chunk combines the received bits v
with its own v* by v ⊙ v* = (v AND v*) OR ((v XOR v*) AND t), where the transient vector t is Bernoulli with
P(t=1) = (m−1)/m where v* = 0 and 1/m where v* = 1 — so the final bit is 1 with probability equal to the fraction
of replicas whose bit is 1 (unbiased aggregation, no re-compression per hop). A 1-bit all-gather shares the result.
The update is g_t = η_s · sign, and each replica keeps the compensation c ← u − g_t. Every K-th step (t mod K = 0,
the first step included; K = 0: never) the replicas instead average u in full precision and reset c to 0.

As in Algorithm 2, everything is in update units: u = η_l·g + c with η_l the step's learning rate, the parameter
moves by exactly g_t (handed to SGD as g_t / η_l), and c carries what the sign did not apply — so a learning-rate
schedule does not rescale old compensation. The worker clips g before it gets here. The global step size η_s is a
free hyper-parameter in the paper; here it is, per parameter tensor, the mean |u| averaged over the replicas (one
small all-reduce), which makes η_s·sign the same size as the update it replaces. Only the active elements (rows
non-zero on some replica) take part; the others keep their compensation and do not move. Pair with SGD (its
momentum 0; `--momentum` makes each replica compensate its local momentum instead of its gradient).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aqpipe.compress.grad import ring
from aqpipe.compress.grad.base import Compressor, DPGroup
from aqpipe.compress.grad.methods import GradSpec
from aqpipe.compress.grad.wire import PERIODIC, SyncBytes, active_rows_bytes, ring_all_reduce_bytes


def fold(received: torch.Tensor, own: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
    """v ⊙ v* for the m-th member to fold its bits in (m ≥ 2): unbiased running aggregation of sign bits."""
    p_one = torch.where(own.bool(), 1.0 / m, (m - 1) / m)
    # drawn on the CPU generator (checkpointable, the same on every device), compared where the bits live
    transient = (torch.rand(own.shape, generator=generator).to(own.device) < p_one).to(torch.uint8)
    return (received & own) | ((received ^ own) & transient)


class Marsit(Compressor):
    """One-bit ring synchronization with global compensation and a full-precision round every K steps."""

    pattern = "ring"
    sign_based = True
    kept_copies, peak_copies = 1.0, 11.1

    def __init__(self, dp: DPGroup, period: int, seed: int = 0, momentum: float = 0.0) -> None:
        super().__init__(dp, momentum)
        self.period = period
        self.name = f"marsit:{period}"
        self.compensation: torch.Tensor | None = None
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + dp.ranks[dp.index])

    @classmethod
    def from_spec(cls, spec: GradSpec, dp: DPGroup, seed: int, freeze_after: int, momentum: float) -> Marsit:
        return cls(dp, spec.args[0], seed=seed, momentum=momentum)

    @classmethod
    def step_bytes(cls, spec: GradSpec, dp: int, shapes: Sequence[tuple[int, ...]], freeze_after: int) -> SyncBytes:
        """With every row active: at most what it sends. Sign bits over a ring and a step size per tensor; every K-th
        step the fp32 average instead."""
        values = sum(math.prod(shape) for shape in shapes)
        active, chunk = active_rows_bytes(shapes, dp), -(-values // dp)
        signs = active + 2 * (dp - 1) * -(-chunk // 8) + ring_all_reduce_bytes(4 * len(shapes), dp)
        period = spec.args[0]
        if period == 0:
            return SyncBytes.every_step(signs)
        full = active + ring_all_reduce_bytes(4 * values, dp)
        return SyncBytes(full if period == 1 else signs, full, PERIODIC)

    def full_precision_now(self) -> bool:
        """Whether this step (the `calls`-th, from 0) is a full-precision round."""
        return self.period > 0 and self.calls % self.period == 0

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        n = self.dp.size
        active = self.active if self.active is not None else torch.ones(flat.numel(), dtype=torch.bool)
        if self.compensation is None or self.compensation.numel() != active.numel():
            self.compensation = torch.zeros(active.numel(), device=flat.device)
        if self.lr == 0:  # a step that moves nothing: keep the compensation for the next one
            return torch.zeros_like(flat)
        update = flat * self.lr + self.compensation[active]
        if self.full_precision_now():
            mean = update.clone()
            if n > 1:
                dist.all_reduce(mean, group=self.dp.group)
                mean.div_(n)
            self.bytes_sent += ring_all_reduce_bytes(4 * mean.numel(), n)
            self.compensation[active] = 0.0
            return mean / self.lr
        bits = ring.split((update > 0).to(torch.uint8), n)
        owned, aggregated, sent = ring.reduce_scatter(
            self.dp, bits, lambda s: 1, lambda s, received, own: fold(received, own, s + 2, self.generator))
        chunks, gathered = ring.all_gather(self.dp, owned, aggregated, 1)
        signs = torch.cat(chunks)[: flat.numel()].float().mul_(2).sub_(1)
        result = signs.mul_(self.step_sizes(update))
        self.bytes_sent += sent + gathered
        self.compensation[active] = update - result
        return result / self.lr  # SGD multiplies by the learning rate again: the parameter moves by exactly `result`

    def step_sizes(self, update: torch.Tensor) -> torch.Tensor:
        """η_s per element: each tensor's mean |u|, averaged over the replicas."""
        import torch.distributed as dist

        sizes = self.sizes or [update.numel()]
        pieces = update.abs().split(sizes)
        scales = torch.stack([p.mean() if p.numel() else p.new_zeros(()) for p in pieces])
        if self.dp.size > 1:
            dist.all_reduce(scales, group=self.dp.group)
            scales.div_(self.dp.size)
            self.bytes_sent += ring_all_reduce_bytes(4 * scales.numel(), self.dp.size)
        return torch.repeat_interleave(scales, torch.tensor(sizes, device=scales.device))

    def state_dict(self) -> dict:
        return dict(super().state_dict(), compensation=self.compensation, generator=self.generator.get_state())

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.compensation = state.get("compensation")
        if "generator" in state:
            self.generator.set_state(state["generator"].cpu())  # host bytes, wherever a resume put them
