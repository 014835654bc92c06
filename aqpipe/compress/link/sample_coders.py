"""Sample coders: how a batch becomes one byte row per sample and back — the parts link codecs are made of.

A coder's `encode` gives the rows and, asked for them, the values they stand for (what the receiver's `decode` will
rebuild, bit for bit, on any device), so AQ-SGD can update m(ξ) from exactly what travels without unpacking its own
bytes. A sample's row depends on that sample alone. `CoderCodec` makes a stateless link codec of a coder (DirectQ,
RTQ). AQ-SGD takes two coders as parts: one for the change of a sample it has seen (`QuantCoder`, or
`RotatedCoder`), one for the first sight of a sample it has not (`--first-sight`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from aqpipe.compress.bitpack import pack, packed_bytes, unpack
from aqpipe.compress.gpu import fused
from aqpipe.compress.gpu.copies import HOST
from aqpipe.compress.gpu.cuda_graphs import graphed
from aqpipe.compress.gpu.graph_memory import GraphCall, stand_in
from aqpipe.compress.link.base import CodecParts, Encoded, LinkCodec, bytes_as, generator_on, numel
from aqpipe.compress.link.codes import CODE_DIRECTQ, CODE_RTQ, CODE_RTQO, FLOAT_CODECS
from aqpipe.compress.link.directq import decode_samples, encode_samples, join_rows, sample_bytes, split_rows
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CodecError, CodecSpec
from aqpipe.compress.quantize import FP16_MAX, dequantize, quantize, scale_count
from aqpipe.compress.rotated import (
    DEFAULT_TILE,
    NOT_SET_APART,
    ROTATED_GRID,
    RotatedQuantized,
    put_back_largest,
    rotated_dequantize,
    rotated_quantize,
    scales_per_sample,
    set_apart_largest,
    token_rows,
)


class SampleCoder(Protocol):
    """Turns a float32 batch [B, ...] into rows [B, sample_bytes] of uint8 and back."""

    @property
    def name(self) -> str: ...

    def carried(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Per sample of `x` (bool [B], on its device, nothing read): whether `rows`, its coding, carry it without
        clipping a value to the coder's range."""
        ...

    def sample_bytes(self, shape: tuple[int, ...]) -> int: ...

    def encode(self, x: torch.Tensor, values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def decode(self, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor: ...


@dataclass
class CastCoder:
    """The values cast to a float dtype (fp32: lossless)."""

    name: str
    dtype: torch.dtype

    def carried(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return (x.abs() <= torch.finfo(self.dtype).max).reshape(x.shape[0], -1).all(dim=1)

    def sample_bytes(self, shape: tuple[int, ...]) -> int:
        return numel(shape[1:]) * self.dtype.itemsize

    def encode(self, x: torch.Tensor, values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        wire = x.to(self.dtype).contiguous()
        return wire.view(torch.uint8).reshape(x.shape[0], -1), wire.float() if values else None

    def decode(self, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return bytes_as(rows, self.dtype).float().view(shape)


@dataclass
class QuantCoder:
    """B-bit quantization with per-sample scales (per channel or token) on a grid: DirectQ's rows, AQ-SGD's deltas."""

    bits: int
    options: QuantOptions
    generator: torch.Generator | None = None

    @property
    def name(self) -> str:
        return f"directq:{self.bits}"

    def carried(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return scales_in_range(rows, scale_count(tuple(x.shape), self.options.per))

    def sample_bytes(self, shape: tuple[int, ...]) -> int:
        return sample_bytes(shape, self.bits, self.options.per)

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why this coder cannot code a batch of `shape` (None: it can)."""
        return None

    @property
    def graph_key(self) -> tuple[Any, ...]:
        """What its coding reads besides its bits (its CUDA graphs are named by it)."""
        return (self.options.per, self.options.grid)

    def encode(self, x: torch.Tensor, values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _replayed_encode(self, x, values)

    def _encode(self, x: torch.Tensor, values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        opts = self.options
        if fused.encodable(x, self.bits, opts.per, opts.stochastic, opts.grid):  # the same bytes, in two kernels
            if (coded := fused.encode(x, self.bits, opts.grid, values)) is not None:
                return coded
        q = quantize(x, self.bits, opts.per, opts.stochastic, self.generator, opts.grid)
        return encode_samples(q), dequantize(q, tuple(x.shape)) if values else None

    def decode(self, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return _replayed_decode(self, rows, shape)

    def _decode(self, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if fused.fusable(rows.device, shape, self.bits, self.options.per, self.options.grid):
            if (values := fused.decode(rows, shape, self.bits, self.options.grid)) is not None:
                return values
        return decode_samples(rows, shape, self.bits, self.options.per, self.options.grid)


@dataclass
class RotatedCoder:
    """B-bit rotated tile quantization (`aqpipe.compress.rotated`) on its own grid (`ROTATED_GRID`): fp16 tile
    scales, then packed codes."""

    bits: int
    options: QuantOptions
    generator: torch.Generator | None = None
    tile: int = DEFAULT_TILE

    @property
    def name(self) -> str:
        return f"rtq:{self.bits}"

    def carried(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # the scales of the rotated tiles decide, not a bound on x: a rotated value reaches √tile times its tile's
        # largest only for a tile of equal magnitudes; one massive channel spreads as 1/√tile of itself
        return scales_in_range(rows, scales_per_sample(tuple(x.shape), self.tile))

    def sample_bytes(self, shape: tuple[int, ...]) -> int:
        return 2 * scales_per_sample(shape, self.tile) + packed_bytes(numel(shape[1:]), self.bits)

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why this coder cannot code a batch of `shape` (None: it can)."""
        return None

    @property
    def graph_key(self) -> tuple[Any, ...]:
        """What its coding reads besides its bits (its CUDA graphs are named by it)."""
        return (self.tile,)

    def encode(self, x: torch.Tensor, values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _replayed_encode(self, x, values)

    def _encode(self, x: torch.Tensor, values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        q = rotated_quantize(x, self.bits, self.tile, self.options.stochastic, self.generator, ROTATED_GRID)
        return join_rows(q.scales, q.codes, q.bits), rotated_dequantize(q, tuple(x.shape)) if values else None

    def decode(self, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return _replayed_decode(self, rows, shape)

    def _decode(self, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        scales, codes = split_rows(rows, scales_per_sample(shape, self.tile), numel(shape[1:]), self.bits)
        return rotated_dequantize(RotatedQuantized(codes, scales, self.bits, self.tile, ROTATED_GRID), shape)


@dataclass
class OutlierRotatedCoder(RotatedCoder):
    """`RotatedCoder` with each token's largest-magnitude value set apart (`set_apart_largest`): fp16 tile scales,
    then each token's set-apart value (fp16) and channel (16 bits; `NOT_SET_APART` for a value beyond fp16, which
    stays in its tile as rtq carries it), then the packed codes of the rest. 4 bytes a token (0.056 bits a value at
    SmolLM2's 576 channels) keep a massive activation exact to fp16 and let the rest of its tile, rotated without it,
    be quantized at its own scale: on SmolLM2-135M's hidden states after 20 layers, a 13×
    lower squared error than rtq:4 alone (benchmarks/first_sight_mse.py)."""

    @property
    def name(self) -> str:
        return f"rtqo:{self.bits}"

    # (`carried` is rtq's: the scales come first, and a value fp16 cannot hold is never set apart)

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        if shape[-1] >= NOT_SET_APART:
            return f"{self.name} names a channel in 16 bits: fewer than {NOT_SET_APART} channels, got {shape[-1]}"
        return None

    def encode(self, x: torch.Tensor, values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if problem := self.shape_problem(tuple(x.shape)):  # (asked before any graph, which would fail to capture)
            raise CodecError(problem)
        return super().encode(x, values)

    def sample_bytes(self, shape: tuple[int, ...]) -> int:
        return super().sample_bytes(shape) + 4 * _tokens(shape)

    def _encode(self, x: torch.Tensor, values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        rest, channels, largest = set_apart_largest(x)
        q = rotated_quantize(rest, self.bits, self.tile, self.options.stochastic, self.generator, ROTATED_GRID)
        b = x.shape[0]
        rows = torch.cat([q.scales.contiguous().view(torch.uint8), largest.contiguous().view(torch.uint8),
                          channels.to(torch.int32).to(torch.int16).view(torch.uint8),  # (wraps past 32767: & 0xFFFF)
                          pack(q.codes, q.bits)], dim=1).reshape(b, -1)
        if not values:
            return rows, None
        return rows, put_back_largest(rotated_dequantize(q, tuple(x.shape)), channels, largest, tuple(x.shape))

    def _decode(self, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        t = _tokens(shape)
        scales = scales_per_sample(shape, self.tile)
        largest = bytes_as(rows[:, 2 * scales : 2 * (scales + t)], torch.float16)
        channels = bytes_as(rows[:, 2 * (scales + t) : 2 * (scales + 2 * t)], torch.int16).to(torch.int64) & 0xFFFF
        codes = unpack(rows[:, 2 * (scales + 2 * t) :], self.bits, numel(shape[1:]))
        q = RotatedQuantized(codes, bytes_as(rows[:, : 2 * scales], torch.float16), self.bits, self.tile,
                             ROTATED_GRID)
        return put_back_largest(rotated_dequantize(q, shape), channels, largest, shape)


def _tokens(shape: tuple[int, ...]) -> int:
    """Tokens per sample of a batch of `shape` (a 2-D [B, C] batch: one)."""
    return token_rows(torch.empty(shape, device="meta")).shape[1]


ReplayedCoder = QuantCoder | RotatedCoder  # the coders whose encode and decode replay CUDA graphs


def _encode_graph(coder: ReplayedCoder, values: bool) -> tuple[Hashable, Callable[..., tuple[torch.Tensor, ...]]]:
    """The key and function of the graph `coder.encode` replays: its rows (and, with `values`, its dequantized
    values), named by the coder's class, bits and `graph_key`."""
    def parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows, coded_values = coder._encode(t, values)
        return (rows,) if coded_values is None else (rows, coded_values)

    return (type(coder).__name__, "encode", coder.bits, *coder.graph_key, values), parts


def _decode_graph(coder: ReplayedCoder, shape: tuple[int, ...]
                  ) -> tuple[Hashable, Callable[..., tuple[torch.Tensor, ...]]]:
    """The key and function of the graph `coder.decode` replays for a batch of `shape`."""
    return (type(coder).__name__, "decode", coder.bits, *coder.graph_key, shape), lambda r: (coder._decode(r, shape),)


def _replayed_encode(coder: ReplayedCoder, x: torch.Tensor, values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`coder._encode(x, values)`, replayed from a CUDA graph on a GPU (`aqpipe.compress.gpu.cuda_graphs`) unless it
    rounds stochastically, whose random draws a replay would repeat."""
    if coder.options.stochastic:
        return coder._encode(x, values)
    key, parts = _encode_graph(coder, values)
    out = graphed(key, parts, x)
    return out[0], out[1] if values else None


def _replayed_decode(coder: ReplayedCoder, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`coder._decode(rows, shape)`, replayed from a CUDA graph on a GPU (decoding draws nothing)."""
    key, fn = _decode_graph(coder, shape)
    return graphed(key, fn, rows)[0]


def coder_calls(coder: SampleCoder, shape: tuple[int, ...], sending: bool) -> list[GraphCall]:
    """The graph a sample coder replays for a batch of `shape`: its encode of the float32 batch (sending; none where
    it rounds stochastically), or its decode of the batch's rows; none for a cast."""
    if not isinstance(coder, QuantCoder | RotatedCoder):
        return []
    if sending:
        if coder.options.stochastic:
            return []
        key, fn = _encode_graph(coder, False)
        return [GraphCall("encode", fn, (stand_in(shape, torch.float32),), key)]
    key, fn = _decode_graph(coder, shape)
    return [GraphCall("decode", fn, (stand_in((shape[0], coder.sample_bytes(shape)), torch.uint8),), key)]


def scales_in_range(rows: torch.Tensor, scales: int) -> torch.Tensor:
    """Per row of `join_rows` bytes with `scales` fp16 scales first: whether every scale lies below the fp16 maximum
    (a group whose scale reached it was clamped there, and its values clip; an inf or NaN fails too)."""
    return (bytes_as(rows[:, : 2 * scales], torch.float16).abs() < FP16_MAX).all(dim=1)  # (65504 is exact in fp16)


def batch_problem(header) -> str | None:
    """Why a header cannot hold a batch of samples, one id each (None if it can)."""
    if len(header.shape) < 2 or 0 in header.shape[1:]:
        return f"a batch of samples has a sample dimension and more, not shape {header.shape}"
    if header.shape[0] != header.n_ids:
        return f"{header.shape[0]} samples but {header.n_ids} sample ids"
    return None


class CoderCodec(LinkCodec):
    """A stateless link codec made of a sample coder: the payload is each sample's row, in order."""

    def __init__(self, code: int, coder: QuantCoder | RotatedCoder, options: QuantOptions,
                 device: torch.device = HOST) -> None:
        self.code, self.coder, self.bits, self.name, self.device = code, coder, coder.bits, coder.name, device
        self._generator = coder.generator = generator_on(device, options.seed)

    @classmethod
    def from_spec(cls, spec: CodecSpec, parts: CodecParts) -> CoderCodec:
        if spec.kind == "rtq":
            return cls(CODE_RTQ, RotatedCoder(spec.bits, parts.options), parts.options, parts.device)
        if spec.kind == "rtqo":
            return cls(CODE_RTQO, OutlierRotatedCoder(spec.bits, parts.options), parts.options, parts.device)
        return cls(CODE_DIRECTQ, QuantCoder(spec.bits, parts.options), parts.options, parts.device)

    def payload_bytes(self, header) -> int:
        return header.shape[0] * self.coder.sample_bytes(header.shape)

    def _payload_problem(self, header) -> str | None:
        return batch_problem(header) or self.coder.shape_problem(header.shape) or super()._payload_problem(header)

    def _encode(self, tensor: torch.Tensor, ids: torch.Tensor) -> Encoded:
        x = tensor.float()
        rows, _ = self.coder.encode(x)
        return Encoded.of(rows.reshape(-1), tuple(x.shape), torch.uint8, flags=self.flags())

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor, layout: Any = None) -> torch.Tensor:
        return self.coder.decode(payload.view(header.shape[0], -1), header.shape)

    def graph_calls(self, shape: tuple[int, ...], sending: bool, warmup: bool = False) -> list[GraphCall]:
        """The coder's encode of a float32 batch (sending), or its decode of the batch's rows (`coder_calls`)."""
        return coder_calls(self.coder, shape, sending)


def sample_coder(spec: CodecSpec, options: QuantOptions | None = None,
                 generator: torch.Generator | None = None) -> SampleCoder:
    """The coder a parsed --first-sight spec names (fp32, bf16, fp16, directq:B, rtq:B, rtqo:B; `check_first_sight`
    parses and checks one)."""
    options = options or QuantOptions()
    if spec.kind in FLOAT_CODECS:
        return CastCoder(spec.kind, FLOAT_CODECS[spec.kind][0])
    if spec.kind == "rtq":
        return RotatedCoder(spec.bits, options, generator)
    if spec.kind == "rtqo":
        return OutlierRotatedCoder(spec.bits, options, generator)
    return QuantCoder(spec.bits, options, generator)


def delta_coder(spec: CodecSpec, options: QuantOptions) -> SampleCoder:
    """The coder of a known sample's change under AQ-SGD spec `spec`: B-bit quantization with the options' scales,
    or rotated tiles (`aqsgd-rtq`)."""
    return RotatedCoder(spec.bits, options) if spec.kind == "aqsgd-rtq" else QuantCoder(spec.bits, options)
