"""What one replica's grad sync hands to the network in an optimizer step, per --grad-sync method, from each method's
message format (no torch import: the capacity plan reads it before anything runs). The constants here are the formats'
own: the compressors read them from this module."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from aqpipe.compress.grad.methods import parse_grad_spec

# When a method's costliest step comes (`SyncBytes.costliest_when`)
EVERY_STEP, FIRST_STEPS, PERIODIC = "every step", "first steps", "periodic"
# Values per fp16 scale in the B-bit messages of ef and qadam (`aqpipe.compress.grad.quantized`)
QUANTIZED_CHUNK = 512
# Bytes before each message an all-gather of bytes carries: its length (`aqpipe.compress.grad.gather`)
GATHER_HEADER = 8
# Steps torch's PowerSGD hook all-reduces plain fp32 gradients before it factors them
POWERSGD_PLAIN_STEPS = 2
# Steps fft sends fp32 values while it calibrates the range of its N-bit format
FFT_CALIBRATION_STEPS = 3


@dataclass(frozen=True)
class SyncBytes:
    """What one replica's grad sync hands to the network in an optimizer step, in bytes: once it compresses, and in
    its costliest step, which comes `costliest_when`: EVERY_STEP (every step is that), FIRST_STEPS (fp32 in the
    first `costly_steps` steps: a warm-up or calibration), PERIODIC (Marsit's full-precision steps)."""

    steady: int
    costliest: int
    costliest_when: str = EVERY_STEP
    costly_steps: int = 0


def sync_step_bytes(text: str, dp: int, shapes: Sequence[tuple[int, ...]], qadam_warmup_steps: int = 1) -> SyncBytes:
    """`SyncBytes` of one replica of `dp` for synchronized parameters of `shapes` (qadam exchanging fp32 averages for
    `qadam_warmup_steps` steps). Exact for the formats' fixed sizes; sidco's at its target fraction, which it
    approaches from below; the sign-based methods' with every row active (unused rows of a table vote on nothing):
    at most what they send. tests/test_grad_methods.py holds it to the bytes the code counts."""
    spec = parse_grad_spec(text)
    values = sum(math.prod(shape) for shape in shapes)
    if dp < 2 or values == 0:
        return SyncBytes(0, 0)

    def ring(nbytes: float) -> int:  # one member's share of a ring all-reduce
        return int(2 * (dp - 1) * nbytes // dp)

    def gather(nbytes: float) -> int:  # one member's message, passed on dp - 1 times
        return int((dp - 1) * (GATHER_HEADER + nbytes))

    fp32 = ring(4 * values)
    method, args = spec.method, spec.args
    if method == "none":
        return SyncBytes(fp32, fp32)
    if method in ("fp16", "bf16"):
        return SyncBytes(ring(2 * values), ring(2 * values))
    if method == "powersgd":
        factored = ring(4 * sum(_powersgd_values(shape, args[0]) for shape in shapes))
        return SyncBytes(factored, max(factored, fp32), FIRST_STEPS, POWERSGD_PLAIN_STEPS)
    if method == "ef":
        return SyncBytes(gather(_quantized_bytes(values, args[0])), gather(_quantized_bytes(values, args[0])))
    if method == "qadam":  # each replica's chunk of 1/dp of the momentum to its server, and the server's back to all
        chunks = 2 * (dp - 1) * _quantized_bytes(-(-values // dp), args[0])
        return SyncBytes(chunks, max(chunks, fp32), FIRST_STEPS, qadam_warmup_steps)
    if method in ("topk", "sidco"):
        kept = max(1, math.ceil(args[-1] * values))
        return SyncBytes(gather(8 * kept), gather(8 * kept))  # fp32 values and int32 indices
    if method == "fft":
        theta, bits = args
        length = values // 2 + 1  # the real FFT's frequency components
        kept = max(1, min(length, math.ceil((1.0 - theta) * length)))
        bitmap = -(-length // 8)
        calibrating = gather(bitmap + 1 + 8 * kept)  # fp32 real and imaginary parts until the format is agreed
        if bits == 32:
            return SyncBytes(calibrating, calibrating)
        return SyncBytes(gather(bitmap + 1 + -(-2 * kept * bits // 8)), calibrating, FIRST_STEPS, FFT_CALIBRATION_STEPS)
    # the sign-based methods: which rows are active (a byte per row, max-reduced), then a ring of packed codes
    active = ring(sum(shape[0] if shape else 1 for shape in shapes))
    chunk = -(-values // dp)
    if method == "signsgd":  # counts of +1 votes growing a bit wider as they pass replicas, then the majority's bits
        counts = sum(-(-chunk * count_bits(hop + 1) // 8) for hop in range(dp - 1))
        votes = active + counts + (dp - 1) * -(-chunk // 8)
        return SyncBytes(votes, votes)
    signs = active + 2 * (dp - 1) * -(-chunk // 8) + ring(4 * len(shapes))  # Marsit: sign bits, a step size per tensor
    period = args[0]
    if period == 0:
        return SyncBytes(signs, signs)
    full = active + fp32
    return SyncBytes(full if period == 1 else signs, full, PERIODIC)


def count_bits(hop: int) -> int:
    """Bits of a running +1 count after `hop` replicas (it lies in 0..hop): ⌈log2(hop+1)⌉."""
    return max(1, math.ceil(math.log2(hop + 1)))


def _powersgd_values(shape: tuple[int, ...], rank: int) -> int:
    """Values torch's PowerSGD hook all-reduces for one tensor: its factors P and Q where they are less than half of
    it (the hook's min_compression_rate of 2, on the tensor viewed as shape[0] rows), else the tensor."""
    size = math.prod(shape)
    if len(shape) < 2:
        return size
    rows = shape[0]
    cols = size // rows if rows else 0
    factors = (rows + cols) * min(rows, cols, rank)
    return factors if 2 * factors < size else size


def _quantized_bytes(values: int, bits: int) -> int:
    """A B-bit message of `values` (`aqpipe.compress.grad.quantized.encode`): an fp16 scale and the packed codes per
    QUANTIZED_CHUNK values."""
    rows = -(-values // QUANTIZED_CHUNK)
    return 2 * rows + rows * -(-QUANTIZED_CHUNK * bits // 8)
