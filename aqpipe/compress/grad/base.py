"""The grad-sync interface and the plain fp32 all-reduce average (`--grad-sync none`)."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class GradSync(Protocol):
    """Combines one stage's gradients across its data-parallel group, in place."""

    name: str
    pattern: str  # all-reduce, all-gather, ring, two-phase, multi-round
    bytes_sent: int

    def synchronize(self, params: Sequence[torch.nn.Parameter]) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class AllReduceMean:
    """Averages gradients with one fp32 all-reduce over a flat buffer (no compression)."""

    name = "none"
    pattern = "all-reduce"

    def __init__(self, group, group_size: int) -> None:
        self.group, self.group_size = group, group_size
        self.bytes_sent = 0

    def synchronize(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace each gradient by its mean over the group; `bytes_sent` grows by the buffer handed to the collective."""
        if self.group_size == 1:
            return
        import torch.distributed as dist

        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.group_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.bytes_sent += flat.numel() * flat.element_size()

    def state_dict(self) -> dict:
        return {"bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict) -> None:
        self.bytes_sent = int(state.get("bytes_sent", 0))


def build_grad_sync(spec: str, group, group_size: int) -> GradSync:
    """The grad sync for a `--grad-sync` spec."""
    if spec == "none":
        return AllReduceMean(group, group_size)
    raise ValueError(f"unknown --grad-sync {spec!r}")
