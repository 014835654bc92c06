"""Mixed precision: the compute dtype of a stage, and dynamic loss scaling for fp16 agreed across the whole pipeline.

Parameters and optimizer state stay fp32 (the master weights); a stage's forward (and the loss) runs under autocast
in the compute dtype. bf16 has fp32's exponent range and needs no loss scaling. fp16 does: the last stage multiplies
its loss by a scale S, so every gradient crossing a link and every parameter gradient carries S. A step whose
gradients overflowed on *any* rank is skipped on every rank — one all-reduce of an overflow flag over the world
before the grad sync, so no compressor's error-feedback memory ever sees an inf — and S is halved; after
`growth_interval` clean steps it doubles. torch's GradScaler decides per process, which would let two stages or two
replicas disagree about skipping a step; that is why the scaler here is aqpipe's own.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from aqpipe.pipeline.vocab.precisions import PRECISIONS
from aqpipe.pipeline.world import comm


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast runs a stage in for `precision` (None: plain fp32, no autocast)."""
    name = PRECISIONS[precision].autocast_dtype
    return None if name is None else getattr(torch, name)


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The context a stage's forward (and loss) runs in for `precision`."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def needs_loss_scaling(precision: str) -> bool:
    """Whether `precision` trains with a dynamic loss scale (fp16's 5-bit exponent underflows small gradients)."""
    return PRECISIONS[precision].loss_scaling


@dataclass
class LossScaler:
    """fp16's dynamic loss scale, identical on every rank (each rank updates it from the same global flag)."""

    scale: float = 2.0 ** 16
    growth_interval: int = 2000
    backoff: float = 0.5
    growth: float = 2.0
    min_scale: float = 1.0
    skipped: int = 0  # steps skipped because a gradient overflowed
    _clean: int = 0  # consecutive steps without overflow

    def overflowed(self, params: list[torch.nn.Parameter], device: torch.device) -> bool:
        """Whether any rank's gradients hold an inf or NaN (every rank of the world calls this together)."""
        finite = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
        flag = torch.zeros(1, device=device)
        if finite:  # one flag from every gradient, read back once below (no host sync per tensor)
            flag += (~torch.stack(finite).all()).float().to(device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            comm.all_reduce(flag, comm.CONTROL, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def unscale(self, params: list[torch.nn.Parameter]) -> None:
        """Divide every gradient by the scale (what the optimizer and the grad sync must see)."""
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow (the step was skipped), grow after a run of clean steps."""
        if overflow:
            self.skipped += 1
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self._clean = 0
            return
        self._clean += 1
        if self._clean >= self.growth_interval:
            self.scale *= self.growth
            self._clean = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps to continue with the same scale."""
        return {"scale": self.scale, "skipped": self.skipped, "clean": self._clean}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output."""
        self.scale, self.skipped, self._clean = float(state["scale"]), int(state["skipped"]), int(state["clean"])
