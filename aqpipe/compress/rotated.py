"""Rotated tile quantization: a block Hadamard rotation along the hidden dimension, then b bits per value with one
fp16 scale per tile of one token.

A transformer's activations (and their gradients) carry a few outlier channels; a scale shared with them wastes
most of a group's levels on values near zero. Rotating each tile of `tile` channels by the orthonormal Hadamard
matrix H/√n spreads an outlier over the whole tile (QuaRot, QuIP#, TAH-Quant), so one scale per (token, tile) fits
the tile's values well. The hidden size need not be a multiple of the tile: the channels that remain after the
whole tiles are split into power-of-two pieces (576 = 9·64; 100 = 64 + 32 + 4), each a tile of its own.

Reconstruction is bit-identical on every device. A code k stands for the level (k − offset)/steps of the grid
(`aqpipe.compress.quantize`), and H's first column is all ones while its others sum to zero, so a tile comes back as
(k·H − offset·n·e₀) — small integers, held exactly in fp32 whatever order a BLAS or GPU kernel sums them in — times
one fp32 factor per tile, scale / (steps · √n). Both ends of an AQ-SGD link therefore derive the same m(ξ) from the
same bytes. Only the sender's forward rotation (a plain matmul) may differ across devices, and it never has to
agree with anything.

Codes [B, tokens·C] and scales [B, tokens·tiles] are per sample, so a sample's bytes never depend on the other
samples of its batch. A tile's scale is an fp16 of its largest rotated value, which is at most √tile times the
tile's largest |x| (a tile of equal magnitudes) and as little as 1/√tile of it (one massive channel); a scale that
would pass 65504 is clamped there and its tile clips, and AQ-SGD sends such a sample losslessly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from aqpipe.compress.grids import DEFAULT_GRID
from aqpipe.compress.quantize import _offset_steps, as_rows, check_grid, quantize

DEFAULT_TILE = 64
# The grid of the rtq codecs, whatever --quant-grid says: a rotated tile is symmetric about 0 (one massive channel
# becomes ±1/√tile of itself in every position), where `signed` clips its short side's last 1/2^(b-1) — for a 4-bit
# tile holding a massive activation of 30000, an error of 1878 on it and on an ordinary channel of its tile, against
# 44 on `fit`, which covers both sides; on Gaussian tiles `fit` costs 3% more squared error (benchmarks/README.md).
ROTATED_GRID = "fit"
_hadamards: dict[tuple[int, str, bool], torch.Tensor] = {}


def hadamard(n: int, device: torch.device | str = "cpu", normalized: bool = False) -> torch.Tensor:
    """The n×n Sylvester Hadamard matrix of ±1 (n a power of two), fp32, or with `normalized` the orthonormal
    H/√n; cached per size and device."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard tile is a power of two, got {n}")
    key = (n, str(device), normalized)
    if key not in _hadamards:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
        _hadamards[key] = (h / math.sqrt(n) if normalized else h).to(device)
    return _hadamards[key]


def tile_pieces(width: int, tile: int = DEFAULT_TILE) -> list[tuple[int, int]]:
    """How `width` channels split into tiles: (tile size, count) pieces in channel order — whole tiles, then the
    rest as power-of-two tiles, largest first."""
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"the rotation tile must be a power of two, got {tile}")
    if width < 1:
        raise ValueError(f"cannot tile {width} channels")
    whole, rest = divmod(width, tile)
    pieces = [(tile, whole)] if whole else []
    while rest:
        size = 1 << (rest.bit_length() - 1)
        pieces.append((size, 1))
        rest -= size
    return pieces


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """View [B, ..., C] as [B, T, C] (a 2-D [B, C] is one token per sample)."""
    if x.dim() == 2:
        return x.reshape(x.shape[0], 1, x.shape[1])
    return as_rows(x)


def scales_per_sample(shape: tuple[int, ...], tile: int = DEFAULT_TILE) -> int:
    """fp16 scales one sample of a tensor of `shape` [B, ..., C] takes: one per tile of each token."""
    rows = token_rows(torch.empty(shape, device="meta"))
    return rows.shape[1] * sum(count for _, count in tile_pieces(rows.shape[2], tile))


@dataclass
class RotatedQuantized:
    """Codes [B, tokens·C] (uint8, channel order within each token's pieces) and fp16 scales [B, tokens·tiles]."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    tile: int = DEFAULT_TILE
    grid: str = DEFAULT_GRID


def _pieces_of(rows: torch.Tensor, tile: int) -> list[tuple[int, torch.Tensor]]:
    """[B, T, C] → (tile size, [B, T·count, size]) per piece, in channel order."""
    b, t, _ = rows.shape
    out, start = [], 0
    for size, count in tile_pieces(rows.shape[2], tile):
        out.append((size, rows[:, :, start:start + size * count].reshape(b, t * count, size)))
        start += size * count
    return out


def rotated_quantize(x: torch.Tensor, bits: int, tile: int = DEFAULT_TILE, stochastic: bool = False,
                     generator: torch.Generator | None = None, grid: str = DEFAULT_GRID) -> RotatedQuantized:
    """Rotate each tile of `x` [B, ..., C] along C, then quantize it to `bits` bits with one fp16 scale per tile
    (nearest or stochastic rounding, on `grid`), on x's device."""
    check_grid(grid)
    rows = token_rows(x.detach().float())
    b = rows.shape[0]
    codes, scales = [], []
    for size, piece in _pieces_of(rows, tile):
        rotated = piece @ hadamard(size, piece.device, normalized=True) if size > 1 else piece
        q = quantize(rotated, bits, "token", stochastic, generator, grid)
        codes.append(q.codes.view(b, piece.shape[1], size))
        scales.append(q.scales.view(b, piece.shape[1]))
    if len(codes) == 1:
        return RotatedQuantized(codes[0].reshape(b, -1), scales[0], bits, tile, grid)
    t = rows.shape[1]  # each token's pieces side by side, as its channels were
    joined = torch.cat([c.view(b, t, -1) for c in codes], dim=2).reshape(b, -1)
    return RotatedQuantized(joined, torch.cat([s.view(b, t, -1) for s in scales], dim=2).reshape(b, -1), bits, tile,
                            grid)


def rotated_dequantize(q: RotatedQuantized, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of `shape` that `q` stands for, bit-identical on every device (see the module's
    docstring)."""
    view = token_rows(torch.empty(shape, device="meta"))
    b, t, c = view.shape
    offset, steps, _ = _offset_steps(q.bits, q.grid)
    codes = q.codes.view(b, t, c)
    scales = q.scales.view(b, t, -1)
    parts = []
    start, first_tile = 0, 0
    for size, count in tile_pieces(c, q.tile):
        width = size * count
        # exact: codes (< 256) times ±1, summed in any order; the offset only moves the first column
        integers = codes[:, :, start:start + width].float().view(b, t, count, size) @ hadamard(size, codes.device)
        integers[..., 0] -= offset * size
        # one fp32 product per value with an fp32 reciprocal made on the host: the same rounding on every device (a
        # division by a host scalar is a multiply by its reciprocal on CUDA and a true division on the CPU)
        # (a 0-d host tensor: a GPU takes it as an fp32 kernel argument, with no copy to wait for)
        reciprocal = torch.tensor(1.0 / (steps * math.sqrt(size)), dtype=torch.float32)
        factor = scales[:, :, first_tile:first_tile + count].float().mul_(reciprocal)
        parts.append(integers.mul_(factor.unsqueeze(-1)).view(b, t, width))
        start, first_tile = start + width, first_tile + count
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)).view(shape)


NOT_SET_APART = 0xFFFF  # the channel `set_apart_largest` names for a token whose largest value it left in place


def set_apart_largest(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's largest-magnitude value of `x` [B, ..., C] (C < 65535), set apart: (x with it zeroed, as
    [B, T, C]; its channel [B, T] int64 — the first such channel on a tie; its value [B, T] in fp16). A massive
    activation (the attention sink's, thousands of times its token's other values) then travels exact to fp16, and
    the rest of its tile is rotated and quantized at a scale of its own size instead of the massive value's. A value
    fp16 cannot hold (beyond 65504, an inf or a NaN) stays in place, as rtq would carry it: its channel reads
    `NOT_SET_APART` and its value 0."""
    rows = token_rows(x.detach().float())
    channels = rows.abs().argmax(dim=2, keepdim=True)
    value = torch.gather(rows, 2, channels)
    half = value.to(torch.float16)
    apart = half.isfinite()
    rest = rows.scatter(2, channels, torch.where(apart, 0.0, value))
    return (rest, torch.where(apart, channels, NOT_SET_APART).squeeze(2),
            torch.where(apart, half, 0.0).squeeze(2))


def put_back_largest(values: torch.Tensor, channels: torch.Tensor, largest: torch.Tensor, shape: tuple[int, ...]
                     ) -> torch.Tensor:
    """Inverse of `set_apart_largest` on reconstructed `values` of `shape`: each token's set-apart value, as fp32,
    written over its channel (copies only: the same bits on every device)."""
    rows = token_rows(values.reshape(shape))
    apart = (channels != NOT_SET_APART).unsqueeze(2)
    at = torch.where(apart, channels.unsqueeze(2), 0)
    return rows.scatter(2, at, torch.where(apart, largest.float().unsqueeze(2), torch.gather(rows, 2, at))).view(shape)
