"""The vocabulary of what a grad sync hands to the network: `SyncBytes`, the collectives' shares per member, and
the message formats' constants, which the compressors read from here (no torch import: each method's class sizes
its step with these, `Compressor.step_bytes`, before anything runs)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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

    @classmethod
    def every_step(cls, nbytes: int) -> SyncBytes:
        """The same bytes in every step."""
        return cls(nbytes, nbytes)


def ring_all_reduce_bytes(nbytes: int, n: int) -> int:
    """What one member of a ring all-reduce of `nbytes` sends: 2·(n−1)/n of it (reduce-scatter, then all-gather)."""
    return 2 * (n - 1) * nbytes // n


def all_gather_bytes(nbytes: int, n: int) -> int:
    """What one member sends in an all-gather of its `nbytes` over a ring: its part, passed on n−1 times."""
    return (n - 1) * nbytes


def gathered_message_bytes(nbytes: int, n: int) -> int:
    """What one member sends in an all-gather of byte messages (`aqpipe.compress.grad.gather`) of `nbytes` each."""
    return all_gather_bytes(GATHER_HEADER + nbytes, n)


def quantized_bytes(values: int, bits: int) -> int:
    """A B-bit message of `values` (`aqpipe.compress.grad.quantized.encode`): an fp16 scale and the packed codes per
    QUANTIZED_CHUNK values."""
    rows = -(-values // QUANTIZED_CHUNK)
    return 2 * rows + rows * -(-QUANTIZED_CHUNK * bits // 8)


def count_bits(hop: int) -> int:
    """Bits of a running +1 count after `hop` replicas (it lies in 0..hop): ⌈log2(hop+1)⌉."""
    return max(1, math.ceil(math.log2(hop + 1)))


def active_rows_bytes(shapes: Sequence[tuple[int, ...]], n: int) -> int:
    """What a sign method's agreement on the active rows sends: a byte per row (`base.row_counts`), max-reduced."""
    return ring_all_reduce_bytes(sum(shape[0] if shape else 1 for shape in shapes), n)
