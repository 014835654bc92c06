"""Pack b-bit codes (b = 1..8) into exactly ⌈n·b/8⌉ bytes per row, and back, with vectorized integer ops.

Codes are grouped so that a group fills whole bytes (g = 8 / gcd(8, b) codes make b·g/8 bytes); each group is
assembled in one integer word (at most 56 bits), so no per-bit array is ever materialised. Code i of a row
occupies bits [b·i, b·(i+1)) of the row's little-endian bit stream. (Words are reinterpreted as bytes, which
assumes a little-endian host, as x86 and ARM are.)
"""

from __future__ import annotations

import functools
import math

import torch


def packed_bytes(n: int, bits: int) -> int:
    """Bytes holding n codes of `bits` bits: ⌈n·bits/8⌉."""
    return (n * bits + 7) // 8


def _group(bits: int) -> tuple[int, int]:
    codes = 8 // math.gcd(8, bits)
    return codes, codes * bits // 8


def _word_dtype(group_bits: int) -> torch.dtype:
    return torch.int32 if group_bits <= 31 else torch.int64  # int32 shifts are faster where a group fits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [rows, n] (each < 2**bits) → uint8 bytes [rows, ⌈n·bits/8⌉]."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    rows, n = codes.shape
    if bits == 8:
        return codes.contiguous()
    g, nbytes = _group(bits)
    groups = -(-n // g)
    if n == groups * g:  # whole groups: no padded copy (each kernel counts on a GPU)
        columns = codes.contiguous().view(rows, groups, g)
    else:
        columns = torch.zeros(rows, groups * g, dtype=torch.uint8, device=codes.device)
        columns[:, :n] = codes
        columns = columns.view(rows, groups, g)
    wide = _word_dtype(g * bits)
    word = _words_at_once(columns, bits, wide) if _at_once(codes.device) else _words_by_column(columns, bits, wide)
    # little-endian words: their first `nbytes` bytes are the group's packed bytes
    out = word.view(torch.uint8).view(rows, groups, wide.itemsize)[:, :, :nbytes].reshape(rows, groups * nbytes)
    return out[:, : packed_bytes(n, bits)].contiguous()


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 bytes [rows, ⌈n·bits/8⌉] → uint8 codes [rows, n]."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    rows = packed.shape[0]
    if packed.shape[1] != packed_bytes(n, bits):
        raise ValueError(f"{packed.shape[1]} bytes per row cannot hold exactly {n} codes of {bits} bits")
    if bits == 8:
        return packed.contiguous()
    g, nbytes = _group(bits)
    groups = -(-n // g)
    wide = _word_dtype(g * bits)
    if packed.shape[1] == groups * nbytes:  # whole groups: no padded copy
        flat = packed
    else:
        flat = torch.zeros(rows, groups * nbytes, dtype=torch.uint8, device=packed.device)
        flat[:, : packed.shape[1]] = packed
    buffer = torch.zeros(rows, groups, wide.itemsize, dtype=torch.uint8, device=packed.device)
    buffer[:, :, :nbytes] = flat.reshape(rows, groups, nbytes)
    word = buffer.view(wide).view(rows, groups)
    mask = (1 << bits) - 1
    if _at_once(packed.device):
        codes = ((word.unsqueeze(2) >> _shifts(bits, g, wide, packed.device)) & mask).to(torch.uint8)
    else:
        codes = torch.empty(rows, groups, g, dtype=torch.uint8, device=packed.device)
        for i in range(g):
            codes[:, :, i] = (word >> (bits * i)) & mask
    return codes.view(rows, groups * g)[:, :n].contiguous()


# Two ways to assemble (and take apart) the words, with the same bits: a column of the group at a time — the
# fastest on a CPU core — or every column in one broadcast shift — a few kernels for any width on a GPU, where each
# kernel's launch, not its arithmetic, sets the time at a message's size (a column at a time takes two per code:
# 21 for a 3-bit group of 8).
def _at_once(device: torch.device) -> bool:
    return device.type != "cpu"


def _words_by_column(columns: torch.Tensor, bits: int, wide: torch.dtype) -> torch.Tensor:
    word = torch.empty(columns.shape[:2], dtype=wide, device=columns.device)
    word.copy_(columns[:, :, 0])
    for i in range(1, columns.shape[2]):  # disjoint bit ranges: OR-ing shifted columns builds each group's word
        word |= columns[:, :, i].to(wide) << (bits * i)
    return word


def _words_at_once(columns: torch.Tensor, bits: int, wide: torch.dtype) -> torch.Tensor:
    shifted = columns.to(wide) << _shifts(bits, columns.shape[2], wide, columns.device)
    return shifted.sum(dim=2, dtype=wide)  # the bit ranges are disjoint: their sum is their OR


@functools.cache
def _shifts(bits: int, g: int, wide: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each code's bit offset in its group's word (b·i for i < g), made once per device (shared: never written, never
    dropped, since a codec's CUDA graph reads it)."""
    return (torch.arange(g, dtype=wide) * bits).to(device, non_blocking=True)
