"""DirectQ's rows: a tensor quantized to B bits, per sample (the link codec is `sample_coders.QuantCoder` in a
`CoderCodec`; the message store encodes its low-bit values with these functions too).

Payload: for each sample in order, its fp16 scales then its packed codes — a sample's bytes depend on that
sample alone.
"""

from __future__ import annotations

import torch

from aqpipe.compress.bitpack import pack, packed_bytes, unpack
from aqpipe.compress.link.base import bytes_as, numel
from aqpipe.compress.quantize import DEFAULT_GRID, Quantized, dequantize, scale_count


def sample_bytes(shape: tuple[int, ...], bits: int, per: str) -> int:
    """Bytes one sample of a [B, ...] tensor takes quantized: fp16 scales plus packed codes."""
    return 2 * scale_count(shape, per) + packed_bytes(numel(shape[1:]), bits)


def join_rows(scales: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[B, fp16 scales | packed codes] bytes: the row layout of every quantizing sample coder (DirectQ, RTQ)."""
    return torch.cat([scales.contiguous().view(torch.uint8), pack(codes, bits)], dim=1)


def split_rows(rows: torch.Tensor, scales: int, codes: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `join_rows`: each row's `scales` fp16 scales and `codes` codes of `bits` bits."""
    return bytes_as(rows[:, : 2 * scales], torch.float16), unpack(rows[:, 2 * scales :], bits, codes)


def encode_samples(q: Quantized) -> torch.Tensor:
    """[B, scales | codes] bytes of a quantized batch."""
    return join_rows(q.scales, q.codes, q.bits)


def decode_samples(rows: torch.Tensor, shape: tuple[int, ...], bits: int, per: str, grid: str = DEFAULT_GRID
                   ) -> torch.Tensor:
    """Inverse of `encode_samples` for rows [B, sample_bytes] of a tensor of `shape` quantized on `grid`."""
    scales, codes = split_rows(rows, scale_count(shape, per), numel(shape[1:]), bits)
    return dequantize(Quantized(codes, scales, bits, per, grid), shape)
