"""DirectQ: quantize the tensor itself to B bits (the baseline AQ-SGD improves on; also used for gradients).

Payload: for each sample in order, its fp16 scales then its packed codes — a sample's bytes depend on that
sample alone.
"""

from __future__ import annotations

import torch

from aqpipe.compress.bitpack import pack, packed_bytes, unpack
from aqpipe.compress.link.codecs import (
    CODE_DIRECTQ,
    HOST,
    Encoded,
    LinkCodec,
    QuantOptions,
    bytes_as,
    generator_on,
    numel,
    to_host,
)
from aqpipe.compress.quantize import DEFAULT_GRID, Quantized, dequantize, quantize, scale_count


def sample_bytes(shape: tuple[int, ...], bits: int, per: str) -> int:
    """Bytes one sample of a [B, ...] tensor takes quantized: fp16 scales plus packed codes."""
    return 2 * scale_count(shape, per) + packed_bytes(numel(shape[1:]), bits)


def encode_samples(q: Quantized) -> torch.Tensor:
    """[B, scales | codes] bytes of a quantized batch."""
    return torch.cat([q.scales.contiguous().view(torch.uint8), pack(q.codes, q.bits)], dim=1)


def decode_samples(rows: torch.Tensor, shape: tuple[int, ...], bits: int, per: str, grid: str = DEFAULT_GRID
                   ) -> torch.Tensor:
    """Inverse of `encode_samples` for rows [B, sample_bytes] of a tensor of `shape` quantized on `grid`."""
    s = scale_count(shape, per)
    scales = bytes_as(rows[:, : 2 * s], torch.float16)
    codes = unpack(rows[:, 2 * s :], bits, numel(shape[1:]))
    return dequantize(Quantized(codes, scales, bits, per, grid), shape)


class DirectQCodec(LinkCodec):
    """B-bit quantization of the tensor itself, per-sample scales."""

    code = CODE_DIRECTQ

    def __init__(self, bits: int, options: QuantOptions, device: torch.device = HOST) -> None:
        self.bits, self.options, self.device = bits, options, device
        self.name = f"directq:{bits}"
        self._generator = generator_on(device, options.seed)

    def payload_bytes(self, header) -> int:
        return header.shape[0] * sample_bytes(header.shape, self.bits, self.options.per)

    def _encode(self, tensor: torch.Tensor, ids: torch.Tensor) -> Encoded:
        x = tensor.float()
        q = quantize(x, self.bits, self.options.per, self.options.stochastic, self._generator, self.options.grid)
        return Encoded(to_host(encode_samples(q).reshape(-1)), tuple(x.shape), torch.uint8, flags=self.flags())

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = payload.view(header.shape[0], -1)
        return decode_samples(rows, header.shape, self.bits, self.options.per, self.options.grid)
