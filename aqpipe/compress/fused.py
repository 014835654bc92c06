"""Fused GPU kernels (Triton) for DirectQ's rows: per-channel b-bit quantization with the scales and the packed
codes written straight into the row bytes (`directq.join_rows`' layout), and back — bit for bit what
`quantize` + `encode_samples` and `decode_samples` give, in two kernel launches each way instead of about thirty.

Why: on a GPU each torch op is a kernel launch and a pass over memory; CUDA graphs (`cuda_graphs`) cut the launch
cost but not the passes. The kernels (`fused_kernels`):

- `scales_kernel`: each (sample, channel)'s extremes over the tokens, its scale on the grid, rounded up to fp16
  exactly as `quantize.fp16_scales` does, written as the row's first 2·C bytes (and as fp32 for the next kernel);
- `codes_kernel`: each value's code — ``rint(clamp(x / s · steps + offset, 0, top))`` with an IEEE division and no
  fused multiply-add, so the same float operations as torch's — packed 8 codes into b bytes (bit b·i of the row's
  little-endian stream holds code i's low bit), and, asked, the dequantized values (level · scale);
- `decode_kernel`: unpack and dequantize: level(code) · scale, one table lookup and one multiply, as everywhere.

With an m(ξ) (`delta_encode`, `delta_decode`) the same kernels do AQ-SGD's delta step: they code x − m(ξ), write the
new m(ξ) in its 16-bit dtype, each tile's share of the checksum sums (exact int64) and of the fidelity norms.

DirectQ's kernels apply where `encodable` and `fusable` say (a CUDA tensor of ≥ 3 dims whose channel count is a
multiple of 8, per-channel scales, nearest rounding, 2–8 bits, a grid whose scale needs no division: signed,
symmetric, uniform) and Triton imports; AQ-SGD's on batches of half a million values and more (`delta_fusable`:
below that the fused step is no faster); elsewhere the torch ops run.
`AQPIPE_FUSED_KERNELS=0` turns them all off. Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (numpy's
IEEE float32), which is how CPU-only CI checks their bits against torch's.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os

import torch

from aqpipe.compress.quantize import FP16_MAX, _levels, _offset_steps

GROUP = 8  # codes per packed group: 8 codes of b bits fill exactly b bytes
_SCALE_KINDS = {"signed": 0, "symmetric": 1, "uniform": 1}  # 0: the long side where |x| is largest; 1: max |x|
DELTA_SWITCH = "AQPIPE_FUSED_AQSGD"  # "1": AQ-SGD's delta step fused at every size, "0": at none (`delta_fusable`)
# The batch size (values) from which AQ-SGD's delta step is fused by default. Measured pair by pair (aqsgd:3, fp16
# m(ξ) on the GPU; benchmarks/README.md): on an H200 fused was as fast at 4 × 128 × 576 (0.29 M values), 17% faster
# at 0.59 M, 21-28% at 1.2-2.4 M and 49% (up to 2×) at SmolLM2's 8 × 1024 × 576; on an H100 it was 10-20% slower at
# 4 × 128 × 576, where a message's time is its launches and waits, not its arithmetic.
DELTA_MIN_ELEMENTS = 1 << 19
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
    # (on the meta device the kernels' outputs are made and nothing runs: what a GPU's graphs hold, measured for the
    # capacity plan by `aqpipe.compress.graph_memory`)
    if not (device.type in ("cuda", "meta") or interpreted()) or len(shape) < 3 or shape[-1] % GROUP or 0 in shape:
        return False
    if not (per == "channel" and 2 <= bits <= 8 and grid in _SCALE_KINDS):
        return False
    return _triton_present() if device.type == "meta" else _kernels() is not None


def delta_fusable(device: torch.device, shape: tuple[int, ...], dtype: torch.dtype, bits: int, per: str,
                  grid: str) -> bool:
    """Whether AQ-SGD's delta step runs as fused kernels (`delta_encode`, `delta_decode`): where `fusable` says, on
    delta rows of at least `DELTA_MIN_ELEMENTS` values — or at every size with AQPIPE_FUSED_AQSGD=1, at none with 0
    (any other value: by size). m(ξ) must be fp16 or bf16 (one checksum word a value). The bits are the torch ops'
    either way (the fidelity norms' summation order aside)."""
    switch = os.environ.get(DELTA_SWITCH, "")
    if switch == "0" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if switch != "1" and math.prod(shape) < DELTA_MIN_ELEMENTS:
        return False
    if interpreted() and dtype == torch.bfloat16:  # (the interpreter truncates to bfloat16 where a GPU rounds)
        return False
    # (its outputs' shapes read the kernels' tiles: on the meta device too, the kernels must import)
    return fusable(device, shape, bits, per, grid) and (device.type != "meta" or _kernels() is not None)


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
    x3 = _as_rows(x)
    coded = torch.empty(x3.shape, dtype=torch.float32, device=x.device) if values else None
    rows = _encode(x3, None, bits, grid, coded, None)
    if rows is None:
        return None
    return rows, None if coded is None else coded.view(x.shape)


def delta_encode(x: torch.Tensor, m_old: torch.Tensor, bits: int, grid: str, checksum: tuple[int, int]
                 ) -> tuple[torch.Tensor, ...] | None:
    """AQ-SGD's sender in two kernels: the rows of the change x − m(ξ) (`m_old`: the store's 16-bit dtype, x's
    shape), the new m(ξ) = m_old + its dequantized change in that dtype, each sample's checksum sum (int64 [B]: its
    16-bit words weighted 1 + (position · a) mod n, `checksum` = (a, n)), and the fidelity norms [B, 3] of x, of the
    change and of m_new − m_old − change. Bits as torch's ops give them (the norms' summation order aside); None if
    the kernels failed."""
    x3, m3 = _as_rows(x), _as_rows(m_old)
    m_new = torch.empty(m3.shape, dtype=m_old.dtype, device=x.device)
    parts = _parts(x3.shape)
    sums = torch.empty(x3.shape[0], parts, dtype=torch.int64, device=x.device)
    norms = torch.empty(x3.shape[0], 3, parts, dtype=torch.float32, device=x.device)
    rows = _encode(x3, m3, bits, grid, None, (m_new, sums, norms, *checksum))
    if rows is None:
        return None
    return rows, m_new.view(m_old.shape), sums.sum(dim=1), norms.sum(dim=2).sqrt()


def decode(rows: torch.Tensor, shape: tuple[int, ...], bits: int, grid: str) -> torch.Tensor | None:
    """Float32 values of `shape` from rows [B, row_bytes] that `encode` (or `directq.encode_samples`) wrote; None if
    the kernels failed (as `encode`)."""
    out = _decode(rows, shape, bits, grid, None)
    return None if out is None else out[0]


def delta_decode(rows: torch.Tensor, m_old: torch.Tensor, bits: int, grid: str, checksum: tuple[int, int]
                 ) -> tuple[torch.Tensor, ...] | None:
    """AQ-SGD's receiver in one kernel: the new m(ξ) (m_old + the decoded change, in m_old's 16-bit dtype), it in
    float32 (the activation), and each sample's checksum sum (as `delta_encode`); None if the kernels failed."""
    return _decode(rows, tuple(m_old.shape), bits, grid, (m_old, checksum))


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(x.shape[0], -1, x.shape[-1]).contiguous()


def _parts(shape: tuple[int, ...]) -> int:
    """Tiles per sample of the codes and decode kernels (each writes its share of the per-sample sums)."""
    k = _kernels()
    return -(-shape[1] // k.TILE_T) * -(-shape[2] // k.TILE_C)


def _encode(x3: torch.Tensor, m3: torch.Tensor | None, bits: int, grid: str, coded: torch.Tensor | None,
            delta: tuple | None) -> torch.Tensor | None:
    """Launch the scales and codes kernels on rows [B, T, C] (`m3`, `delta`: AQ-SGD's m(ξ) and outputs)."""
    b, t, c = x3.shape
    rows = torch.empty(b, row_bytes(t, c, bits), dtype=torch.uint8, device=x3.device)
    scales = torch.empty(b, c, dtype=torch.float32, device=x3.device)
    offset, steps, top = _offset_steps(bits, grid)
    m_new, sums, norms, multiplier, modulus = delta if delta is not None else (x3, x3, x3, 0, 1)  # (unread)
    if x3.device.type == "meta":  # (the outputs alone)
        return rows
    k = _kernels()
    try:
        k.scales_kernel[(b, -(-c // k.SCALE_C))](
            x3, x3 if m3 is None else m3, rows, scales, t, c, rows.shape[1], KIND=_SCALE_KINDS[grid],
            FP16_MAX=FP16_MAX, HAS_M=m3 is not None, BT=k.SCALE_T, BC=k.SCALE_C, **k.OPTIONS)
        k.codes_kernel[(b * -(-t // k.TILE_T), -(-c // k.TILE_C))](
            x3, x3 if m3 is None else m3, rows, scales, _levels(bits, grid, x3.device),
            x3 if coded is None else coded, m_new, sums, norms, t, c, rows.shape[1], float(offset), float(steps),
            float(top), multiplier, modulus, BITS=bits, VALUES=coded is not None, HAS_M=m3 is not None,
            BT=k.TILE_T, BC=k.TILE_C, **k.OPTIONS)
    except Exception as error:  # (a Triton that cannot compile for this GPU, say): the torch ops code it
        _give_up(error)
        return None
    return rows


def _decode(rows: torch.Tensor, shape: tuple[int, ...], bits: int, grid: str,
            delta: tuple[torch.Tensor, tuple[int, int]] | None) -> tuple[torch.Tensor, ...] | None:
    """Launch the decode kernel (`delta`: AQ-SGD's m(ξ) and checksum constants): (values,) or, for AQ-SGD,
    (m_new, values, sums)."""
    b, c = shape[0], shape[-1]
    t = 1
    for d in shape[1:-1]:
        t *= d
    rows = rows.contiguous()
    if rows.shape != (b, row_bytes(t, c, bits)):
        raise ValueError(f"rows of shape {tuple(rows.shape)} cannot hold a {bits}-bit batch of shape {shape}")
    out = torch.empty(b, t, c, dtype=torch.float32, device=rows.device)
    if delta is None:
        m3, m_new, sums, (multiplier, modulus) = out, out, out, (0, 1)  # (unread)
    else:
        m3 = _as_rows(delta[0])
        m_new = torch.empty(m3.shape, dtype=m3.dtype, device=rows.device)
        sums = torch.empty(b, _parts(m3.shape), dtype=torch.int64, device=rows.device)
        multiplier, modulus = delta[1]
    if rows.device.type != "meta":  # (on the meta device: the outputs alone)
        k = _kernels()
        try:
            k.decode_kernel[(b * -(-t // k.TILE_T), -(-c // k.TILE_C))](
                rows, _levels(bits, grid, rows.device), out, m3, m_new, sums, t, c, rows.shape[1], multiplier,
                modulus, BITS=bits, HAS_M=delta is not None, BT=k.TILE_T, BC=k.TILE_C, **k.OPTIONS)
        except Exception as error:
            _give_up(error)
            return None
    if delta is None:
        return (out.view(shape),)
    return m_new.view(shape), out.view(shape), sums.sum(dim=1)


def _give_up(error: Exception) -> None:
    """Turn the kernels off for the rest of the process, saying why once."""
    if not _failed:
        log.warning("fused codec kernels off, the torch ops code from now on: %s: %s", type(error).__name__, error)
    _failed.append(f"{type(error).__name__}: {error}")


@functools.cache
def _triton_present() -> bool:
    """Whether Triton is installed, without importing it (what the capacity plan's meta runs ask: seconds saved)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels():
    """`aqpipe.compress.fused_kernels` (compiled on first use), or None where Triton does not import."""
    try:
        from aqpipe.compress import fused_kernels
    except Exception:  # (an absent or broken Triton: the torch ops run)
        return None
    return fused_kernels
