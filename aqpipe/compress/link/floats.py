"""The float codecs (`fp32`, `fp16`, `bf16`): the tensor cast to a float type, nothing kept between messages."""

from __future__ import annotations

from typing import Any

import torch

from aqpipe.compress.link.base import CodecParts, Encoded, LinkCodec, numel, owned
from aqpipe.compress.link.codes import FLOAT_CODECS, LOSSLESS_DTYPES
from aqpipe.compress.link.specs import CodecError, CodecSpec


class FloatCodec(LinkCodec):
    """Sends the tensor cast to a float type: fp16 and bf16 halve the bytes; fp32 is lossless and sends a bf16 or
    fp16 tensor (a mixed-precision stage's activation) in its own dtype."""

    def __init__(self, name: str, wire_dtype: torch.dtype, code: int) -> None:
        self.name, self.wire_dtype, self.code = name, wire_dtype, code

    @classmethod
    def from_spec(cls, spec: CodecSpec, parts: CodecParts) -> FloatCodec:
        return cls(spec.kind, *FLOAT_CODECS[spec.kind])

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor of `dtype` goes on the wire as."""
        return dtype if self.wire_dtype == torch.float32 and dtype in LOSSLESS_DTYPES else self.wire_dtype

    def _payload_problem(self, header) -> str | None:
        if header.dtype != self._wire(header.dtype):
            return f"{self.name} payload announced as {header.dtype}"
        return super()._payload_problem(header)

    def payload_bytes(self, header) -> int:
        return numel(header.shape) * self._wire(header.dtype).itemsize

    def _encode(self, tensor: torch.Tensor, ids: torch.Tensor) -> Encoded:
        wire = owned(tensor.to(self._wire(tensor.dtype)).contiguous(), tensor)
        return Encoded.of(wire.view(torch.uint8).reshape(-1), tuple(wire.shape), wire.dtype, flags=self.flags())

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor, layout: Any = None) -> torch.Tensor:
        if header.dtype != self._wire(header.dtype):
            raise CodecError(f"{self.name} payload arrived as {header.dtype}")
        value = payload.view(header.dtype).reshape(header.shape)
        return value if self.wire_dtype == torch.float32 else value.to(torch.float32)
