"""The grad-sync interface, the data-parallel group it runs in, and the plain fp32 all-reduce (`--grad-sync none`).

A grad sync replaces the gradients of one stage's parameters, in place, by what the optimizer should apply:
the replicas' mean for the averaging methods, a (scaled) sign vector for the sign-based ones. Each declares its
collective pattern, counts the bytes it hands to the network, and keeps its state (error feedback, counters) in
`state_dict` so that a checkpoint can restore it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

PATTERNS = ("all-reduce", "all-gather", "ring", "two-phase", "multi-round")


@dataclass(frozen=True)
class DPGroup:
    """One stage's data-parallel group: the torch.distributed group, its members' global ranks in replica order,
    and this rank's position among them."""

    group: object
    ranks: tuple[int, ...]
    index: int

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
    pattern: str  # one of PATTERNS
    bytes_sent: int  # bytes this rank handed to the network, over the run
    sign_based: bool  # the result is a sign-type update: pair with SGD
    clippable: bool  # the result is in gradient units, so the global-norm clip applies to it

    def synchronize(self, params: Sequence[torch.nn.Parameter]) -> None: ...

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
    """Shared plumbing: the group, the byte counter, and state that is just a dict of tensors and numbers."""

    name = "none"
    pattern = "all-reduce"
    sign_based = False
    clippable = True

    def __init__(self, dp: DPGroup) -> None:
        self.dp = dp
        self.bytes_sent = 0
        self.calls = 0
        self.sizes: list[int] = []  # elements of each gradient tensor in the flat vector, set before `combine`

    def synchronize(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace the gradients of `params` by the synchronized update (for one replica only sign-based methods
        change anything: the sign is their update)."""
        try:
            if self.dp.size == 1 and not self.sign_based:
                return
            grads = gradients(params)
            if not grads:
                return
            self.sizes = [g.numel() for g in grads]
            write_back(self.combine(flatten(grads)), grads)
        finally:
            self.calls += 1  # after `combine`, which may read the index of the current call

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        """The synchronized version of this rank's flat gradient."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Counters and buffers (error feedback) for a checkpoint."""
        return {"bytes_sent": self.bytes_sent, "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.calls = int(state.get("calls", 0))


class AllReduceMean(Compressor):
    """Averages gradients with one fp32 all-reduce over a flat buffer (no compression)."""

    name = "none"

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(flat, group=self.dp.group)
        self.bytes_sent += ring_all_reduce_bytes(flat.numel() * 4, self.dp.size)
        return flat.div_(self.dp.size)


def ring_all_reduce_bytes(nbytes: int, n: int) -> int:
    """What one member of a ring all-reduce of `nbytes` sends: 2·(n−1)/n of it (reduce-scatter, then all-gather)."""
    return 2 * (n - 1) * nbytes // n


def all_gather_bytes(nbytes: int, n: int) -> int:
    """What one member sends in an all-gather of its `nbytes` over a ring: its part, passed on n−1 times."""
    return (n - 1) * nbytes
