"""b-bit uniform quantization with max-abs scales, per sample and channel (default) or per token.

A tensor [B, ..., C] is viewed as [B, T, C] (T = the product of the middle dimensions). Per-channel scales are
the max |x| over T for each (sample, channel); per-token scales the max over C for each (sample, token); a 2-D
tensor [B, C] gets one scale per sample. Scales travel as fp16, rounded *up* so no value exceeds its scale, and
both sides dequantize from that fp16 value. The 2**b levels span [-scale, scale] evenly (1 bit: ±scale).
Dequantization is one table lookup and one multiply, so every device reconstructs bit-identical values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP16_MAX = 65504.0


@dataclass
class Quantized:
    """Codes [B, T·C] (uint8, < 2**bits) and fp16 scales [B, S] of one tensor."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    per: str


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


def levels(bits: int, device: torch.device | None = None) -> torch.Tensor:
    """The 2**bits reconstruction points in [-1, 1], computed in float64 then rounded once."""
    n = (1 << bits) - 1
    return ((torch.arange(n + 1, dtype=torch.float64) * 2 - n) / n).to(torch.float32).to(device)


def fp16_scales(absmax: torch.Tensor) -> torch.Tensor:
    """fp16 scales ≥ the true max |x| (rounded up; capped at the fp16 maximum)."""
    absmax = absmax.float().clamp(max=FP16_MAX)
    half = absmax.to(torch.float16)
    low = half.float() < absmax
    if bool(low.any()):
        half = torch.where(low, torch.nextafter(half, torch.full_like(half, float("inf"))), half)
    return half


def quantize(
    x: torch.Tensor, bits: int, per: str = "channel", stochastic: bool = False, generator: torch.Generator | None = None
) -> Quantized:
    """Quantize a batch [B, ...] to `bits` bits; stochastic rounding is unbiased, nearest is deterministic."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if per not in ("channel", "token"):
        raise ValueError(f"scale granularity must be 'channel' or 'token', got {per!r}")
    rows = as_rows(x.detach().float())
    reduce_dim = 1 if (per == "channel" or x.dim() == 2) else 2
    scales = fp16_scales(rows.abs().amax(dim=reduce_dim, keepdim=True))
    s = scales.float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    half_span = ((1 << bits) - 1) / 2
    u = (rows / s + 1.0).mul_(half_span)
    if stochastic:
        u.add_(torch.rand(u.shape, generator=generator, device=u.device)).floor_()
    else:
        u.round_()
    codes = u.clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return Quantized(codes.reshape(x.shape[0], -1), scales.reshape(x.shape[0], -1), bits, per)


def dequantize(q: Quantized, shape: tuple[int, ...]) -> torch.Tensor:
    """Reconstruct a float32 tensor of `shape` from codes and fp16 scales."""
    b = shape[0]
    view = as_rows(torch.empty(shape, device="meta"))
    t, c = view.shape[1], view.shape[2]
    # a table lookup (index_select with int32 indices: 3x faster than indexing with int64) keeps every device's
    # reconstruction bit-identical
    values = torch.index_select(levels(q.bits, q.codes.device), 0, q.codes.reshape(-1).int()).view(b, t, c)
    if len(shape) == 2 or q.per == "channel":
        s = q.scales.float().view(b, 1, -1) if len(shape) > 2 else q.scales.float().view(b, 1, 1)
    else:
        s = q.scales.float().view(b, t, 1)
    return (values * s).view(shape)
