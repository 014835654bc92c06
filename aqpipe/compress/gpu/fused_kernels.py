"""The Triton source of `aqpipe.compress.gpu.fused`'s kernels (imported only where Triton is): see that module for what
each computes and why its float operations are torch's own."""

import os

import triton
import triton.language as tl


@triton.jit
def m_row(sample, slots_ptr, SLOTS: tl.constexpr):
    """The row of m(ξ) that `sample` of the batch reads: its slot of a slab (SLOTS), else its own place."""
    if SLOTS:
        row = tl.load(slots_ptr + sample).to(tl.int64)
    else:
        row = sample.to(tl.int64)
    return row


@triton.jit
def moved(ptr, slots_ptr, at):
    """`ptr` moved to the address `slots_ptr[at]` holds: a tensor of the same layout elsewhere (a graph captured with
    `ptr` replays on another activation without copying it in). Both start at the same offset from a
    `cuda_graphs.ADDRESS_GRAIN` (64-byte) boundary — a graph's signature says so — and the elements are at most 4
    bytes, so the shift is a multiple of 16 elements: said to the compiler, which then keeps the vector loads and
    stores it makes for `ptr` itself."""
    size: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    shift = (tl.load(slots_ptr + at) - ptr.to(tl.int64)) // size
    return ptr + tl.multiple_of(shift, 16)


@triton.constexpr_function
def word_type(bits):
    """The word a group of 8 codes of `bits` bits is packed into: 32 bits hold up to 4-bit codes (half the registers
    and shuffles of 64-bit words, and no 64-bit shifts), 64 bits the wider ones."""
    return tl.uint32 if bits <= 4 else tl.uint64


@triton.jit
def level(code, offset, step, INVERSE: tl.constexpr):
    """Each code's level on a unit scale, (code − offset) / steps, as the float32 `quantize.levels` tabulates
    (`quantize.level_step` gives `step`): times `step` = 1/steps with INVERSE (steps a power of two: exact), else
    divided by `step` = steps, correctly rounded. Formed in registers, not read from the table: a load at an address
    made of the codes has no contiguity, so Triton gave it — and through it the whole tile's arithmetic — a layout
    of its own, moving each tile between layouts through shared memory three times (compiled for an H100: 1,320 SASS
    instructions in the codes kernel with the table, 968 without)."""
    k = code.to(tl.float32) - offset  # (exact: codes and offsets are small multiples of 1/2)
    if INVERSE:
        return k * step
    return tl.div_rn(k, step)


@triton.jit(do_not_specialize=["X_AT"])  # (an index into the slots, unread without X_MOVED: one kernel for any)
def scales_kernel(x_ptr, m_ptr, slots_ptr, rows_ptr, s_ptr, T, C, W, X_AT, KIND: tl.constexpr,
                  FP16_MAX: tl.constexpr, HAS_M: tl.constexpr, SLOTS: tl.constexpr, X_MOVED: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr):
    """One program per (sample, BC channels): the channels' extremes over all T tokens (of x − m with HAS_M; m's row
    `slots_ptr[sample]` of a slab with SLOTS; x read at the address `slots_ptr[X_AT]` with X_MOVED), their scale on
    the grid (KIND 0: signed, 1: max |x|) rounded up to fp16, written into the row's first 2·C bytes and, as fp32,
    into `s_ptr` [B, C] for `codes_kernel`."""
    if X_MOVED:
        x_ptr = moved(x_ptr, slots_ptr, X_AT)
    sample = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = cols < C
    high = tl.full([BT, BC], float("-inf"), tl.float32)
    low = tl.full([BT, BC], float("inf"), tl.float32)
    nan = tl.zeros([BT, BC], tl.int32)  # (a GPU's max and min skip a NaN; torch's propagate it: counted apart)
    base = sample.to(tl.int64) * T * C
    m_base = m_row(sample, slots_ptr, SLOTS) * T * C
    for t0 in range(0, T, BT):
        tokens = t0 + tl.arange(0, BT)
        inside = (tokens[:, None] < T) & in_c[None, :]
        within = tokens[:, None].to(tl.int64) * C + cols[None, :]
        v = tl.load(x_ptr + base + within, mask=inside, other=0.0).to(tl.float32)
        if HAS_M:  # AQ-SGD: the change since m(ξ)
            v = v - tl.load(m_ptr + m_base + within, mask=inside, other=0.0).to(tl.float32)
        nan = tl.maximum(nan, (v != v).to(tl.int32))
        v = tl.where(v != v, 0.0, v)
        high = tl.maximum(high, tl.where(inside, v, float("-inf")))
        low = tl.minimum(low, tl.where(inside, v, float("inf")))
    hi = tl.max(high, axis=0)
    lo = tl.min(low, axis=0)
    hi = tl.where(tl.max(nan, axis=0) > 0, float("nan"), hi)  # a NaN makes the scale NaN, as torch's aminmax does
    lo = tl.where(tl.max(nan, axis=0) > 0, float("nan"), lo)
    positive = tl.where(hi < 0.0, 0.0, hi)  # clamp(min=0) that keeps a NaN, as torch's clamp does
    negative = tl.where(-lo < 0.0, 0.0, -lo)
    if KIND == 0:  # signed: the long side (−1 …) where the largest magnitude lies, so it is exact
        scale = tl.where(positive > negative, -positive, negative)
    else:
        scale = tl.where(positive > negative, positive, negative)  # (NaN stays NaN, as in torch's amax)
    magnitude = tl.where(tl.abs(scale) > FP16_MAX, FP16_MAX, tl.abs(scale))  # (keeps a NaN)
    half = magnitude.to(tl.float16)
    bits16 = half.to(tl.int16, bitcast=True) + (half.to(tl.float32) < magnitude).to(tl.int16)  # round up
    half = bits16.to(tl.float16, bitcast=True)
    half = tl.where(scale < 0, -half, half)
    tl.store(s_ptr + sample * C + cols, half.to(tl.float32), mask=in_c)
    pattern = half.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    row = rows_ptr + sample.to(tl.int64) * W + 2 * cols
    tl.store(row, (pattern & 0xFF).to(tl.uint8), mask=in_c)  # little-endian fp16
    tl.store(row + 1, (pattern >> 8).to(tl.uint8), mask=in_c)


@triton.jit(do_not_specialize=["X_AT"])
def codes_kernel(x_ptr, m_ptr, slots_ptr, rows_ptr, s_ptr, values_ptr, m_new_ptr, sums_ptr, norms_ptr, bad_ptr, T,
                 C, W, X_AT, offset, steps, top, step, row_w_ptr, col_w_ptr, modulus, m_max, BITS: tl.constexpr,
                 INVERSE: tl.constexpr, VALUES: tl.constexpr, HAS_M: tl.constexpr, SLOTS: tl.constexpr,
                 X_MOVED: tl.constexpr, IN_PLACE: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """One program per (sample, BT tokens, BC channels): each value's code (x read at `slots_ptr[X_AT]` with
    X_MOVED), packed into the row after its scales; with VALUES the dequantized values (`level`(code) · scale); with
    HAS_M AQ-SGD's new m(ξ) (IN_PLACE: over the old, in m's own rows) and the tile's checksum and norm parts (its
    words' weights from `fused.weight_parts`' tables), and how many of its new m(ξ) values the store cannot keep
    (beyond `m_max`, the store dtype's largest, or NaN)."""
    if X_MOVED:
        x_ptr = moved(x_ptr, slots_ptr, X_AT)
    tiles_t = tl.cdiv(T, BT)
    sample = tl.program_id(0) // tiles_t
    tokens = (tl.program_id(0) % tiles_t) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = (tokens[:, None] < T) & (cols[None, :] < C)
    within = tokens[:, None].to(tl.int64) * C + cols[None, :]
    at = sample.to(tl.int64) * T * C + within
    x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
    v = x
    if HAS_M:
        m_at = m_row(sample, slots_ptr, SLOTS) * T * C + within  # (each program reads and writes its own tile alone)
        m = tl.load(m_ptr + m_at, mask=inside, other=0.0).to(tl.float32)
        v = x - m
    scale = tl.load(s_ptr + sample * C + cols, mask=cols < C, other=1.0)
    s = tl.where(scale == 0.0, 1.0, scale)[None, :]
    u = tl.div_rn(v, s) * steps + offset
    # clamped to the codes (a NaN — of a NaN value or a NaN scale — to code 0: torch leaves that code undefined, and
    # the scale the receiver multiplies by is NaN anyway)
    u = tl.where(u != u, 0.0, tl.minimum(tl.maximum(u, 0.0), top))
    # round half to even, exact for 0 ≤ u < 2^22: adding 1.5·2^23 leaves no fraction bits
    u = (u + 12582912.0) - 12582912.0
    code = u.to(tl.int32)
    if VALUES or HAS_M:
        values = level(code, offset, step, INVERSE) * scale[None, :]
        if VALUES:
            tl.store(values_ptr + at, values, mask=inside)
        if HAS_M:  # the new m(ξ) in the store's dtype, its checksum part and the fidelity norms' parts
            new = (m + values).to(m_new_ptr.dtype.element_ty)
            if IN_PLACE:
                tl.store(m_ptr + m_at, new, mask=inside)
            else:
                tl.store(m_new_ptr + at, new, mask=inside)
            part = tl.program_id(0) % tiles_t * tl.num_programs(1) + tl.program_id(1)
            parts = tiles_t * tl.num_programs(1)
            tl.store(sums_ptr + sample * parts + part,
                     checksum_part(new, tokens, cols, T, C, inside, row_w_ptr, col_w_ptr, modulus))
            error = tl.where(inside, new.to(tl.float32) - m - v, 0.0)  # (what torch computes: m_new − m_old − change)
            norms = norms_ptr + sample * 3 * parts + part
            tl.store(norms, tl.sum(tl.sum(x * x, axis=1), axis=0))
            tl.store(norms + parts, tl.sum(tl.sum(v * v, axis=1), axis=0))
            tl.store(norms + 2 * parts, tl.sum(tl.sum(error * error, axis=1), axis=0))
            unstorable = inside & ~(tl.abs(new.to(tl.float32)) <= m_max)  # (a NaN fails the comparison)
            tl.store(bad_ptr + sample * parts + part, tl.sum(tl.sum(unstorable.to(tl.int32), axis=1), axis=0))
    # a group's 8 codes as one word (`word_type`)
    WORD: tl.constexpr = word_type(BITS)
    shift = (tl.arange(0, 8) * BITS).to(WORD)
    word = tl.sum(tl.reshape(code.to(WORD), (BT, BC // 8, 8)) << shift[None, None, :], axis=2)
    groups = tl.program_id(1) * (BC // 8) + tl.arange(0, BC // 8)
    stored = (tokens[:, None] < T) & (groups[None, :] < C // 8)
    out = (rows_ptr + sample.to(tl.int64) * W + 2 * C + tokens[:, None].to(tl.int64) * (C // 8 * BITS)
           + groups[None, :] * BITS)
    for k in tl.static_range(BITS):
        tl.store(out + k, ((word >> (8 * k)) & 0xFF).to(tl.uint8), mask=stored)


@triton.jit
def checksum_part(new, tokens, cols, T, C, inside, row_w_ptr, col_w_ptr, modulus):
    """The tile's share of its sample's checksum sum: each 16-bit word (sign-extended) times its position's weight
    1 + (position · multiplier) mod modulus, in int64 (exact: any order of the parts gives the same sum).

    position = token · C + col, so (position · multiplier) mod n = (r(token) + c(col)) mod n with r and c read from
    `fused.weight_parts`' tables, both below n: no remainder formed here (a GPU has no divider: each 64-bit one
    is a long instruction sequence, and each thread of a tile would form several), one conditional subtraction per
    value. Each word times its weight is below 2^15 · 2^16, so it is formed in int32."""
    row = tl.load(row_w_ptr + tokens, mask=tokens < T, other=0)
    col = tl.load(col_w_ptr + cols, mask=cols < C, other=0)
    both = row[:, None] + col[None, :]  # (int32, each below 2^16: the sum below 2^17)
    weight = 1 + tl.where(both >= modulus, both - modulus, both)
    word = new.to(tl.int16, bitcast=True).to(tl.int32)
    return tl.sum(tl.sum(tl.where(inside, word * weight, 0).to(tl.int64), axis=1), axis=0)


@triton.jit(do_not_specialize=["ROWS_AT", "OUT_AT"])
def decode_kernel(rows_ptr, out_ptr, m_ptr, slots_ptr, m_new_ptr, sums_ptr, T, C, W, ROWS_AT, OUT_AT, offset, top,
                  step, row_w_ptr, col_w_ptr, modulus, BITS: tl.constexpr, INVERSE: tl.constexpr, HAS_M: tl.constexpr,
                  SLOTS: tl.constexpr, ROWS_MOVED: tl.constexpr, OUT_MOVED: tl.constexpr, IN_PLACE: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr):
    """One program per (sample, BT tokens, BC channels): unpack the codes, `level`(code) · scale; with HAS_M the new
    m(ξ) = m + that (m's row `slots_ptr[sample]` of a slab with SLOTS), in m's dtype (IN_PLACE: over the old), its
    float32 value as the output (written at the address `slots_ptr[OUT_AT]` with OUT_MOVED) and the tile's checksum
    part. With ROWS_MOVED the rows are read at the address `slots_ptr[ROWS_AT]`."""
    if ROWS_MOVED:
        rows_ptr = moved(rows_ptr, slots_ptr, ROWS_AT)
    if OUT_MOVED:
        out_ptr = moved(out_ptr, slots_ptr, OUT_AT)
    tiles_t = tl.cdiv(T, BT)
    sample = tl.program_id(0) // tiles_t
    tokens = (tl.program_id(0) % tiles_t) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = cols < C
    inside = (tokens[:, None] < T) & in_c[None, :]
    row = rows_ptr + sample.to(tl.int64) * W
    pattern = (tl.load(row + 2 * cols, mask=in_c, other=0).to(tl.int32)
               | (tl.load(row + 2 * cols + 1, mask=in_c, other=0).to(tl.int32) << 8))
    scale = pattern.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    # each group of 8 codes (BITS bytes) as one word, split into its codes in registers: 8 channels a thread, the
    # layout of the arithmetic after. Only the words (one a thread) move there from their loads' layout; a load per
    # code's bytes was two loads a value, and drew the whole tile's values into their layout.
    groups = tl.program_id(1) * (BC // 8) + tl.arange(0, BC // 8)
    held = (tokens[:, None] < T) & (groups[None, :] < C // 8)
    first = row + 2 * C + tokens[:, None].to(tl.int64) * (C // 8 * BITS) + groups[None, :] * BITS
    WORD: tl.constexpr = word_type(BITS)
    word = tl.zeros([BT, BC // 8], WORD)
    for k in tl.static_range(BITS):
        word |= tl.load(first + k, mask=held, other=0).to(WORD) << (8 * k)
    shift = (tl.arange(0, 8) * BITS).to(WORD)
    code = tl.reshape((word[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1), (BT, BC)).to(tl.int32)
    values = level(tl.minimum(code, top), offset, step, INVERSE) * scale[None, :]  # (codes past the top repeat it)
    within = tokens[:, None].to(tl.int64) * C + cols[None, :]
    at = sample.to(tl.int64) * T * C + within
    if HAS_M:  # AQ-SGD's receiver: the new m(ξ), the activation it stands for, the checksum's part
        m_at = m_row(sample, slots_ptr, SLOTS) * T * C + within
        m = tl.load(m_ptr + m_at, mask=inside, other=0.0).to(tl.float32)
        new = (m + values).to(m_new_ptr.dtype.element_ty)
        if IN_PLACE:
            tl.store(m_ptr + m_at, new, mask=inside)
        else:
            tl.store(m_new_ptr + at, new, mask=inside)
        values = new.to(tl.float32)
        part = tl.program_id(0) % tiles_t * tl.num_programs(1) + tl.program_id(1)
        tl.store(sums_ptr + sample * tiles_t * tl.num_programs(1) + part,
                 checksum_part(new, tokens, cols, T, C, inside, row_w_ptr, col_w_ptr, modulus))
    tl.store(out_ptr + at, values, mask=inside)


@triton.jit
def verdicts_kernel(s_ptr, sums_ptr, norms_ptr, bad_ptr, verdicts_ptr, norms_out_ptr, squares_ptr, B, C, P,
                    FP16_MAX: tl.constexpr, ENCODE: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr):
    """A program per sample, after the codes (ENCODE) or decode kernel: the sample's verdicts — whether it can go as
    a delta (ENCODE: no scale clamped at the fp16 maximum or NaN, every new m(ξ) value storable; a decode's are all
    kept) and its checksum sum, the sum of its tiles' parts — into `verdicts_ptr` [2B] (int64, the layout
    `aqsgd_rows.verdicts_of` gives); with ENCODE also its fidelity norms [B, 3] (square roots of the parts' sums) and
    their squares in float64 into `squares_ptr` [B, 3], which the caller sums over the batch as the torch ops do."""
    sample = tl.program_id(0)
    total = tl.zeros([BP], tl.int64)
    for p0 in range(0, P, BP):
        parts = p0 + tl.arange(0, BP)
        total += tl.load(sums_ptr + sample * P + parts, mask=parts < P, other=0)
    ok = 1
    if ENCODE:
        bad = tl.zeros([BP], tl.int32)
        n0 = tl.zeros([BP], tl.float32)
        n1 = tl.zeros([BP], tl.float32)
        n2 = tl.zeros([BP], tl.float32)
        for p0 in range(0, P, BP):
            parts = p0 + tl.arange(0, BP)
            inside = parts < P
            bad += tl.load(bad_ptr + sample * P + parts, mask=inside, other=0)
            norms = norms_ptr + sample * 3 * P + parts
            n0 += tl.load(norms, mask=inside, other=0.0)
            n1 += tl.load(norms + P, mask=inside, other=0.0)
            n2 += tl.load(norms + 2 * P, mask=inside, other=0.0)
        clipped = tl.zeros([BC], tl.int32)
        for c0 in range(0, C, BC):
            cols = c0 + tl.arange(0, BC)
            scale = tl.load(s_ptr + sample * C + cols, mask=cols < C, other=0.0)
            clipped += ((cols < C) & ~(tl.abs(scale) < FP16_MAX)).to(tl.int32)  # (a NaN fails too)
        ok = ((tl.sum(bad, axis=0) == 0) & (tl.sum(clipped, axis=0) == 0)).to(tl.int32)
        r0 = tl.sqrt_rn(tl.sum(n0, axis=0))
        r1 = tl.sqrt_rn(tl.sum(n1, axis=0))
        r2 = tl.sqrt_rn(tl.sum(n2, axis=0))
        tl.store(norms_out_ptr + sample * 3, r0)
        tl.store(norms_out_ptr + sample * 3 + 1, r1)
        tl.store(norms_out_ptr + sample * 3 + 2, r2)
        tl.store(squares_ptr + sample * 3, r0.to(tl.float64) * r0.to(tl.float64))
        tl.store(squares_ptr + sample * 3 + 1, r1.to(tl.float64) * r1.to(tl.float64))
        tl.store(squares_ptr + sample * 3 + 2, r2.to(tl.float64) * r2.to(tl.float64))
    tl.store(verdicts_ptr + sample, ok)
    tl.store(verdicts_ptr + B + sample, tl.sum(total, axis=0))


# Tiles and warps: each kernel's fastest whose bits match, by benchmarks/fused_tiles.py on an H200 at SmolLM2's
# 8 × 1024 × 576, 3 bits (scales 15.9 µs, AQ-SGD's decode 26.6 µs). DirectQ's decode (no m(ξ) to read) keeps 4
# warps: 2 are no faster for it.
SCALE_T, SCALE_C = 128, 32  # the scales kernel's tile: tokens × channels (it walks every token of its channels)
TILE_T, TILE_C = 16, 64  # the codes and decode kernels' tile
WARPS = {"scales": 4, "codes": 4, "decode": 4, "delta_decode": 2, "verdicts": 4}  # each kernel's warps a program
VERDICT_P, VERDICT_C = 256, 256  # the verdicts kernel's strides over a sample's tile parts and scales
# no fused multiply-add: torch rounds x/s·steps and then +offset (and level·scale) separately
# (Triton's interpreter, TRITON_INTERPRET=1 as `fused.interpreted` reads it, takes no compiler options)
OPTIONS: dict = {} if os.environ.get("TRITON_INTERPRET", "0") == "1" else {"enable_fp_fusion": False}
