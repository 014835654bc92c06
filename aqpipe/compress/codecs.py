"""Link codecs: how one link encodes a tensor for the wire and decodes it on the other side.

`encode(tensor, ids) -> Encoded` and `decode(shape, wire_dtype, payload, ids) -> tensor`. The float codecs here are
stateless; compressed codecs (DirectQ, AQ-SGD, Top-k) plug into the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CodecError(ValueError):
    """A codec spec that cannot be parsed or built."""


@dataclass
class Encoded:
    """What a codec puts on the wire for one tensor."""

    payload: torch.Tensor  # flat uint8
    shape: tuple[int, ...]
    wire_dtype: torch.dtype
    codec_check: int = 0
    flags: int = 0


class FloatCodec:
    """Sends the tensor cast to a float type (fp32 is lossless; fp16 and bf16 halve the bytes)."""

    CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}

    def __init__(self, name: str, wire_dtype: torch.dtype) -> None:
        self.name, self.wire_dtype, self.code = name, wire_dtype, self.CODES[wire_dtype]

    def encode(self, tensor: torch.Tensor, ids: torch.Tensor) -> Encoded:
        """Cast and view as bytes."""
        wire = tensor.detach().to(self.wire_dtype).contiguous()
        return Encoded(wire.view(torch.uint8).reshape(-1), tuple(wire.shape), self.wire_dtype)

    def decode(
        self, shape: tuple[int, ...], wire_dtype: torch.dtype, payload: torch.Tensor, ids: torch.Tensor,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Bytes back to a tensor of `out_dtype`; the payload length must match the shape exactly."""
        if wire_dtype != self.wire_dtype or payload.numel() != self.payload_bytes(shape, wire_dtype):
            raise CodecError(
                f"{self.name} payload of {payload.numel()} bytes ({wire_dtype}) does not fit shape {shape}"
            )
        return payload.view(wire_dtype).reshape(shape).to(out_dtype)

    def payload_bytes(self, shape: tuple[int, ...], wire_dtype: torch.dtype) -> int:
        """The exact payload length for a tensor of `shape` sent as `wire_dtype` (checked before allocating)."""
        n = wire_dtype.itemsize
        for d in shape:
            n *= d
        return n


FLOAT_CODECS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_codec(spec: str) -> FloatCodec:
    """The codec for a `--fw`/`--bw` spec."""
    if spec in FLOAT_CODECS:
        return FloatCodec(spec, FLOAT_CODECS[spec])
    raise CodecError(f"unknown link codec {spec!r}")
