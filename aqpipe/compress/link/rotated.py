"""RTQ: rotated tile quantization of the tensor itself (`aqpipe.compress.rotated`), for activations or gradients.

Payload: for each sample in order, its fp16 scales (one per tile of each token) then its packed codes — a sample's
bytes depend on that sample alone. At 64-channel tiles a value costs B + 0.25 bits.
"""

from __future__ import annotations

import torch

from aqpipe.compress.bitpack import pack, packed_bytes, unpack
from aqpipe.compress.grids import DEFAULT_GRID
from aqpipe.compress.link.codecs import CODE_RTQ, HOST, Encoded, LinkCodec, QuantOptions, bytes_as, generator_on, numel, to_host
from aqpipe.compress.rotated import DEFAULT_TILE, RotatedQuantized, rotated_dequantize, rotated_quantize, scales_per_sample


def rtq_sample_bytes(shape: tuple[int, ...], bits: int, tile: int = DEFAULT_TILE) -> int:
    """Bytes one sample of a [B, ...] tensor takes: fp16 tile scales plus packed codes."""
    return 2 * scales_per_sample(shape, tile) + packed_bytes(numel(shape[1:]), bits)


def rtq_encode_samples(q: RotatedQuantized) -> torch.Tensor:
    """[B, scales | codes] bytes of a rotated, quantized batch."""
    return torch.cat([q.scales.contiguous().view(torch.uint8), pack(q.codes, q.bits)], dim=1)


def rtq_decode_samples(rows: torch.Tensor, shape: tuple[int, ...], bits: int, tile: int = DEFAULT_TILE,
                       grid: str = DEFAULT_GRID) -> torch.Tensor:
    """Inverse of `rtq_encode_samples` for rows [B, rtq_sample_bytes] of a tensor of `shape`."""
    s = scales_per_sample(shape, tile)
    scales = bytes_as(rows[:, : 2 * s], torch.float16)
    codes = unpack(rows[:, 2 * s :], bits, numel(shape[1:]))
    return rotated_dequantize(RotatedQuantized(codes, scales, bits, tile, grid), shape)


class RotatedCodec(LinkCodec):
    """B-bit rotated tile quantization, one fp16 scale per tile of each token."""

    code = CODE_RTQ

    def __init__(self, bits: int, options: QuantOptions, device: torch.device = HOST, tile: int = DEFAULT_TILE) -> None:
        self.bits, self.options, self.device, self.tile = bits, options, device, tile
        self.name = f"rtq:{bits}"
        self._generator = generator_on(device, options.seed)

    def payload_bytes(self, header) -> int:
        return header.shape[0] * rtq_sample_bytes(header.shape, self.bits, self.tile)

    def _encode(self, tensor: torch.Tensor, ids: torch.Tensor) -> Encoded:
        x = tensor.float()
        q = rotated_quantize(x, self.bits, self.tile, self.options.stochastic, self._generator, self.options.grid)
        return Encoded(to_host(rtq_encode_samples(q).reshape(-1)), tuple(x.shape), torch.uint8, flags=self.flags())

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = payload.view(header.shape[0], -1)
        return rtq_decode_samples(rows, header.shape, self.bits, self.tile, self.options.grid)
