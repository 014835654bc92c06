"""b-bit uniform quantization with per-sample scales, per channel (default) or per token, on one of a few grids.

A tensor [B, ..., C] is viewed as [B, T, C] (T = the product of the middle dimensions). Per-channel scales cover
the values over T for each (sample, channel); per-token scales the values over C for each (sample, token); a 2-D
tensor [B, C] gets one scale per sample. Scales travel as fp16, their magnitude rounded *up* so no value needs
more than its scale, and both sides dequantize from that fp16 value: code k stands for level(k) · scale, one table
lookup and one multiply, so every device reconstructs bit-identical values.

`GRIDS` is the one table of grids (the levels a code can stand for). All but `uniform` hold an exact 0, so padding,
unused coordinates and unchanged activations stay untouched:

- `signed` (the default): the integers −2^(b−1) … 2^(b−1)−1 times scale/2^(b−1) — every code used, steps of
  scale/2^(b−1). The grid is one level longer on one side; the scale's sign (free in fp16) puts that side where
  the group's largest |x| lies, so the extreme is exact and values on the short side beyond its last level clip.
- `fit`: the same levels with the scale chosen so nothing clips: the step is the smaller of
  max(P/(2^(b−1)−1), N/2^(b−1)) and its mirror, for the group's largest positive P and negative N magnitudes.
- `symmetric`: 2^b − 1 levels k/(2^(b−1)−1) · scale, |k| ≤ 2^(b−1)−1 (one code unused): the authors' reference code.
- `uniform`: 2^b levels spread evenly over [−scale, scale]; no zero (0 comes back as ±s/n).

One bit has no room for a zero: every grid sends sign · scale. With nearest rounding the scale is the group's mean
|x| (1-bit Adam's choice), which makes the code contractive (‖x − Q(x)‖² = ‖x‖² − ‖x‖₁²/n < ‖x‖²), so error
feedback stays bounded; stochastic rounding keeps the max |x| scale, the one that makes it unbiased.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from aqpipe.compress.grids import DEFAULT_GRID, GRIDS, SCALES

FP16_MAX = 65504.0


@dataclass
class Quantized:
    """Codes [B, T·C] (uint8, < 2**bits) and fp16 scales [B, S] of one tensor, on `grid`."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    per: str
    grid: str = DEFAULT_GRID


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View [B, ..., C] as [B, T, C]; a 2-D [B, C] becomes [B, C, 1] so it gets one scale per sample."""
    if x.dim() < 2:
        raise ValueError(f"quantization needs a batch dimension and at least one more, got shape {tuple(x.shape)}")
    if x.dim() == 2:
        return x.reshape(x.shape[0], x.shape[1], 1)
    return x.reshape(x.shape[0], -1, x.shape[-1])


def scale_count(shape: tuple[int, ...], per: str) -> int:
    """Scales per sample for a tensor of `shape`."""
    if len(shape) == 2:
        return 1
    t = 1
    for d in shape[1:-1]:
        t *= d
    return shape[-1] if per == "channel" else t


def check_grid(grid: str) -> None:
    """Raise a ValueError naming the grids if `grid` is not one of them."""
    if grid not in GRIDS:
        raise ValueError(f"quantization grid must be one of {', '.join(GRIDS)}, got {grid!r}")


def _offset_steps(bits: int, grid: str) -> tuple[float, float, int]:
    """(offset, steps, top code): code k stands for (k − offset) / steps · scale; codes run 0..top."""
    if bits == 1 or grid == "uniform":
        half = ((1 << bits) - 1) / 2
        return half, half, (1 << bits) - 1
    if grid == "symmetric":
        h = (1 << (bits - 1)) - 1
        return float(h), float(h), 2 * h
    h = 1 << (bits - 1)
    return float(h), float(h), (1 << bits) - 1


@functools.cache  # (asked at every ungraphed kernel launch)
def level_step(bits: int, grid: str) -> tuple[float, bool]:
    """How the fused kernels form a code's level (`fused_kernels.level`): (1/steps, True) where the grid's steps are a
    power of two (the default grid's: the product is exact), else (steps, False) for a correctly rounded division of
    exact values. Both give the float32 that `quantize.levels` computes in float64 and rounds once: a float64
    quotient rounded to float32 is the correctly rounded float32 quotient (53 ≥ 2·24 + 2 bits, so no double
    rounding), and tests/test_quantize.py checks every code of every grid."""
    _, steps, _ = _offset_steps(bits, grid)
    mantissa, _ = math.frexp(steps)
    return (1.0 / steps, True) if mantissa == 0.5 else (float(steps), False)


def levels(bits: int, device: torch.device | None = None, grid: str = DEFAULT_GRID) -> torch.Tensor:
    """The 2**bits reconstruction points of a unit scale (codes past the grid's top repeat it), computed in float64
    then rounded once."""
    check_grid(grid)
    return _levels(bits, grid, torch.device("cpu") if device is None else torch.device(device))


@functools.cache
def _levels(bits: int, grid: str, device: torch.device) -> torch.Tensor:
    """`levels`, built once per device (a GPU is not sent the table, and made to wait for it, on every call). The
    table is shared: callers read it, never write it; it is never dropped (a codec's CUDA graph reads it)."""
    offset, steps, top = _offset_steps(bits, grid)
    k = torch.arange(1 << bits, dtype=torch.float64).clamp(max=top)
    return ((k - offset) / steps).to(torch.float32).to(device, non_blocking=True)  # (a fresh host tensor: staged)


def fp16_scales(scale: torch.Tensor) -> torch.Tensor:
    """fp16 scales whose magnitude is ≥ the given one (rounded up; capped at the fp16 maximum), sign kept."""
    magnitude = scale.float().abs().clamp_(max=FP16_MAX)
    half = magnitude.to(torch.float16)
    # Rounded up where the cast rounded down, for every group (asking whether any did would make a GPU wait): the
    # next fp16 magnitude is the next bit pattern, and never past the largest finite one (65504 is exact). Few
    # kernels, since each is a launch on a GPU and these tensors are tiny.
    half = half.view(torch.int16).add_(torch.lt(half, magnitude)).view(torch.float16)
    return torch.where(scale < 0, -half, half)


def _scales(rows: torch.Tensor, dim: int, bits: int, grid: str, stochastic: bool) -> torch.Tensor:
    """The (signed) scale of each group of `rows` reduced over `dim`, before fp16 rounding."""
    if bits == 1 and grid != "uniform" and not stochastic:
        return rows.abs().mean(dim=dim, keepdim=True)
    if grid in ("uniform", "symmetric") or bits == 1:
        return rows.abs().amax(dim=dim, keepdim=True)
    low, high = torch.aminmax(rows, dim=dim, keepdim=True)  # one pass over the rows for both
    positive = high.clamp_(min=0)
    negative = low.neg_().clamp_(min=0)  # no negated copy of the rows
    h = float(1 << (bits - 1))
    if grid == "signed":  # the long side (−1 … ) goes where the largest magnitude is: scale = −(that value)
        return torch.where(positive > negative, -positive, negative)
    # fit: the smaller step that covers both sides with no clipping; the long side is the negative one (scale > 0)
    # or, mirrored, the positive one (scale < 0)
    step_long_negative = torch.maximum(positive / (h - 1), negative / h)
    step_long_positive = torch.maximum(negative / (h - 1), positive / h)
    return torch.where(step_long_positive < step_long_negative, -step_long_positive * h, step_long_negative * h)


def quantize(x: torch.Tensor, bits: int, per: str = "channel", stochastic: bool = False,
             generator: torch.Generator | None = None, grid: str = DEFAULT_GRID) -> Quantized:
    """Quantize a batch [B, ...] to `bits` bits; stochastic rounding is unbiased (within the grid's range), nearest
    is deterministic."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if per not in SCALES:
        raise ValueError(f"scale granularity must be one of {', '.join(SCALES)}, got {per!r}")
    check_grid(grid)
    rows = as_rows(x.detach().float())
    reduce_dim = 1 if (per == "channel" or x.dim() == 2) else 2
    scales = fp16_scales(_scales(rows, reduce_dim, bits, grid, stochastic))
    s = scales.float().masked_fill_(scales == 0, 1.0)
    offset, steps, top = _offset_steps(bits, grid)
    if bits == 1 and not stochastic:  # the sign; an exact 0 (no room for it in one bit) goes to +scale
        codes = (rows > 0).to(torch.uint8)
    else:
        u = (rows / s).mul_(steps).add_(offset)
        if stochastic:
            u.add_(torch.rand(u.shape, generator=generator, device=u.device)).floor_()
        else:
            u.round_()
        codes = u.clamp_(0, top).to(torch.uint8)
    return Quantized(codes.reshape(x.shape[0], -1), scales.reshape(x.shape[0], -1), bits, per, grid)


def dequantize(q: Quantized, shape: tuple[int, ...]) -> torch.Tensor:
    """Reconstruct a float32 tensor of `shape` from codes and fp16 scales."""
    b = shape[0]
    view = as_rows(torch.empty(shape, device="meta"))
    t, c = view.shape[1], view.shape[2]
    # a table lookup (index_select with int32 indices: 3x faster than indexing with int64) keeps every device's
    # reconstruction bit-identical
    table = levels(q.bits, q.codes.device, q.grid)
    values = torch.index_select(table, 0, q.codes.reshape(-1).int()).view(b, t, c)
    if len(shape) == 2 or q.per == "channel":
        s = q.scales.float().view(b, 1, -1) if len(shape) > 2 else q.scales.float().view(b, 1, 1)
    else:
        s = q.scales.float().view(b, t, 1)
    return (values * s).view(shape)
