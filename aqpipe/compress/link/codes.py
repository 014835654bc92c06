"""What a message's header says of its codec: each codec's number, the flags, and the dtypes a lossless message
carries (`check_header` holds a received header against them before the payload is allocated)."""

from __future__ import annotations

import torch

FLAG_RAW = 1  # the payload is the tensor, lossless (LOSSLESS_DTYPES): warm-up, or a codec asked not to compress
FLAG_NO_CHECK = 2  # AQ-SGD: the sender did not checksum m(ξ)
FLAG_REAL_ROWS = 4  # the payload is a batch's real rows, in groups (`aqpipe.pipeline.links.real_rows`)
(CODE_FP32, CODE_FP16, CODE_BF16, CODE_DIRECTQ, CODE_AQSGD, CODE_TOPK, CODE_RTQ, CODE_TAHQ,
 CODE_AQSGD_RTQ, CODE_RTQO) = range(1, 11)
# The float codecs by name: the dtype they send and their header code.
FLOAT_CODECS = {"fp32": (torch.float32, CODE_FP32), "fp16": (torch.float16, CODE_FP16),
                "bf16": (torch.bfloat16, CODE_BF16)}
# What a lossless message (fp32 codec, or any codec's raw message) carries: the tensor in its own float dtype, so a
# bf16/fp16 activation of a mixed-precision stage crosses at its own size, bit for bit; anything else as fp32.
LOSSLESS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lossless_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a lossless message carries a tensor of `dtype` in (its own float dtype, else fp32)."""
    return dtype if dtype in LOSSLESS_DTYPES else torch.float32


def lossless(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in the dtype a lossless message carries it in."""
    return tensor.to(lossless_dtype(tensor.dtype))
