"""`--grad-sync signsgd`: all-reducible majority-vote signSGD (Jain & Kolagani 2022).

Each replica votes +1 where its gradient is positive. A ring reduce-scatter carries the running count of +1 votes
— at hop i (1..N−1) a count over i replicas, sent in ⌈log2(i+1)⌉ bits — so each member ends up owning the exact
vote count of one chunk; it turns that into the majority sign, and a 1-bit ring all-gather hands every member
every chunk's majority. The gradient becomes that sign (±1): the optimizer step is lr·sign, so pair it with SGD
(its momentum 0 unless asked; `--momentum β` votes on each replica's local momentum instead: Signum). Only the
active elements vote (rows non-zero on some replica, see `base`); the rest do not move.

Bits sent per element per member: (Σ_{i=1}^{N−1} ⌈log2(i+1)⌉ + (N−1)) / N (the reduce, then the gather).
A tie (possible for even N) is broken by a fair coin at the chunk's owner, so the sign stays 1 bit and unbiased;
the paper's "otherwise negative" would push every tied coordinate the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aqpipe.compress.grad import ring
from aqpipe.compress.grad.base import Compressor, DPGroup
from aqpipe.compress.grad.methods import GradSpec
from aqpipe.compress.grad.wire import SyncBytes, active_rows_bytes, count_bits


def bits_per_element(members: int) -> float:
    """What one member sends per gradient element, in bits (ignoring chunk padding)."""
    return (sum(count_bits(i) for i in range(1, members)) + (members - 1)) / members


def majority(count: torch.Tensor, members: int, generator: torch.Generator) -> torch.Tensor:
    """1 where more than half the members voted +1, 0 where fewer; a fair coin for a tie."""
    twice = count.to(torch.int32) * 2
    coin = torch.randint(0, 2, count.shape, generator=generator, dtype=torch.uint8).to(count.device)
    return torch.where(twice > members, 1, torch.where(twice < members, 0, coin)).to(torch.uint8)


class SignSGD(Compressor):
    """Majority vote of the replicas' gradient signs through a ring of packed counts."""

    name = "signsgd"
    pattern = "ring"
    sign_based = True
    clippable = False  # ±1 per coordinate is the update itself; clipping its norm would only shrink every step
    peak_copies = 5.8

    def __init__(self, dp: DPGroup, seed: int = 0, momentum: float = 0.0) -> None:
        super().__init__(dp, momentum)
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + dp.ranks[dp.index])

    @classmethod
    def from_spec(cls, spec: GradSpec, dp: DPGroup, seed: int, freeze_after: int, momentum: float) -> SignSGD:
        return cls(dp, seed=seed, momentum=momentum)

    @classmethod
    def step_bytes(cls, spec: GradSpec, dp: int, shapes: Sequence[tuple[int, ...]], freeze_after: int) -> SyncBytes:
        """With every row active (unused rows of a table vote on nothing): at most what it sends. Counts of +1 votes
        growing a bit wider as they pass replicas, then the majority's bits."""
        chunk = -(-sum(math.prod(shape) for shape in shapes) // dp)
        counts = sum(-(-chunk * count_bits(hop + 1) // 8) for hop in range(dp - 1))
        return SyncBytes.every_step(active_rows_bytes(shapes, dp) + counts + (dp - 1) * -(-chunk // 8))

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        n = self.dp.size
        votes = ring.split((flat > 0).to(torch.uint8), n)
        owned, count, sent = ring.reduce_scatter(self.dp, votes, lambda s: count_bits(s + 1),
                                                 lambda s, received, own: received + own)
        chunks, gathered = ring.all_gather(self.dp, owned, majority(count, n, self.generator), 1)
        self.bytes_sent += sent + gathered
        signs = torch.cat(chunks)[: flat.numel()].float()
        return signs.mul_(2).sub_(1)

    def state_dict(self) -> dict:
        return dict(super().state_dict(), generator=self.generator.get_state())

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "generator" in state:
            self.generator.set_state(state["generator"].cpu())  # host bytes, wherever a resume put them
