"""Top-k + quantization for activation gradients (the paper's split-learning "bw8[0.2]"): keep the largest-magnitude
fraction F of each sample's gradient, quantize the kept values to B bits with one fp16 scale per sample, and send
their positions as a bitmap or as narrow integer indices, whichever is smaller (both sides derive which from the
shape, so no byte says it).

Payload per sample: fp16 scale, positions, packed codes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from aqpipe.compress.bitpack import pack, packed_bytes, unpack
from aqpipe.compress.gpu.copies import HOST, to_device
from aqpipe.compress.link.base import CodecParts, Encoded, LinkCodec, bytes_as, generator_on, numel
from aqpipe.compress.link.codes import CODE_TOPK
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CodecError, CodecSpec
from aqpipe.compress.quantize import Quantized, dequantize, quantize


def kept(n: int, fraction: float) -> int:
    """How many of n entries a sample keeps."""
    return max(1, min(n, math.ceil(fraction * n)))


def position_format(n: int, k: int) -> tuple[str, int]:
    """("bitmap", bytes) or ("int16"/"int32", bytes): the smaller way to send k positions out of n."""
    index = "int16" if n <= 1 << 15 else "int32"
    index_bytes = k * (2 if index == "int16" else 4)
    bitmap_bytes = packed_bytes(n, 1)
    return ("bitmap", bitmap_bytes) if bitmap_bytes <= index_bytes else (index, index_bytes)


class TopKCodec(LinkCodec):
    """Per-sample top-k sparsification with B-bit values."""

    code = CODE_TOPK

    def __init__(self, fraction: float, bits: int, options: QuantOptions,
                 device: torch.device = HOST) -> None:
        self.fraction, self.bits, self.options, self.device = fraction, bits, options, device
        self.name = f"topk:{fraction:g}:{bits}"
        self._generator = generator_on(device, options.seed + 17)

    @classmethod
    def from_spec(cls, spec: CodecSpec, parts: CodecParts) -> TopKCodec:
        return cls(spec.fraction, spec.bits, parts.options, parts.device)

    def _layout(self, shape: tuple[int, ...]) -> tuple[int, int, str, int, int]:
        n = numel(shape[1:])
        k = kept(n, self.fraction)
        fmt, pos_bytes = position_format(n, k)
        return n, k, fmt, pos_bytes, 2 + pos_bytes + packed_bytes(k, self.bits)

    def payload_bytes(self, header) -> int:
        return header.shape[0] * self._layout(header.shape)[4]

    def _encode(self, tensor: torch.Tensor, ids: torch.Tensor) -> Encoded:
        g = tensor.float().reshape(tensor.shape[0], -1)
        b = g.shape[0]
        n, k, fmt, _, _ = self._layout(tuple(tensor.shape))
        idx = g.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        values = g.gather(1, idx)
        # "channel" scales of a [b, k] tensor: one scale per sample
        q = quantize(values, self.bits, "channel", self.options.stochastic, self._generator, self.options.grid)
        if fmt == "bitmap":
            mask = torch.zeros(b, n, dtype=torch.uint8, device=g.device)
            mask.scatter_(1, idx, 1)
            positions = pack(mask, 1)
        else:
            positions = idx.to(torch.int16 if fmt == "int16" else torch.int32).contiguous().view(torch.uint8)
        rows = torch.cat([q.scales.contiguous().view(torch.uint8), positions, pack(q.codes, self.bits)], dim=1)
        return Encoded.of(rows.reshape(-1), tuple(tensor.shape), torch.uint8, flags=self.flags())

    def _read_layout(self, header, payload: torch.Tensor) -> torch.Tensor:
        """The positions, read and checked on the host bytes: on a GPU, a bitmap's marks are found with `nonzero`,
        which would make the host wait for it on every message."""
        return self._checked_positions(header, payload)

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor, layout: Any = None) -> torch.Tensor:
        shape = header.shape
        b = shape[0]
        n, k, _, pos_bytes, _ = self._layout(shape)
        rows = payload.view(b, -1)
        scales = bytes_as(rows[:, :2], torch.float16)
        codes = unpack(rows[:, 2 + pos_bytes :], self.bits, k)
        values = dequantize(Quantized(codes, scales, self.bits, "channel", self.options.grid), (b, k))
        out = torch.zeros(b, n, dtype=torch.float32, device=rows.device)
        out.scatter_(1, to_device(layout, rows.device), values)
        return out.view(shape)

    def _checked_positions(self, header, payload: torch.Tensor) -> torch.Tensor:
        """The [b, k] positions of each sample's kept entries (a bitmap's marks, in order), where `payload` is; a
        CodecError if they cannot be a top-k of the header's shape."""
        b = header.shape[0]
        n, k, fmt, pos_bytes, _ = self._layout(header.shape)
        positions = payload.view(b, -1)[:, 2 : 2 + pos_bytes]
        if fmt == "bitmap":
            marks = unpack(positions.contiguous(), 1, n).bool()
            if not bool((marks.sum(dim=1) == k).all()):
                raise CodecError(f"topk bitmap does not mark exactly {k} positions per sample")
            return marks.nonzero()[:, 1].view(b, k)
        idx = bytes_as(positions, torch.int16 if fmt == "int16" else torch.int32).long()
        if not bool(((idx >= 0) & (idx < n)).all()):
            raise CodecError("topk positions fall outside the tensor")
        return idx
