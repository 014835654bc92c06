"""How many bytes of activations a stage holds for backward, and the most it held at once in a step.

What autograd saves for backward is what a schedule keeps alive between a micro-batch's forward and its backward:
saved-tensor hooks see every such tensor as the forward runs. Each is counted once per storage (views share one),
parameters and buffers are not activations and are left out, and the stage's own output, kept by the worker until
its gradient arrives, is counted too. A micro-batch's bytes are released when its backward is done.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(identity, bytes) of a tensor's storage; None for tensors without one. The identity is the storage object's
    own (views share it), not its data pointer, so the capacity plan can count fake tensors the same way."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage._cdata, storage.nbytes()


@dataclass
class ActivationMeter:
    """Per-step accounting of the activation bytes a stage holds for backward."""

    module: nn.Module
    peak_bytes: int = 0
    _held: dict[int, dict[int, int]] = field(default_factory=dict)  # micro-batch -> {storage identity: bytes}
    _weights: set[int] = field(default_factory=set)

    def begin_step(self) -> None:
        """Forget the last step's peak; note which storages are the stage's weights."""
        self.peak_bytes = 0
        self._held.clear()
        self._weights = {s[0] for t in [*self.module.parameters(), *self.module.buffers()]
                         if (s := _storage(t)) is not None}

    @contextmanager
    def forward(self, mb: int) -> Iterator[None]:
        """Count what autograd saves while the forward of micro-batch `mb` runs inside this context."""
        held = self._held.setdefault(mb, {})

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = _storage(t)
            if s is not None and s[0] not in self._weights:
                held[s[0]] = s[1]
            # the same storage without a grad_fn: returning `t` itself would make a saved output reference its own
            # graph, a cycle only a backward breaks (a branch whose backward never runs would stay alive)
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def keep(self, mb: int, tensor: torch.Tensor | None) -> None:
        """Count a tensor the worker itself keeps for micro-batch `mb`'s backward (the stage's output), then
        update the peak."""
        if tensor is not None and (s := _storage(tensor)) is not None:
            self._held.setdefault(mb, {})[s[0]] = s[1]
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, mb: int) -> None:
        """Micro-batch `mb`'s backward is done: nothing of it is held any more."""
        self._held.pop(mb, None)

    @property
    def live_bytes(self) -> int:
        """Bytes held now, each storage once."""
        union: dict[int, int] = {}
        for held in self._held.values():
            union.update(held)
        return sum(union.values())
