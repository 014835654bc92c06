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
- `decode_kernel`: unpack and dequantize: level(code) · scale, as everywhere (the level formed in registers,
  `quantize.level_step`: the same float32 as `quantize.levels`' table, which the kernels do not read).

With an m(ξ) (`delta_encode`, `delta_decode`) the same kernels do AQ-SGD's delta step: they code x − m(ξ), write the
new m(ξ) in its 16-bit dtype, each tile's share of the checksum sums (exact int64), of the fidelity norms and of the
values m(ξ) cannot keep; `verdicts_kernel` sums each sample's shares into what the host reads. They read m(ξ) where
it lies — a slab's rows through their slots (`storage.slab`), so a message's m(ξ) is never gathered into a copy —
and, asked (`in_place`: a batch of distinct samples, once the step's kernels have run in the process), write the new
m(ξ) over the old there, with no scatter after them. They read the activation in its own dtype and write the codes
straight into the message's payload after its mode bytes. Over a slab's rows written in place, AQ-SGD's codec
replays the whole step from a CUDA graph that holds the slab where it lies (`aqpipe.compress.link.aqsgd_fused`),
which buys back the launches and allocations, most of a message's host time — on an H100 at SmolLM2's 8 × 1024 ×
576 a pair took 644–708 µs launched and 471–524 µs replayed, for ~215 µs of device time (benchmarks/README.md). So
that a replay needs no copy of the activation in or of the decoded activation out, the kernels can reach either
through an address the slots carry after the rows' slots (`addressable`): they move their pointer there.

DirectQ's kernels apply where `encodable` and `fusable` say (a CUDA tensor of ≥ 3 dims whose channel count is a
multiple of 8, per-channel scales, nearest rounding, 2–8 bits, a grid whose scale needs no division: signed,
symmetric, uniform) and Triton imports; AQ-SGD's on batches of a million values and more (`delta_fusable`:
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
from dataclasses import dataclass

import torch

from aqpipe.compress.quantize import FP16_MAX, _offset_steps, level_step

GROUP = 8  # codes per packed group: 8 codes of b bits fill exactly b bytes
_SCALE_KINDS = {"signed": 0, "symmetric": 1, "uniform": 1}  # 0: the long side where |x| is largest; 1: max |x|
DELTA_SWITCH = "AQPIPE_FUSED_AQSGD"  # "1": AQ-SGD's delta step fused at every size, "0": at none (`delta_fusable`)
# The batch size (values) from which AQ-SGD's delta step is fused by default. Measured pair by pair at fd84a26 (aqsgd:3,
# fp16 m(ξ) on the GPU) with the step ungraphed and m(ξ) written in place, on an H200:
# fused was 8% slower at 4 × 128 × 576 (0.29 M values), as fast at 1.18 M, 18% faster at 2.36 M and 50% at SmolLM2's
# 8 × 1024 × 576. Below a million a message's time is its launches and waits, not its arithmetic. (At 1f77efc
# fused_delta_sizes.py read the fused step faster at every size, 0.29 M included: the bound is for a GPU to re-measure.)
DELTA_MIN_ELEMENTS = 1 << 20
log = logging.getLogger(__name__)
_failed: list[str] = []  # why the kernels failed to compile or launch in this process (then the torch ops run)
# the delta steps ("encode", "decode") whose every kernel has run in this process: only those write m(ξ) in place, so
# that a kernel which fails to compile on first use fails before m(ξ) has changed, and the torch ops can still take
# the message (a later recompile for another shape that failed after an in-place write would raise instead)
_proven: set[str] = set()


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter, on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fusable(device: torch.device, shape: tuple[int, ...], bits: int, per: str, grid: str) -> bool:
    """Whether the fused kernels code (and decode) a batch of `shape` on `device` (and Triton is there to run them);
    an encode asks `encodable` as well."""
    if os.environ.get("AQPIPE_FUSED_KERNELS", "1") == "0" or _failed:
        return False
    # (on the meta device the kernels' outputs are made and nothing runs: what a GPU's graphs hold, measured for the
    # capacity plan by `aqpipe.compress.gpu.graph_memory`)
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
    if dtype == torch.bfloat16 and interpreted():  # (the interpreter truncates to bfloat16 where a GPU rounds)
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
    rows = _encode(x3, bits, grid, coded)
    if rows is None:
        return None
    return rows, None if coded is None else coded.view(x.shape)


def delta_encode(x: torch.Tensor, m: torch.Tensor, slots: torch.Tensor | None, bits: int, grid: str,
                 checksum: tuple[int, int], mode: int, in_place: bool = False, x_moved: bool = False
                 ) -> DeltaEncoded | None:
    """AQ-SGD's sender in three kernels and a fill of the mode bytes, straight from m(ξ)'s storage: the change
    x − m(ξ) of each sample of `x` [B, ..., C] (any float dtype, read as float32) coded into a message's payload (a
    `mode` byte per sample, then the rows), the new m(ξ) = m(ξ) + its dequantized change in m's 16-bit dtype, and
    the verdicts, norms and squares of `DeltaEncoded`. m(ξ) of sample i is `m[slots[i]]` — rows of a slab, read in
    place — or, with `slots` None, `m[i]`. With `in_place` (slots of distinct rows) the new m(ξ) is written over the
    old in those rows, once this step's kernels have run in the process (`DeltaEncoded.m_new` None says it was).
    With `x_moved` the kernels read the activation at the address `slots[B]` holds, not at `x` (a tensor of its
    layout: see `addressable`). Bits as torch's ops give them (the norms' summation order aside); None if the
    kernels failed before writing anything."""
    x3 = _as_rows(x)
    b, t, c = x3.shape
    _check_rows(m, x.shape, slots, checksum, in_place, (x,) if x_moved else ())
    m3 = m.detach().reshape(m.shape[0], t, c)
    in_place = in_place and writes_in_place("encode", x.device)
    payload = torch.empty(b + b * row_bytes(t, c, bits), dtype=torch.uint8, device=x.device)
    payload[:b].fill_(mode)
    m_new = m3 if in_place else torch.empty(x3.shape, dtype=m.dtype, device=x.device)
    parts = _parts(x3.shape)
    rows = payload[b:].view(b, -1)
    sums, norms, unstorable, scales, verdicts, norms_out, squares, sample_squares = _carved(
        x.device, ((b, parts), torch.int64), ((b, 3, parts), torch.float32), ((b, parts), torch.int32),
        ((b, c), torch.float32), ((2 * b,), torch.int64), ((b, 3), torch.float32), ((3,), torch.float64),
        ((b, 3), torch.float64))
    done = DeltaEncoded(payload, None if in_place else m_new.view(x.shape), verdicts, norms_out, squares)
    if x.device.type == "meta":  # (the outputs alone)
        return done
    k = _kernels()
    try:
        _launch_codes(k, x3, m3, slots, rows, scales, bits, grid, None,
                      (m_new, sums, norms, unstorable, *checksum, torch.finfo(m.dtype).max), in_place, x_moved)
    except Exception as error:  # (a Triton that cannot compile for this GPU, say): the torch ops code it
        _give_up(error)
        return None
    try:
        k.verdicts_kernel[(b,)](scales, sums, norms, unstorable, verdicts, norms_out, sample_squares, b, c, parts,
                                FP16_MAX=FP16_MAX, ENCODE=True, BP=k.VERDICT_P, BC=k.VERDICT_C,
                                num_warps=k.WARPS["verdicts"], **k.OPTIONS)
    except Exception as error:
        _give_up(error, in_place)
        return None
    torch.sum(sample_squares, dim=0, out=squares)  # (summed as `aqsgd_rows.delta_fidelity` sums the torch ops')
    _proven.add("encode")
    return done


@dataclass(frozen=True)
class DeltaEncoded:
    """What `delta_encode` makes, all on the device: the `payload` of a message of these samples all as deltas, the
    new m(ξ) `m_new`, the `verdicts` [2B] (int64: whether each sample can go as a delta — no scale clamped at the
    fp16 maximum or NaN, every new m(ξ) value finite in its dtype — then its checksum sum: `aqsgd_rows.verdicts_of`'s
    layout), the fidelity `norms` [B, 3] (of x, of the change, of m_new − m_old − change) and their `squares` summed
    over the samples in float64 [3]. `m_new` is None where the kernels wrote it over the old m(ξ), in its rows."""

    payload: torch.Tensor
    m_new: torch.Tensor | None
    verdicts: torch.Tensor
    norms: torch.Tensor
    squares: torch.Tensor


def decode(rows: torch.Tensor, shape: tuple[int, ...], bits: int, grid: str) -> torch.Tensor | None:
    """Float32 values of `shape` from rows [B, row_bytes] that `encode` (or `directq.encode_samples`) wrote; None if
    the kernels failed (as `encode`)."""
    out = _decode(rows, shape, bits, grid, None)
    return None if out is None else out[0]


def delta_decode(rows: torch.Tensor, m: torch.Tensor, slots: torch.Tensor | None, shape: tuple[int, ...], bits: int,
                 grid: str, checksum: tuple[int, int], in_place: bool = False, into: torch.Tensor | None = None,
                 rows_moved: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor] | None:
    """AQ-SGD's receiver in two kernels, straight from m(ξ)'s storage (`m`, `slots`, `in_place`: as
    `delta_encode`): the new m(ξ) (m(ξ) + the decoded change, in m's 16-bit dtype; None where written over the old)
    of the batch of `shape`, it in float32 (the activation, a tensor of its own — or, given `into`, None: written at
    the address the slots end with, `into` being a float32 tensor of its layout that the kernels move from, see
    `addressable`), and the verdicts [2B] (each sample kept, its checksum sum); None if the kernels failed before
    writing anything. With `rows_moved` the rows are read at the address `slots[B]` holds, not at `rows` (a tensor
    of their layout, as `into`)."""
    b = shape[0]
    if into is not None and (tuple(into.shape) != tuple(shape) or into.dtype != torch.float32):
        raise ValueError(f"the activation's place must be float32 {tuple(shape)}, not {into.dtype} "
                         f"{tuple(into.shape)}")
    moved = ((rows,) if rows_moved else ()) + (() if into is None else (into,))
    _check_rows(m, shape, slots, checksum, in_place, moved)
    m3 = m.detach().reshape(m.shape[0], -1, shape[-1])
    in_place = in_place and writes_in_place("decode", rows.device)
    out = _decode(rows, shape, bits, grid, (m3, slots, checksum), in_place, into, rows_moved)
    if out is None:
        return None
    m_new, values, sums = out
    verdicts = torch.empty(2 * b, dtype=torch.int64, device=rows.device)
    if rows.device.type != "meta":
        k = _kernels()
        try:
            k.verdicts_kernel[(b,)](sums, sums, sums, sums, verdicts, sums, sums, b, shape[-1], sums.shape[1],
                                    FP16_MAX=FP16_MAX, ENCODE=False, BP=k.VERDICT_P, BC=k.VERDICT_C,
                                    num_warps=k.WARPS["verdicts"], **k.OPTIONS)
        except Exception as error:
            _give_up(error, in_place)
            return None
        _proven.add("decode")
    return None if in_place else m_new, None if into is not None else values, verdicts


def addressable(t: torch.Tensor) -> bool:
    """Whether the delta kernels may reach `t` through an address their slots carry (`delta_encode`'s `x_moved`,
    `delta_decode`'s `into` and `rows_moved`) rather than where the tensor they are given lies: contiguous (they take
    it as rows) and of at most 4-byte elements. The tensor given in its place (what a graph was captured with) must
    start at the same offset from a `cuda_graphs.ADDRESS_GRAIN` boundary — a graph's signature holds that offset —
    so the shift is a multiple of 16 elements, which keeps the kernels' vector loads and stores."""
    return t.is_contiguous() and t.element_size() <= 4


def failure() -> str | None:
    """Why the fused kernels failed in this process (their first failure: the torch ops code from then on), or None if
    they never did (`AQPIPE_FUSED_KERNELS=0` turns them off without a failure)."""
    return _failed[0] if _failed else None


def writes_in_place(step: str, device: torch.device) -> bool:
    """Whether the delta step `step` ("encode", "decode") writes m(ξ) in place on `device`: once every kernel of it
    has run in the process (see `_proven`), and on the meta device (where nothing runs: the outputs a GPU's
    in-place step makes, for the capacity plan)."""
    return device.type == "meta" or step in _proven


def _carved(device: torch.device, *specs: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
    """Tensors of each (shape, dtype) of `specs`, carved from one block of memory at 8-byte boundaries: a message's
    small buffers in one call to the allocator, not one each (each call is host time on a GPU's hot path)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // 8) * 8)
    block = torch.empty(starts[-1], dtype=torch.uint8, device=device)
    return [block[start:start + size].view(dtype).view(shape)
            for (shape, dtype), start, size in zip(specs, starts, sizes)]


def _check_rows(m: torch.Tensor, shape: tuple[int, ...], slots: torch.Tensor | None, checksum: tuple[int, int],
                in_place: bool, moved: tuple[torch.Tensor, ...] = ()) -> None:
    """m(ξ)'s rows must hold the batch of `shape`: its own B rows, or slots [B] (int64, on m's device) into a slab,
    each row of the batch's sample shape (written `in_place` only through slots, whose rows the caller keeps
    distinct); and the checksum's weights must fit 16 bits (the kernels form each word's product in int32). The
    tensors the kernels reach through an address (`moved`, each `addressable`) come with slots [B + their number]
    that carry their addresses after the rows' slots."""
    if moved and (slots is None or not all(addressable(t) for t in moved)):
        raise ValueError("a tensor reached through an address needs slots to carry it, and must be contiguous, of "
                         "at most 4-byte elements")
    b = shape[0] + len(moved)
    if tuple(m.shape[1:]) != tuple(shape[1:]):
        raise ValueError(f"m(xi) rows of shape {tuple(m.shape[1:])} for samples of shape {tuple(shape[1:])}")
    if in_place and slots is None:
        raise ValueError("m(xi) is written in place only into a slab's rows, through their slots")
    if slots is None:
        if m.shape[0] != b:
            raise ValueError(f"m(xi) of {m.shape[0]} samples for a batch of {b}")  # (b: the batch, nothing moved)
    elif slots.shape != (b,) or slots.dtype != torch.int64 or slots.device != m.device:
        raise ValueError(f"slots must be int64 [{b}] on {m.device}, not {slots.dtype} {tuple(slots.shape)} on "
                         f"{slots.device}")
    if not 0 < checksum[1] <= 1 << 16:
        raise ValueError(f"the checksum's modulus {checksum[1]} must lie in 1..65536")


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(x.shape[0], -1, x.shape[-1]).contiguous()


def _parts(shape: tuple[int, ...]) -> int:
    """Tiles per sample of the codes and decode kernels (each writes its share of the per-sample sums)."""
    k = _kernels()
    return -(-shape[1] // k.TILE_T) * -(-shape[2] // k.TILE_C)


def _encode(x3: torch.Tensor, bits: int, grid: str, coded: torch.Tensor | None) -> torch.Tensor | None:
    """DirectQ's rows [B, row_bytes] of rows [B, T, C] (and the dequantized values into `coded`)."""
    b, t, c = x3.shape
    rows = torch.empty(b, row_bytes(t, c, bits), dtype=torch.uint8, device=x3.device)
    if x3.device.type == "meta":  # (the outputs alone)
        return rows
    scales = torch.empty(b, c, dtype=torch.float32, device=x3.device)
    try:
        _launch_codes(_kernels(), x3, None, None, rows, scales, bits, grid, coded, None)
    except Exception as error:  # (a Triton that cannot compile for this GPU, say): the torch ops code it
        _give_up(error)
        return None
    return rows


def _launch_codes(k, x3: torch.Tensor, m3: torch.Tensor | None, slots: torch.Tensor | None, rows: torch.Tensor,
                  scales: torch.Tensor, bits: int, grid: str, coded: torch.Tensor | None, delta: tuple | None,
                  in_place: bool = False, x_moved: bool = False) -> None:
    """Launch the scales and codes kernels on rows [B, T, C] into `rows` (`m3`, `slots`, `delta`: AQ-SGD's m(ξ),
    where its rows are, and the outputs (m_new, sums, norms, unstorable) with the checksum constants and the largest
    value m(ξ)'s dtype holds; `in_place`: the new m(ξ) over the old, in m3's rows; `x_moved`: x3 read at the address
    `slots[B]` holds)."""
    b, t, c = x3.shape
    offset, steps, top = _offset_steps(bits, grid)
    m_new, sums, norms, unstorable, multiplier, modulus, m_max = (
        delta if delta is not None else (x3, x3, x3, x3, 0, 1, 0.0))  # (unread)
    row_w, col_w = weight_parts(t, c, (multiplier, modulus), x3.device) if delta is not None else (x3, x3)
    m_in = x3 if m3 is None else m3
    slot_of = m_in if slots is None else slots  # (unread without slots)
    k.scales_kernel[(b, -(-c // k.SCALE_C))](
        x3, m_in, slot_of, rows, scales, t, c, rows.stride(0), b, KIND=_SCALE_KINDS[grid], FP16_MAX=FP16_MAX,
        HAS_M=m3 is not None, SLOTS=slots is not None, X_MOVED=x_moved, BT=k.SCALE_T, BC=k.SCALE_C,
        num_warps=k.WARPS["scales"], **k.OPTIONS)
    step, inverse = level_step(bits, grid)
    k.codes_kernel[(b * -(-t // k.TILE_T), -(-c // k.TILE_C))](
        x3, m_in, slot_of, rows, scales, x3 if coded is None else coded, m_new, sums, norms, unstorable, t, c,
        rows.stride(0), b, float(offset), float(steps), float(top), step, row_w, col_w, modulus, float(m_max),
        BITS=bits, INVERSE=inverse, VALUES=coded is not None, HAS_M=m3 is not None, SLOTS=slots is not None,
        X_MOVED=x_moved, IN_PLACE=in_place, BT=k.TILE_T, BC=k.TILE_C, num_warps=k.WARPS["codes"], **k.OPTIONS)


def _decode(rows: torch.Tensor, shape: tuple[int, ...], bits: int, grid: str,
            delta: tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]] | None, in_place: bool = False,
            into: torch.Tensor | None = None, rows_moved: bool = False) -> tuple[torch.Tensor, ...] | None:
    """Launch the decode kernel (`delta`: AQ-SGD's m(ξ) rows [N, T, C], the slots of the batch's rows among them or
    None, and the checksum constants): (values,) or, for AQ-SGD, (m_new, values, the tiles' checksum parts) — m_new
    being m's rows themselves where written `in_place`; the values a tensor of their own, or (`into`, a tensor of
    their layout, returned as them) written at the address the slots' last holds; with `rows_moved` the rows read at
    the address after the batch's slots."""
    b, c = shape[0], shape[-1]
    t = 1
    for d in shape[1:-1]:
        t *= d
    rows = rows.contiguous()
    if rows.shape != (b, row_bytes(t, c, bits)):
        raise ValueError(f"rows of shape {tuple(rows.shape)} cannot hold a {bits}-bit batch of shape {shape}")
    out = torch.empty(b, t, c, dtype=torch.float32, device=rows.device) if into is None else into.view(b, t, c)
    if delta is None:
        m3, slots, m_new, sums, row_w, col_w, modulus = out, None, out, out, out, out, 1  # (unread)
    else:
        m3, slots, checksum = delta
        modulus = checksum[1]
        m_new = m3 if in_place else torch.empty(b, t, c, dtype=m3.dtype, device=rows.device)
        sums = torch.empty(b, _parts((b, t, c)), dtype=torch.int64, device=rows.device)
    if rows.device.type != "meta":  # (on the meta device: the outputs alone)
        k = _kernels()
        warps = k.WARPS["decode" if delta is None else "delta_decode"]
        try:
            if delta is not None:
                row_w, col_w = weight_parts(t, c, checksum, rows.device)
            offset, _, top = _offset_steps(bits, grid)
            step, inverse = level_step(bits, grid)
            k.decode_kernel[(b * -(-t // k.TILE_T), -(-c // k.TILE_C))](
                rows, out, m3, m3 if slots is None else slots, m_new, sums, t, c, rows.shape[1], b, b + rows_moved,
                float(offset), top, step, row_w, col_w, modulus, BITS=bits, INVERSE=inverse, HAS_M=delta is not None,
                SLOTS=slots is not None, ROWS_MOVED=rows_moved, OUT_MOVED=into is not None, IN_PLACE=in_place,
                BT=k.TILE_T, BC=k.TILE_C, num_warps=warps, **k.OPTIONS)
        except Exception as error:
            _give_up(error)
            return None
    if delta is None:
        return (out.view(shape),)
    return m_new if in_place else m_new.view(shape), out.view(shape), sums


@functools.cache
def weight_parts(tokens: int, channels: int, checksum: tuple[int, int], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of a [tokens, channels] value's words as two tables the fused kernels add: word (t, ch) at
    position p = t · channels + ch weighs 1 + (p · multiplier) mod n = 1 + (r[t] + c[ch]) mod n, with r[t] =
    (t · channels · multiplier) mod n and c[ch] = (ch · multiplier) mod n (`checksum`: (multiplier, n); int32 on
    `device`, each below n) — one conditional subtraction a word and no 64-bit remainder, which a GPU forms in a
    long instruction sequence. Cached for the process's life: a codec's CUDA graph reads the tables it was captured
    with."""
    multiplier, modulus = checksum
    r = (torch.arange(tokens, dtype=torch.int64) * (channels * multiplier)) % modulus
    c = (torch.arange(channels, dtype=torch.int64) * multiplier) % modulus
    # (fresh host tensors: staged by the driver, the host does not wait for the GPU)
    return r.to(torch.int32).to(device, non_blocking=True), c.to(torch.int32).to(device, non_blocking=True)


def _give_up(error: Exception, in_place: bool = False) -> None:
    """Turn the kernels off for the rest of the process, saying why once. After a kernel that wrote m(ξ) in place
    has been launched nothing can take the message instead (the old m(ξ) is gone): a RuntimeError says so."""
    if not _failed:
        log.warning("fused codec kernels off, the torch ops code from now on: %s: %s", type(error).__name__, error)
    _failed.append(f"{type(error).__name__}: {error}")
    if in_place:
        raise RuntimeError("AQ-SGD's fused delta step failed after writing m(xi) in place, so this side's m(xi) "
                           f"no longer matches its peer's: {type(error).__name__}: {error}") from error


@functools.cache
def _triton_present() -> bool:
    """Whether Triton is installed, without importing it (what the capacity plan's meta runs ask: seconds saved)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels():
    """`aqpipe.compress.gpu.fused_kernels` (compiled on first use), or None where Triton does not import."""
    try:
        from aqpipe.compress.gpu import fused_kernels
    except Exception:  # (an absent or broken Triton: the torch ops run)
        return None
    return fused_kernels
