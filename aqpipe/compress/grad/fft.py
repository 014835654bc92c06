"""`--grad-sync fft:THETA:N`: FFT-based gradient sparsification (Wang et al., HPDC 2020, §3).

Flatten the gradient (zero-padded to the next length whose prime factors are 2, 3, 5 and 7: an FFT of a length
with a large prime factor takes several times longer), take its real FFT, keep the (1−θ) fraction of frequency
components of largest magnitude, and send a bitmap of which were kept plus their real and imaginary parts in the
paper's offset-based N-bit float (its Algorithm 1); every replica rebuilds every replica's spectrum, averages them
and inverts the FFT once (the transform is linear). N = 32 sends the parts as fp32.

The N-bit float: the bit pattern of |v| shifted right by 23−m keeps the exponent and m mantissa bits; subtracting
the pattern of the smallest representable magnitude eps (and adding 1) gives codes 1 … 2**(N−1)−1, code 0 is
zero, and one bit holds the sign — a symmetric range, the paper's balanced P = 2**N / 2. The range max is
estimated over the first CALIBRATION calls (sent as fp32 meanwhile); eps follows from max, and m is the mantissa
width that reconstructs the calibration values best.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aqpipe.compress.bitpack import pack, packed_bytes, unpack
from aqpipe.compress.grad.base import Compressor, DPGroup
from aqpipe.compress.grad.gather import all_gather_bytes_payloads
from aqpipe.compress.grad.methods import GradSpec
from aqpipe.compress.grad.wire import FFT_CALIBRATION_STEPS as CALIBRATION
from aqpipe.compress.grad.wire import FIRST_STEPS, SyncBytes, gathered_message_bytes, ring_all_reduce_bytes


class OffsetFloat:
    """The offset-based N-bit float of one range: encode fp32 values to N-bit codes and back."""

    def __init__(self, bits: int, mantissa: int, max_value: float) -> None:
        if not 2 <= bits <= 16:
            raise ValueError(f"the offset float needs 2..16 bits, got {bits}")
        self.bits, self.mantissa, self.max_value = bits, mantissa, float(max_value)
        self.shift = 23 - mantissa
        top = _pattern(self.max_value) >> self.shift
        self.levels = (1 << (bits - 1)) - 1  # magnitude codes 1..levels; 0 is zero
        self.base = top - self.levels + 1  # the shifted pattern code 1 stands for (eps's)

    @property
    def eps(self) -> float:
        """The smallest non-zero magnitude it represents."""
        return _value(self.base << self.shift)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """N-bit codes (sign bit on top) of fp32 values; magnitudes above max saturate, below eps become 0."""
        magnitude = values.abs().clamp(max=self.max_value).float()
        shifted = magnitude.view(torch.int32) >> self.shift
        codes = (shifted.long() - self.base + 1).clamp(min=0, max=self.levels)
        sign = (values < 0).long() << (self.bits - 1)
        return (codes | sign).to(torch.int32)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 values of N-bit codes."""
        codes = codes.long()
        magnitude_code = codes & self.levels
        patterns = ((magnitude_code + self.base - 1).clamp(min=0) << self.shift).to(torch.int32)
        values = torch.where(magnitude_code > 0, patterns.view(torch.float32), torch.zeros(()))
        return torch.where((codes >> (self.bits - 1)) & 1 == 1, -values, values)


def _pattern(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float32).view(torch.int32).item())


def _value(pattern: int) -> float:
    return float(torch.tensor([pattern], dtype=torch.int32).view(torch.float32).item())


def mantissa_errors(bits: int, samples: torch.Tensor, top: float) -> torch.Tensor:
    """Mean squared reconstruction error of `samples` for each mantissa width 0 … min(22, bits+7) over the range
    [−top, top] (inf where eps would fall below the smallest fp32 pattern)."""
    errors = torch.full((min(23, bits + 8),), math.inf, dtype=torch.float64)
    for mantissa in range(errors.numel()):
        fmt = OffsetFloat(bits, mantissa, top)
        if fmt.base >= 1:
            errors[mantissa] = float((fmt.decode(fmt.encode(samples)) - samples).pow(2).mean())
    return errors


def _least_error(bits: int, errors: torch.Tensor, top: float) -> OffsetFloat:
    """The format whose mantissa width has the least error (width 0 if none is usable)."""
    return OffsetFloat(bits, int(errors.argmin()) if bool(torch.isfinite(errors).any()) else 0, top)


def best_offset_float(bits: int, samples: torch.Tensor, top: float | None = None) -> OffsetFloat:
    """The mantissa width that reconstructs `samples` with least error, for the range [−top, top] (default: the
    samples' own max)."""
    top = float(top if top is not None else samples.abs().max()) or 1.0
    return _least_error(bits, mantissa_errors(bits, samples, top), top)


def agreed_offset_float(bits: int, samples: torch.Tensor, top: float, dp: DPGroup) -> tuple[OffsetFloat, int]:
    """One format for the whole DP group — the largest range any replica calibrated, and the mantissa width with the
    least error summed over the replicas' samples — so every replica decodes every payload the same way; and the
    bytes this replica sent to agree on it."""
    import torch.distributed as dist

    if dp.size == 1:
        return best_offset_float(bits, samples, top), 0
    device = samples.device
    shared_top = torch.tensor([top], dtype=torch.float64, device=device)
    dist.all_reduce(shared_top, op=dist.ReduceOp.MAX, group=dp.group)
    top = float(shared_top) or 1.0
    errors = mantissa_errors(bits, samples, top).to(device)
    dist.all_reduce(errors, group=dp.group)  # inf stays inf: every replica shares the range, so the same widths fail
    sent = ring_all_reduce_bytes(8, dp.size) + ring_all_reduce_bytes(8 * errors.numel(), dp.size)
    return _least_error(bits, errors.cpu(), top), sent


def transform_length(n: int) -> int:
    """The smallest length ≥ n whose only prime factors are 2, 3, 5 and 7: the sizes pocketfft and cuFFT transform
    fastest (for the sizes of a model's stage, at most about half a percent above n)."""
    best = 1 << (n - 1).bit_length()
    odd7 = 1
    while odd7 < best:
        odd5 = odd7
        while odd5 < best:
            odd = odd5
            while odd < best:
                best = min(best, odd << (-(-n // odd) - 1).bit_length())  # the least odd · 2^k ≥ n
                odd *= 3
            odd5 *= 5
        odd7 *= 7
    return best


def inverse(spectrum: torch.Tensor, length: int) -> torch.Tensor:
    """The gradient of `length` values a spectrum of its zero-padded transform stands for."""
    return torch.fft.irfft(spectrum, n=transform_length(length))[:length]


def kept_count(length: int, theta: float) -> int:
    """Frequency components kept out of `length` at drop ratio θ (at least one)."""
    return max(1, min(length, math.ceil((1.0 - theta) * length)))


class FFTSparsifier(Compressor):
    """Top-(1−θ) frequency components, bitmap + N-bit offset floats, all-gathered."""

    pattern = "all-gather"
    peak_copies = 8.2

    def __init__(self, dp: DPGroup, theta: float, bits: int) -> None:
        super().__init__(dp)
        self.theta, self.bits = theta, bits
        self.name = f"fft:{theta:g}:{bits}"
        self.calibration: list[float] = []
        self.format: OffsetFloat | None = None

    @classmethod
    def step_bytes(cls, spec: GradSpec, dp: int, shapes: Sequence[tuple[int, ...]], freeze_after: int) -> SyncBytes:
        """A bitmap of the real FFT's components and the kept ones' parts: fp32 while it calibrates its format."""
        theta, bits = spec.args
        length = transform_length(sum(math.prod(shape) for shape in shapes)) // 2 + 1
        kept, bitmap = kept_count(length, theta), packed_bytes(length, 1)
        calibrating = gathered_message_bytes(bitmap + 1 + 8 * kept, dp)
        if bits == 32:
            return SyncBytes.every_step(calibrating)
        steady = gathered_message_bytes(bitmap + 1 + -(-2 * kept * bits // 8), dp)
        return SyncBytes(steady, calibrating, FIRST_STEPS, CALIBRATION)

    @classmethod
    def memory_copies(cls, spec: GradSpec, dp: int) -> tuple[float, float]:
        """Every replica's spectrum, a fraction 1 − THETA of a copy while sent in fp32."""
        if dp < 2:
            return 0.0, 0.0
        theta, bits = spec.args
        return 0.0, max(cls.peak_copies if bits < 32 else 0.0, 4.3 + (dp + 1) * (1 - theta))

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """This replica's message: [bitmap of kept components | their real, imaginary parts]."""
        spectrum = torch.fft.rfft(flat.float(), n=transform_length(flat.numel()))
        k = kept_count(spectrum.numel(), self.theta)
        kept = spectrum.abs().topk(k, sorted=False).indices.sort().values
        mask = torch.zeros(spectrum.numel(), dtype=torch.uint8, device=flat.device)
        mask[kept] = 1
        parts = torch.view_as_real(spectrum[kept]).reshape(-1)
        return torch.cat([pack(mask.view(1, -1), 1).view(-1), self._encode_values(parts)])

    def _encode_values(self, parts: torch.Tensor) -> torch.Tensor:
        """A flag byte (0: fp32 follows, 1: N-bit codes follow) and the values."""
        calibrating = self.bits != 32 and self.format is None
        if calibrating:
            self.calibration.append(float(parts.abs().max()))
            if len(self.calibration) == CALIBRATION:  # the range is known from the next message on
                self.format, sent = agreed_offset_float(self.bits, parts, max(self.calibration), self.dp)
                self.bytes_sent += sent
        if self.bits == 32 or calibrating:
            flag = torch.zeros(1, dtype=torch.uint8, device=parts.device)
            return torch.cat([flag, parts.float().contiguous().view(torch.uint8)])
        flag = torch.ones(1, dtype=torch.uint8, device=parts.device)
        assert self.format is not None  # agreed during calibration
        return torch.cat([flag, _pack_wide(self.format.encode(parts), self.bits)])

    def decode_spectrum(self, payload: torch.Tensor, length: int) -> torch.Tensor:
        """The (sparse) spectrum a replica's message stands for, for a gradient of `length` values."""
        bins = transform_length(length) // 2 + 1
        k = kept_count(bins, self.theta)
        mask_bytes = packed_bytes(bins, 1)
        mask = unpack(payload[:mask_bytes].view(1, -1), 1, bins).view(-1).bool()
        if int(mask.sum()) != k:
            raise ValueError(f"an fft message marks {int(mask.sum())} components, expected {k}")
        quantized, body = int(payload[mask_bytes]), payload[mask_bytes + 1 :]
        if quantized:
            assert self.format is not None  # a quantized message comes after calibration
            parts = self.format.decode(_unpack_wide(body, self.bits, 2 * k))
        else:
            parts = body.clone().view(torch.float32)  # clone: the body starts at an odd offset
        spectrum = torch.zeros(bins, dtype=torch.complex64, device=payload.device)
        spectrum[mask] = torch.view_as_complex(parts.view(-1, 2).contiguous())
        return spectrum

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        payloads, sent = all_gather_bytes_payloads(self.dp, self.encode(flat))
        self.bytes_sent += sent
        total = self.decode_spectrum(payloads[0], flat.numel())
        for payload in payloads[1:]:  # (one replica's spectrum at a time beside the sum)
            total = total + self.decode_spectrum(payload, flat.numel())
        return inverse(total / len(payloads), flat.numel())

    def state_dict(self) -> dict:
        fmt = self.format
        return dict(super().state_dict(), calibration=list(self.calibration),
                    format=None if fmt is None else [fmt.bits, fmt.mantissa, fmt.max_value])

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.calibration = [float(x) for x in state.get("calibration", [])]
        fmt = state.get("format")
        self.format = None if fmt is None else OffsetFloat(int(fmt[0]), int(fmt[1]), float(fmt[2]))


def _pack_wide(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """N-bit codes (N ≤ 16) packed as a low byte stream (8 bits) and a high stream (N−8 bits) when N > 8."""
    codes = codes.to(torch.int64).view(1, -1)
    if bits <= 8:
        return pack(codes.to(torch.uint8), bits).view(-1)
    low = pack((codes & 0xFF).to(torch.uint8), 8).view(-1)
    high = pack((codes >> 8).to(torch.uint8), bits - 8).view(-1)
    return torch.cat([low, high])


def _unpack_wide(payload: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    if bits <= 8:
        return unpack(payload.view(1, -1), bits, n).view(-1).long()
    low = unpack(payload[:n].view(1, -1), 8, n).view(-1).long()
    high = unpack(payload[n:].view(1, -1), bits - 8, n).view(-1).long()
    return low | (high << 8)
