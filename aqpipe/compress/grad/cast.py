"""`--grad-sync fp16|bf16`: the fp32 average, all-reduced in half precision (half the bytes of `none`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aqpipe.compress.grad.base import Compressor, DPGroup
from aqpipe.compress.grad.methods import GradSpec
from aqpipe.compress.grad.wire import SyncBytes, ring_all_reduce_bytes

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CastAllReduce(Compressor):
    """Divide by the group size in fp32 first (so the half-precision sum cannot overflow), cast, all-reduce, cast back."""

    pattern = "all-reduce"
    peak_copies = 2.5

    def __init__(self, dp: DPGroup, dtype: torch.dtype) -> None:
        super().__init__(dp)
        self.dtype = dtype
        self.name = {dtype: name for name, dtype in DTYPES.items()}[dtype]

    @classmethod
    def from_spec(cls, spec: GradSpec, dp: DPGroup, seed: int, freeze_after: int, momentum: float) -> CastAllReduce:
        return cls(dp, DTYPES[spec.method])

    @classmethod
    def step_bytes(cls, spec: GradSpec, dp: int, shapes: Sequence[tuple[int, ...]], freeze_after: int) -> SyncBytes:
        return SyncBytes.every_step(ring_all_reduce_bytes(2 * sum(math.prod(shape) for shape in shapes), dp))

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        half = flat.div_(self.dp.size).to(self.dtype)
        dist.all_reduce(half, group=self.dp.group)
        self.bytes_sent += ring_all_reduce_bytes(half.numel() * half.element_size(), self.dp.size)
        return half.float()
