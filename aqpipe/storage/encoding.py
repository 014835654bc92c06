"""How one m(ξ) value is laid out on disk: fp32, fp16, bf16, or quantized to 8/4/2 bits (the paper's "m in z bits").

A quantized m(ξ) is encoded with round-to-nearest on the default grid, so the same m gives the same bytes on both
sides of a link and both sides read back the same values. `canonical` is what a value becomes once stored: a store
serves exactly that, before and after it reaches the disk.
"""

from __future__ import annotations

import torch

from aqpipe.compress.link.directq import decode_samples, encode_samples
from aqpipe.compress.quantize import FP16_MAX, quantize
from aqpipe.storage.dtypes import STORE_DTYPES

FLOAT_ENCODINGS = {name: getattr(torch, d.float_name) for name, d in STORE_DTYPES.items() if not d.bits}


def value_dtype(encoding: str) -> torch.dtype:
    """The dtype a codec keeps m(ξ) in before the store encodes it (float32 for the quantized encodings)."""
    return getattr(torch, STORE_DTYPES[encoding].float_name)


def bits_of(encoding: str) -> int:
    return STORE_DTYPES[encoding].bits


def storable_rows(values: torch.Tensor, encoding: str | None = None) -> torch.Tensor:
    """Whether each row of a batch [B, ...] (already in `value_dtype`) survives the encoding — every element finite
    in the store dtype and, for the quantized encodings, within the fp16 range of their scales — as a bool tensor [B]
    on the values' device (nothing is read, so a GPU is not waited for); `encoding` None: finite is enough."""
    flat = values.reshape(values.shape[0], -1)
    if not flat.is_floating_point():
        return torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
    # one bound for both: NaN fails any comparison and ±inf exceeds the largest finite value (three kernels, where
    # isfinite alone takes four on a GPU)
    bound = torch.finfo(flat.dtype).max
    if encoding is not None and encoding not in FLOAT_ENCODINGS:
        bound = min(bound, FP16_MAX)
    return (flat.abs() <= bound).all(dim=1)


def encode_value(value: torch.Tensor, encoding: str):
    """The raw (uncompressed) bytes of one m(ξ), as a buffer (no copy for the float encodings)."""
    if encoding in FLOAT_ENCODINGS:
        return value.to(FLOAT_ENCODINGS[encoding]).contiguous().view(torch.uint8).reshape(-1).numpy()
    batch = value.float().unsqueeze(0)
    return encode_samples(quantize(batch, bits_of(encoding), "channel")).reshape(-1).numpy()


def decode_value(raw, encoding: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `encode_value`: a tensor of `shape` in `value_dtype(encoding)`."""
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if encoding in FLOAT_ENCODINGS:
        return data.view(FLOAT_ENCODINGS[encoding]).view(shape)
    return decode_samples(data.view(1, -1), (1, *shape), bits_of(encoding), "channel")[0]
