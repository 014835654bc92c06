"""The m(ξ) checksum an AQ-SGD message carries: each kept value's 16-bit words weighted by position and summed in
exact int64 arithmetic where the values are (the same number on every device and in every summation order), then
the per-sample sums folded to 32 bits on the host; and the refusal of a message after which the receiver's copy
would fail it (`refuse_divergence`)."""

from __future__ import annotations

import torch

from aqpipe.compress.link.codes import FLAG_NO_CHECK
from aqpipe.compress.link.specs import CodecError

_MERSENNE_61 = (1 << 61) - 1
_CHECKSUM_ELEMENTS = 1 << 20  # words summed per slice: its int64 temporaries take 16 MB, whatever the batch
_position_weights: dict[tuple[int, str], torch.Tensor] = {}


CHECKSUM_WEIGHTS = (40503, 65521)  # word i of a value weighs 1 + (i · 40503) mod 65521 (the fused kernels too)


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """Pseudo-random weights 1 … 65521 for the n 16-bit words of a value: the first n of a table cached per device
    and power-of-two length, for the process's life (a codec's CUDA graph reads the table it was captured with; over
    real rows a link's values have as many lengths as its samples have real tokens, and the tables of all of them
    together take at most twice the longest)."""
    size = 1 << max(0, n - 1).bit_length()
    key = (size, str(device))
    if key not in _position_weights:
        multiplier, modulus = CHECKSUM_WEIGHTS
        _position_weights[key] = 1 + (torch.arange(size, dtype=torch.int64, device=device) * multiplier) % modulus
    return _position_weights[key][:n]


def store_checksum(values: list[torch.Tensor | None]) -> int:
    """A 32-bit checksum of the m(ξ) values kept, in sample order (their raw bits in the store dtype; None: not
    kept), computed where the values are: each value's 16-bit words weighted by position and summed in int64 — exact
    integer arithmetic, so every device and every summation order gives the same number — and only one number per
    sample crosses to the host. Any single changed word changes each sample's sum (folded to 32 bits, two copies
    that differ still collide once in 2^32)."""
    kept = [(position, v) for position, v in enumerate(values) if v is not None]
    if not kept:
        return 0
    sums = row_sums(torch.stack([v.contiguous() for _, v in kept])).tolist()
    return fold_checksum([position for position, _ in kept], sums)


def row_sums(values: torch.Tensor) -> torch.Tensor:
    """Each row's position-weighted sum of its 16-bit words (int64 [B], on the values' device): what
    `store_checksum` folds, formed before anything is read so that it can cross to the host with other numbers."""
    words = values.contiguous().view(torch.int16).reshape(values.shape[0], -1)
    weights = _weights(words.shape[1], words.device)
    # |word| < 2^15 and weight < 2^16: each row's sum stays below 2^63 for up to 2^31 words (8 GB per sample). The
    # int64 words and products are formed a slice of columns at a time, sized so that a slice of the whole batch has
    # `_CHECKSUM_ELEMENTS` words: a codec's CUDA graph keeps its call's peak for the run, and a micro-batch of
    # activations at once would be four times the batch's own bytes
    columns = max(1, _CHECKSUM_ELEMENTS // max(1, words.shape[0]))
    if words.shape[1] <= columns:  # one slice: three kernels
        return (words.to(torch.int64) * weights).sum(dim=1)
    sums = torch.zeros(words.shape[0], dtype=torch.int64, device=words.device)
    for start in range(0, words.shape[1], columns):
        part = slice(start, start + columns)
        sums += (words[:, part].to(torch.int64) * weights[part]).sum(dim=1)
    return sums


def fold_checksum(positions: list[int], sums: list[int]) -> int:
    """The 32-bit checksum of kept values at `positions` (in order) with row sums `sums`."""
    h = 0
    for position, s in zip(positions, sums):
        h = (h * 1_000_003 + position * 7919 + s) % _MERSENNE_61
    return (h ^ (h >> 32)) & 0xFFFFFFFF


def refuse_divergence(link: int, header, check: int) -> None:
    """Refuse a message on `link` after which the receiver's m(ξ) would differ from the sender's: its folded checksum
    `check` is not the header's (unless the sender sent no check)."""
    if not header.flags & FLAG_NO_CHECK and check != header.codec_check:
        raise CodecError(f"m(xi) diverged on link {link}: this side's copy fails the sender's checksum "
                         f"at step {header.step} micro-batch {header.micro_batch}")
