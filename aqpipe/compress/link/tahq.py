"""TAH-Quant (He et al., "TAH-Quant: Effective Activation Quantization in Pipeline Parallelism over Slow Network",
arXiv 2506.01352; code: github.com/heguangxin/TAH-Quant), the published algorithm as a baseline codec `tahq`, so
that it is compared with AQ-SGD and RTQ on the same runs, model and data. It keeps nothing between messages.

For each sample [T, C] (C a multiple of the 64-channel tile):

1. *Token-adaptive bits*: each token's entropy of its normalized magnitudes |x| / Σ|x| is computed; the 20% of
   tokens with the lowest entropy get 3 bits per value, the others 4.
2. *Outlier tiles*: a tile of 64 values of one token whose largest |x| is at least twice the second largest has
   that value swapped to position 0 (the pivot), then is rotated by the orthonormal Hadamard matrix H/8.
3. *Asymmetric tile quantization*: per tile, an fp16 zero (the minimum) and fp16 step ((max − min) / (2^b − 1)),
   nearest rounding.

Row of one sample: a bit per token (3-bit token), a bit per tile (rotated tile), the rotated tiles' pivot positions
(6 bits each), each tile's fp16 zero and step, then the codes — the 3-bit tokens' packed, then the 4-bit tokens'.
About 4.4 bits per value; the row's length varies with the number of rotated tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aqpipe.compress.bitpack import pack, packed_bytes, unpack
from aqpipe.compress.gpu.copies import HOST, to_device
from aqpipe.compress.link.base import CodecParts, Encoded, LinkCodec, bytes_as, numel
from aqpipe.compress.link.codes import CODE_TAHQ
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import LOSSLESS, CodecError, CodecSpec
from aqpipe.compress.rotated import hadamard, token_rows

TILE, HIGH_BITS, LOW_BITS, LOW_SHARE = 64, 4, 3, 0.2
PIVOT_BITS = 6  # log2(TILE)


def _layout(t: int, c: int) -> tuple[int, int, int]:
    """(3-bit tokens, tiles, fixed bytes of a row: the two bit maps, zeros, steps and codes) of a [t, c] sample."""
    if c % TILE:
        raise CodecError(f"tahq quantizes tiles of {TILE} channels, as published; a hidden size of {c} is not a "
                         "multiple (rtq:B handles any width)")
    low, tiles = int(t * LOW_SHARE), t * (c // TILE)
    fixed = packed_bytes(t, 1) + packed_bytes(tiles, 1) + 4 * tiles + packed_bytes(low * c, LOW_BITS) \
        + packed_bytes((t - low) * c, HIGH_BITS)
    return low, tiles, fixed


def _encode_sample(x: torch.Tensor) -> torch.Tensor:
    """One sample [t, c] (float32) → its row of bytes."""
    t, c = x.shape
    low, tiles, _ = _layout(t, c)
    magnitude = x.abs()
    p = magnitude / (magnitude.sum(dim=1, keepdim=True) + 1e-30)
    entropy = -(p * (p + 1e-30).log()).sum(dim=1)
    low_tokens = torch.zeros(t, dtype=torch.bool, device=x.device)
    low_tokens[torch.argsort(entropy, stable=True)[:low]] = True
    flat = x.reshape(tiles, TILE).clone()
    top2 = flat.abs().topk(2, dim=1).values
    rotate = top2[:, 0] >= 2 * top2[:, 1]
    pivots = flat[rotate].abs().argmax(dim=1)
    if len(pivots):
        chosen = flat[rotate]
        at = torch.arange(len(pivots), device=x.device)
        peak, first = chosen[at, pivots].clone(), chosen[:, 0].clone()
        chosen[at, pivots], chosen[:, 0] = first, peak
        flat[rotate] = (chosen @ hadamard(TILE, x.device)) / 8.0
    bits = torch.where(low_tokens, LOW_BITS, HIGH_BITS).repeat_interleave(c // TILE)
    top = (2 ** bits - 1).float().unsqueeze(1)
    zero = flat.amin(dim=1, keepdim=True).half()
    step = ((flat.amax(dim=1, keepdim=True) - zero.float()) / top).half()
    safe = torch.where(step.float() > 0, step.float(), torch.ones_like(top))
    codes = ((flat - zero.float()) / safe).round_().clamp_(min=0).minimum(top).to(torch.uint8).view(t, c)
    parts = [pack(low_tokens.view(1, -1).to(torch.uint8), 1), pack(rotate.view(1, -1).to(torch.uint8), 1),
             pack(pivots.view(1, -1).to(torch.uint8), PIVOT_BITS), zero.view(1, -1).view(torch.uint8),
             step.view(1, -1).view(torch.uint8), pack(codes[low_tokens].reshape(1, -1), LOW_BITS),
             pack(codes[~low_tokens].reshape(1, -1), HIGH_BITS)]
    return torch.cat([part.reshape(-1) for part in parts])


@dataclass(frozen=True)
class _Row:
    """Where one sample's row lies in a payload and what its bit maps say, read on the bytes as they arrived."""

    start: int
    length: int
    low_tokens: torch.Tensor  # indices of the 3-bit tokens (host)
    high_tokens: torch.Tensor  # indices of the 4-bit tokens (host)
    rotated: torch.Tensor  # indices of the rotated tiles (host)


def _rows(payload: torch.Tensor, b: int, t: int, c: int) -> list[_Row]:
    """The layout of each of the b rows of a payload (a CodecError if it cannot be b tahq samples of [t, c])."""
    low, tiles, fixed = _layout(t, c)
    maps = packed_bytes(t, 1) + packed_bytes(tiles, 1)
    rows, at = [], 0
    for _ in range(b):
        if at + maps > payload.numel():
            raise CodecError("a tahq payload ends inside a sample")
        low_map = unpack(payload[at:at + packed_bytes(t, 1)].view(1, -1), 1, t).view(-1).bool()
        rotate_map = unpack(payload[at + packed_bytes(t, 1):at + maps].view(1, -1), 1, tiles).view(-1).bool()
        marked = int(low_map.sum())
        if marked != low:
            raise CodecError(f"a tahq sample marks {marked} of {t} tokens as 3-bit, not {low}")
        rotated = rotate_map.nonzero().view(-1)
        length = fixed + packed_bytes(len(rotated), PIVOT_BITS)
        if at + length > payload.numel():
            raise CodecError("a tahq payload ends inside a sample")
        rows.append(_Row(at, length, low_map.nonzero().view(-1), (~low_map).nonzero().view(-1), rotated))
        at += length
    if at != payload.numel():
        raise CodecError(f"a tahq payload of {payload.numel()} bytes holds {at} bytes of samples")
    return rows


def _decode_sample(payload: torch.Tensor, row: _Row, t: int, c: int) -> torch.Tensor:
    """The [t, c] sample a row stands for, computed where `payload` is with the row's layout read beforehand (so
    a GPU's payload is never read back to the host)."""
    low, tiles, _ = _layout(t, c)
    device = payload.device
    at = row.start + packed_bytes(t, 1) + packed_bytes(tiles, 1)

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return payload[at - n:at].view(1, -1)

    n_rot = len(row.rotated)
    pivots = unpack(take(packed_bytes(n_rot, PIVOT_BITS)), PIVOT_BITS, n_rot).view(-1).long()
    zero = bytes_as(take(2 * tiles), torch.float16).view(tiles, 1).float()
    step = bytes_as(take(2 * tiles), torch.float16).view(tiles, 1).float()
    codes = torch.empty(t, c, dtype=torch.uint8, device=device)
    codes.index_copy_(0, to_device(row.low_tokens, device),
                      unpack(take(packed_bytes(low * c, LOW_BITS)), LOW_BITS, low * c).view(low, c))
    codes.index_copy_(0, to_device(row.high_tokens, device),
                      unpack(take(packed_bytes((t - low) * c, HIGH_BITS)), HIGH_BITS, (t - low) * c).view(t - low, c))
    flat = codes.view(tiles, TILE).float() * step + zero
    if n_rot:
        rotated = to_device(row.rotated, device)
        chosen = (flat.index_select(0, rotated) @ hadamard(TILE, device)) / 8.0
        index = torch.arange(n_rot, device=device)
        peak, first = chosen[:, 0].clone(), chosen[index, pivots].clone()
        chosen[index, pivots], chosen[:, 0] = peak, first
        flat.index_copy_(0, rotated, chosen)
    return flat.view(t, c)


class TAHQuantCodec(LinkCodec):
    """TAH-Quant's forward activation codec (see the module's docstring)."""

    code = CODE_TAHQ
    name = "tahq"

    def __init__(self, device: torch.device = HOST) -> None:
        self.device = device

    @classmethod
    def from_spec(cls, spec: CodecSpec, parts: CodecParts) -> TAHQuantCodec:
        return cls(parts.device)

    @classmethod
    def message_bytes(cls, spec: CodecSpec, shape: tuple[int, ...], dtype: torch.dtype, options: QuantOptions,
                      first_sight: CodecSpec = LOSSLESS, first_sights: bool = False) -> int:
        """With no tile rotated (each rotated tile adds its 6-bit pivot position)."""
        return round(shape[0] * tahq_bits_per_value(shape) * numel(shape[1:]) / 8)

    def _encode(self, tensor: torch.Tensor, ids: torch.Tensor) -> Encoded:
        x = tensor.float()
        rows = token_rows(x)
        payload = torch.cat([_encode_sample(sample) for sample in rows])
        return Encoded.of(payload, tuple(x.shape), torch.uint8, flags=self.flags())

    def _payload_problem(self, header) -> str | None:
        """The length varies with the rotated tiles: between none and every tile rotated."""
        if len(header.shape) < 2:
            return f"tahq needs a batch of [tokens, channels] samples, got shape {header.shape}"
        rows = token_rows(torch.empty(header.shape, device="meta"))
        b, t, c = rows.shape
        try:
            _, tiles, fixed = _layout(t, c)
        except CodecError as e:
            return str(e)
        low, high = b * fixed, b * (fixed + packed_bytes(tiles, PIVOT_BITS))
        if not low <= header.payload_len <= high:
            return f"payload length {header.payload_len} is outside {low}..{high} for shape {header.shape}"
        return None

    def _read_layout(self, header, payload: torch.Tensor) -> list[_Row]:
        """Each sample's layout — where its row starts, its 3-bit tokens and rotated tiles — from the host bytes: a
        row's varying length, read on a GPU, would make the host wait once per sample."""
        _, t, c = token_rows(torch.empty(header.shape, device="meta")).shape
        return _rows(payload, header.shape[0], t, c)

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor, layout: Any = None) -> torch.Tensor:
        _, t, c = token_rows(torch.empty(header.shape, device="meta")).shape
        return torch.stack([_decode_sample(payload, row, t, c) for row in layout]).view(header.shape)


def tahq_bits_per_value(shape: tuple[int, ...], rotated_share: float = 0.0) -> float:
    """Wire bits per value of one sample of `shape` with the given share of its tiles rotated."""
    rows = token_rows(torch.empty(shape, device="meta"))
    _, t, c = rows.shape
    _, tiles, fixed = _layout(t, c)
    return 8 * (fixed + packed_bytes(round(rotated_share * tiles), PIVOT_BITS)) / numel(shape[1:])
