"""How one m(ξ) value is laid out on disk: fp32, fp16, bf16, or quantized to 8/4/2 bits (the paper's "m in z bits").

A quantized m(ξ) is encoded with round-to-nearest, so the same m gives the same bytes on both sides of a link and
both sides read back the same values.
"""

from __future__ import annotations

import torch

from aqpipe.compress.directq import decode_samples, encode_samples
from aqpipe.compress.quantize import quantize

ENCODINGS = {"fp32": 1, "fp16": 2, "bf16": 3, "q8": 8, "q4": 4, "q2": 6}
FLOAT_ENCODINGS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def value_dtype(encoding: str) -> torch.dtype:
    """The dtype a codec keeps m(ξ) in before the store encodes it (float32 for the quantized encodings)."""
    return FLOAT_ENCODINGS.get(encoding, torch.float32)


def bits_of(encoding: str) -> int:
    return int(encoding[1:])


def encode_value(value: torch.Tensor, encoding: str):
    """The raw (uncompressed) bytes of one m(ξ), as a buffer (no copy for the float encodings)."""
    if encoding in FLOAT_ENCODINGS:
        return value.to(FLOAT_ENCODINGS[encoding]).contiguous().view(torch.uint8).reshape(-1).numpy()
    batch = value.float().unsqueeze(0)
    return encode_samples(quantize(batch, bits_of(encoding), "channel")).reshape(-1).numpy()


def decode_value(raw: bytes, encoding: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `encode_value`: a tensor of `shape` in `value_dtype(encoding)`."""
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if encoding in FLOAT_ENCODINGS:
        return data.view(FLOAT_ENCODINGS[encoding]).view(shape)
    return decode_samples(data.view(1, -1), (1, *shape), bits_of(encoding), "channel")[0]
