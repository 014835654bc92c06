"""The grad-sync interface, the data-parallel group it runs in, and the plain fp32 all-reduce (`--grad-sync none`).

A grad sync replaces the gradients of one stage's parameters, in place, by what the optimizer should apply:
the replicas' mean for the averaging methods, a (scaled) sign vector for the sign-based ones. Each declares its
collective pattern, counts the bytes it hands to the network, and keeps its state (error feedback, counters) in
`state_dict` so that a checkpoint can restore it.

Sign-based methods see only the *active* part of the gradient: the rows (first dimension; single elements of a 1-D
tensor) that are non-zero on at least one replica, agreed by a one-byte-per-row all-reduce. A sign has no zero, so
without this every unused embedding row would vote −1 and drift by lr each step; a parameter with no active row
gets no gradient at all, so the optimizer leaves it alone. With `momentum` β > 0 they vote on each replica's local
momentum β·m + (1−β)·g instead of its gradient (Signum).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from aqpipe.compress.grad.methods import GradSpec
from aqpipe.compress.grad.wire import SyncBytes, ring_all_reduce_bytes

PATTERNS = ("all-reduce", "all-gather", "ring", "two-phase", "multi-round")


@dataclass(frozen=True)
class DPGroup:
    """One stage's data-parallel group: the torch.distributed group, its members' global ranks in replica order,
    and this rank's position among them."""

    group: Any  # a torch.distributed ProcessGroup (None: the default group)
    ranks: tuple[int, ...]
    index: int
    device: torch.device = torch.device("cpu")  # where the group's collectives take tensors (a GPU under NCCL)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        """The global rank after this one on the ring of replicas."""
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        """The global rank before this one on the ring of replicas."""
        return self.ranks[(self.index - 1) % self.size]


class GradSync(Protocol):
    """Combines one stage's gradients across its data-parallel group, in place."""

    name: str
    dp: DPGroup  # the group, and the device its collectives take tensors on
    pattern: str  # one of PATTERNS
    bytes_sent: int  # bytes this rank handed to the network, over the run
    sign_based: bool  # the result is a sign-type update: pair with SGD
    clippable: bool  # the result is in gradient units, so the global-norm clip applies to it

    def synchronize(self, params: Sequence[torch.nn.Parameter]) -> None: ...

    def own_optimizer(self, params: list, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer | None:
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def gradients(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of `params`, with zeros for parameters that got none (so every replica flattens alike)."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def row_counts(grads: Sequence[torch.Tensor]) -> list[int]:
    """Rows of each gradient: its first dimension, or each element of a 1-D (or 0-D) tensor."""
    return [g.shape[0] if g.dim() >= 2 else g.numel() for g in grads]


def active_rows(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """uint8 per row of every gradient: 1 where the row holds a non-zero value."""
    flags = [(g.reshape(n, -1) != 0).any(dim=1) for g, n in zip(grads, row_counts(grads))]
    return torch.cat(flags).to(torch.uint8) if flags else torch.zeros(0, dtype=torch.uint8)


def expand_rows(rows: torch.Tensor, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-row flags as per-element flags of the flat vector of `grads`."""
    counts = row_counts(grads)
    per_tensor = torch.tensor([g.numel() // n if n else 0 for g, n in zip(grads, counts)], device=rows.device)
    widths = torch.repeat_interleave(per_tensor, torch.tensor(counts, device=rows.device))
    return torch.repeat_interleave(rows, widths) if rows.numel() else rows


def flatten(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """One fp32 vector of all gradients, in order."""
    return torch.cat([g.reshape(-1).float() for g in grads]) if grads else torch.zeros(0)  # on the grads' device


def write_back(flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
    """Copy a flat vector back into the gradients it was made from."""
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class Compressor:
    """Shared plumbing: the group, the byte counter, and state that is just a dict of tensors and numbers; and what a
    method's class tells before it is built (`from_spec`, `step_bytes`, `memory_copies`), read through
    `aqpipe.compress.grad.registry`."""

    name = "none"
    pattern = "all-reduce"
    sign_based = False
    clippable = True
    # fp32 copies of a stage's trained parameters the method keeps from step to step where the replicas' collectives
    # run (a GPU under NCCL, else the host), and the most it holds at once while it runs, kept state included: measured
    # on gloo ranks with every storage its ops make counted and every buffer a collective sends held to the end, at
    # 1-4 replicas (tests/test_grad_methods.py holds them to what the code does); the messages a method gathers add
    # their share per replica (`memory_copies`)
    kept_copies: ClassVar[float] = 0.0
    peak_copies: ClassVar[float] = 1.0
    # what it holds on the GPU when its collectives are staged through the host (gloo, ranks sharing a GPU): the flat
    # gradient and its result
    gloo_gpu_copies: ClassVar[float] = 2.0

    @classmethod
    def from_spec(cls, spec: GradSpec, dp: DPGroup, seed: int, freeze_after: int, momentum: float) -> Compressor:
        """The sync of a parsed --grad-sync value for `dp` (seed: its random choices; freeze_after: the steps of an
        fp32 warm-up; momentum: a sign method's local momentum)."""
        return cls(dp, *spec.args)

    @classmethod
    def step_bytes(cls, spec: GradSpec, dp: int, shapes: Sequence[tuple[int, ...]], freeze_after: int) -> SyncBytes:
        """What one replica of `dp` (at least 2) hands to the network in a step for parameters of `shapes`."""
        values = sum(math.prod(shape) for shape in shapes)
        return SyncBytes.every_step(ring_all_reduce_bytes(4 * values, dp))

    @classmethod
    def memory_copies(cls, spec: GradSpec, dp: int) -> tuple[float, float]:
        """fp32 copies of the trained parameters one replica of `dp` holds where its collectives run: (kept from step
        to step, the most at once, that included). Without replicas there is nothing to exchange, so nothing held,
        but for a sign method's vote."""
        if dp < 2 and not cls.sign_based:
            return 0.0, 0.0
        return cls.kept_copies, cls.peak_copies

    def own_optimizer(self, params: list, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer | None:
        """The optimizer --optimizer `name` is under this method where it is the method's own (it exchanges the
        optimizer's state through the sync); else None."""
        return None

    def __init__(self, dp: DPGroup, momentum: float = 0.0) -> None:
        self.dp = dp
        self.bytes_sent = 0
        self.calls = 0
        self.sizes: list[int] = []  # elements of each gradient tensor in the flat vector, set before `combine`
        self.active: torch.Tensor | None = None  # sign-based: which elements of the full flat vector `combine` sees
        self.momentum = momentum  # sign-based: vote on the local momentum (Signum) when > 0
        self.local_momentum: torch.Tensor | None = None
        self.lr = 1.0  # the learning rate of the coming step, set by the worker (Marsit works in update units)

    def synchronize(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace the gradients of `params` by the synchronized update (for one replica only sign-based methods
        change anything: the sign is their update)."""
        try:
            if self.dp.size == 1 and not self.sign_based:
                return
            grads = gradients(params)
            if not grads:
                return
            if not self.sign_based:
                self.sizes = [g.numel() for g in grads]
                flat = flatten(grads)
                write_back(self.combine(flat.to(self.dp.device)).to(flat.device), grads)
                return
            self._synchronize_signs(params, grads)
        finally:
            self.calls += 1  # after `combine`, which may read the index of the current call

    def _synchronize_signs(self, params: Sequence[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        """The sign-based path: vote on the active elements only, leave the rest untouched."""
        rows = active_rows(grads)
        if self.dp.size > 1:
            import torch.distributed as dist

            shared = rows.to(self.dp.device)
            dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=self.dp.group)
            rows = shared.to(rows.device)
            self.bytes_sent += ring_all_reduce_bytes(rows.numel(), self.dp.size)
        self.active = expand_rows(rows.bool(), grads).to(self.dp.device)
        flat = flatten(grads).to(self.dp.device)  # the vote, its momentum and compensation live with the collectives
        if self.momentum > 0:
            if self.local_momentum is None or self.local_momentum.numel() != flat.numel():
                self.local_momentum = torch.zeros_like(flat)
            flat = self.local_momentum.mul_(self.momentum).add_(flat, alpha=1 - self.momentum).clone()
        self.sizes = [int(a.sum()) for a in self.active.split([g.numel() for g in grads])]
        result = torch.zeros_like(flat)
        result[self.active] = self.combine(flat[self.active])
        write_back(result.to(grads[0].device), grads)
        for p, count in zip(params, self.sizes):
            if count == 0:  # nothing active: the optimizer skips a parameter without a gradient (no decay either)
                p.grad = None

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        """The synchronized version of this rank's flat gradient."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Counters and buffers (error feedback, local momentum) for a checkpoint."""
        return {"bytes_sent": self.bytes_sent, "calls": self.calls, "local_momentum": self.local_momentum}

    def load_state_dict(self, state: dict) -> None:
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.calls = int(state.get("calls", 0))
        self.local_momentum = state.get("local_momentum")


class AllReduceMean(Compressor):
    """Averages gradients with one fp32 all-reduce over a flat buffer (no compression)."""

    name = "none"

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(flat, group=self.dp.group)
        self.bytes_sent += ring_all_reduce_bytes(flat.numel() * 4, self.dp.size)
        return flat.div_(self.dp.size)
