"""Fused GPU kernels (Triton) for DirectQ's rows: per-channel b-bit quantization with the scales and the packed
codes written straight into the row bytes (`directq.join_rows`' layout), and back — bit for bit what
`quantize` + `encode_samples` and `decode_samples` give, in three kernel launches instead of about thirty.

Why: on a GPU each torch op is a kernel launch, and at a message's size (SmolLM2's 4 × 128 × 576 activations,
1.2 MB) the launches, not the arithmetic, set the codec's time; CUDA graphs (`cuda_graphs`) cut the launch cost but
not the thirty passes over memory. Three kernels:

- `_scales_kernel`: each (sample, channel)'s extremes over the tokens, its scale on the grid, rounded up to fp16
  exactly as `quantize.fp16_scales` does, written as the row's first 2·C bytes (and as fp32 for the next kernel);
- `_codes_kernel`: each value's code — ``rint(clamp(x / s · steps + offset, 0, top))`` with an IEEE division and no
  fused multiply-add, so the same float operations as torch's — packed 8 codes into b bytes (bit b·i of the row's
  little-endian stream holds code i's low bit), and, asked, the dequantized values (level · scale, AQ-SGD's m(ξ));
- `_decode_kernel`: unpack and dequantize: level(code) · scale, one table lookup and one multiply, as everywhere.

They apply where `encodable` and `fusable` say (a CUDA tensor of ≥ 3 dims whose channel count is a multiple of 8, per-channel
scales, nearest rounding, 2–8 bits, a grid whose scale needs no division: signed, symmetric, uniform) and Triton
imports; elsewhere the torch ops run. `AQPIPE_FUSED_KERNELS=0` turns them off. Under ``TRITON_INTERPRET=1`` the
kernels run on CPU tensors (numpy's IEEE float32), which is how CPU-only CI checks their bits against torch's.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from aqpipe.compress.quantize import FP16_MAX, _levels, _offset_steps

GROUP = 8  # codes per packed group: 8 codes of b bits fill exactly b bytes
_SCALE_KINDS = {"signed": 0, "symmetric": 1, "uniform": 1}  # 0: the long side where |x| is largest; 1: max |x|
log = logging.getLogger(__name__)
_failed: list[str] = []  # why the kernels failed to compile or launch in this process (then the torch ops run)


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter, on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fusable(device: torch.device, shape: tuple[int, ...], bits: int, per: str, grid: str) -> bool:
    """Whether the fused kernels code (and decode) a batch of `shape` on `device` (and Triton is there to run them);
    an encode asks `encodable` as well."""
    if os.environ.get("AQPIPE_FUSED_KERNELS", "1") == "0" or _failed:
        return False
    if not (device.type == "cuda" or interpreted()) or len(shape) < 3 or shape[-1] % GROUP or 0 in shape:
        return False
    return per == "channel" and 2 <= bits <= 8 and grid in _SCALE_KINDS and _kernels() is not None


def encodable(x: torch.Tensor, bits: int, per: str, stochastic: bool, grid: str) -> bool:
    """Whether `encode` codes `x` with these settings (nearest rounding only: a replayed graph would repeat its
    random draws, and the kernels draw none)."""
    return (not stochastic and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and fusable(x.device, tuple(x.shape), bits, per, grid))


def row_bytes(t: int, c: int, bits: int) -> int:
    """Bytes of one sample's row: fp16 scales per channel, then T·C packed codes."""
    return 2 * c + t * c * bits // 8


def encode(x: torch.Tensor, bits: int, grid: str, values: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Rows [B, row_bytes] of `x` [B, ..., C] (and its dequantized values, float32, x's shape, when asked); None if
    the kernels failed to compile or launch (then they are off for the process, with a warning)."""
    k = _kernels()
    x3 = x.detach().reshape(x.shape[0], -1, x.shape[-1]).contiguous()
    b, t, c = x3.shape
    rows = torch.empty(b, row_bytes(t, c, bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(b, c, dtype=torch.float32, device=x.device)
    coded = torch.empty(x3.shape, dtype=torch.float32, device=x.device) if values else scales  # (unused when not)
    offset, steps, top = _offset_steps(bits, grid)
    table = _levels(bits, grid, x.device)
    try:
        k.scales_kernel[(b, -(-c // k.SCALE_C))](
            x3, rows, scales, t, c, rows.shape[1], KIND=_SCALE_KINDS[grid], FP16_MAX=FP16_MAX, BT=k.SCALE_T,
            BC=k.SCALE_C, **k.OPTIONS)
        k.codes_kernel[(b * -(-t // k.TILE_T), -(-c // k.TILE_C))](
            x3, rows, scales, table, coded, t, c, rows.shape[1], float(offset), float(steps), float(top),
            BITS=bits, VALUES=values, BT=k.TILE_T, BC=k.TILE_C, **k.OPTIONS)
    except Exception as error:  # (a Triton that cannot compile for this GPU, say): the torch ops code it
        _give_up(error)
        return None
    return rows, coded.view(x.shape) if values else None


def decode(rows: torch.Tensor, shape: tuple[int, ...], bits: int, grid: str) -> torch.Tensor | None:
    """Float32 values of `shape` from rows [B, row_bytes] that `encode` (or `directq.encode_samples`) wrote; None if
    the kernels failed (as `encode`)."""
    k = _kernels()
    b, c = shape[0], shape[-1]
    t = 1
    for d in shape[1:-1]:
        t *= d
    rows = rows.contiguous()
    if rows.shape != (b, row_bytes(t, c, bits)):
        raise ValueError(f"rows of shape {tuple(rows.shape)} cannot hold a {bits}-bit batch of shape {shape}")
    out = torch.empty(b, t, c, dtype=torch.float32, device=rows.device)
    try:
        k.decode_kernel[(b * -(-t // k.TILE_T), -(-c // k.TILE_C))](
            rows, _levels(bits, grid, rows.device), out, t, c, rows.shape[1], BITS=bits, BT=k.TILE_T, BC=k.TILE_C,
            **k.OPTIONS)
    except Exception as error:
        _give_up(error)
        return None
    return out.view(shape)


def _give_up(error: Exception) -> None:
    """Turn the kernels off for the rest of the process, saying why once."""
    if not _failed:
        log.warning("fused codec kernels off, the torch ops code from now on: %s: %s", type(error).__name__, error)
    _failed.append(f"{type(error).__name__}: {error}")


@functools.cache
def _kernels():
    """`aqpipe.compress.fused_kernels` (compiled on first use), or None where Triton does not import."""
    try:
        from aqpipe.compress import fused_kernels
    except Exception:  # (an absent or broken Triton: the torch ops run)
        return None
    return fused_kernels
