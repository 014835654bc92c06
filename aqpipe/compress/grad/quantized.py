"""`--grad-sync ef:B`: B-bit quantized gradients with error feedback, all-gathered and averaged on arrival.

The compensated gradient is cut into chunks of CHUNK values, each quantized to 2**B levels against its own fp16
max-abs scale (aqpipe's activation quantizer), packed, and all-gathered; every replica dequantizes every
replica's message and averages. What quantization lost stays in the error-feedback memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aqpipe.compress.bitpack import pack, packed_bytes, unpack
from aqpipe.compress.grad.base import DPGroup
from aqpipe.compress.grad.feedback import FeedbackCompressor
from aqpipe.compress.grad.gather import all_gather_bytes_payloads
from aqpipe.compress.grad.methods import GradSpec
from aqpipe.compress.grad.wire import QUANTIZED_CHUNK as CHUNK
from aqpipe.compress.grad.wire import SyncBytes, gathered_message_bytes, quantized_bytes
from aqpipe.compress.quantize import Quantized, dequantize, quantize


def encode(flat: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload bytes, the values the payload decodes to) of a flat fp32 vector at `bits` bits."""
    rows = -(-flat.numel() // CHUNK)
    padded = torch.zeros(rows * CHUNK, device=flat.device)
    padded[: flat.numel()] = flat
    q = quantize(padded.view(rows, CHUNK), bits, "channel")
    payload = torch.cat([q.scales.reshape(-1).view(torch.uint8), pack(q.codes, bits).reshape(-1)])
    return payload, dequantize(q, (rows, CHUNK)).view(-1)[: flat.numel()]


def decode(payload: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of `encode` for a vector of `numel` values."""
    rows = -(-numel // CHUNK)
    scales = payload[: 2 * rows].view(torch.float16).view(rows, 1)
    codes = unpack(payload[2 * rows :].view(rows, packed_bytes(CHUNK, bits)), bits, CHUNK)
    return dequantize(Quantized(codes, scales, bits, "channel"), (rows, CHUNK)).view(-1)[:numel]


class ErrorFeedbackQuantized(FeedbackCompressor):
    """EF + B-bit quantization; all-gather pattern (quantized codes cannot be summed on the wire)."""

    pattern = "all-gather"
    kept_copies, peak_copies = 1.0, 8.6

    def __init__(self, dp: DPGroup, bits: int) -> None:
        super().__init__(dp)
        self.bits = bits
        self.name = f"ef:{bits}"

    @classmethod
    def step_bytes(cls, spec: GradSpec, dp: int, shapes: Sequence[tuple[int, ...]], freeze_after: int) -> SyncBytes:
        values = sum(math.prod(shape) for shape in shapes)
        return SyncBytes.every_step(gathered_message_bytes(quantized_bytes(values, spec.args[0]), dp))

    @classmethod
    def memory_copies(cls, spec: GradSpec, dp: int) -> tuple[float, float]:
        """Its residual, and every replica's B-bit message on top of the peak."""
        if dp < 2:
            return 0.0, 0.0
        return cls.kept_copies, cls.peak_copies + dp * spec.args[0] / 32

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        compensated = self.feedback.compensate(flat)
        payload, transmitted = encode(compensated, self.bits)
        self.feedback.update(compensated, transmitted)
        payloads, sent = all_gather_bytes_payloads(self.dp, payload)
        self.bytes_sent += sent
        # summed as each replica's message decodes, in replica order (not stacked: 2·dp copies of the gradient)
        total = decode(payloads[0], flat.numel(), self.bits)
        for other in payloads[1:]:
            total.add_(decode(other, flat.numel(), self.bits))
        return total.div_(len(payloads))

