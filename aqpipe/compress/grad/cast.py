"""`--grad-sync fp16|bf16`: the fp32 average, all-reduced in half precision (half the bytes of `none`)."""

from __future__ import annotations

import torch

from aqpipe.compress.grad.base import Compressor, DPGroup, ring_all_reduce_bytes


class CastAllReduce(Compressor):
    """Divide by the group size in fp32 first (so the half-precision sum cannot overflow), cast, all-reduce, cast back."""

    pattern = "all-reduce"

    def __init__(self, dp: DPGroup, dtype: torch.dtype) -> None:
        super().__init__(dp)
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        half = flat.div_(self.dp.size).to(self.dtype)
        dist.all_reduce(half, group=self.dp.group)
        self.bytes_sent += ring_all_reduce_bytes(half.numel() * half.element_size(), self.dp.size)
        return half.float()
