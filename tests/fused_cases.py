"""The batches the fused-kernel tests code (tests/test_fused.py under Triton's interpreter, tests/test_gpu_codecs.py
on a GPU): random values with the edge cases a scale meets."""

import torch


def edge_case_batch(shape: tuple[int, ...], device: str = "cpu") -> torch.Tensor:
    """Random values × 3 of `shape` (≥ 5 channels) with an all-zero channel, a −0 channel, a value past fp16 and a
    channel whose scale is an fp16 subnormal."""
    x = torch.randn(shape, device=device) * 3
    v = x.view(shape[0], -1, shape[-1])
    v[-1, :, 1] = 0.0
    v[0, :, 2] = -0.0
    v[0, 0, 3] = 1e6
    v[-1, :, 4] *= 1e-9
    return x
