"""Pack b-bit codes (b = 1..8) into exactly ⌈n·b/8⌉ bytes per row, and back, with vectorized integer ops.

Codes are grouped so that a group fills whole bytes (g = 8 / gcd(8, b) codes make b·g/8 bytes); each group is
assembled in one integer word (at most 56 bits), so no per-bit array is ever materialised. Code i of a row
occupies bits [b·i, b·(i+1)) of the row's little-endian bit stream.
"""

from __future__ import annotations

import math

import torch


def packed_bytes(n: int, bits: int) -> int:
    """Bytes holding n codes of `bits` bits: ⌈n·bits/8⌉."""
    return (n * bits + 7) // 8


def _group(bits: int) -> tuple[int, int]:
    codes = 8 // math.gcd(8, bits)
    return codes, codes * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [rows, n] (each < 2**bits) → uint8 bytes [rows, ⌈n·bits/8⌉]."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    rows, n = codes.shape
    if bits == 8:
        return codes.contiguous()
    g, nbytes = _group(bits)
    groups = -(-n // g)
    padded = torch.zeros(rows, groups * g, dtype=torch.uint8, device=codes.device)
    padded[:, :n] = codes
    wide = torch.int32 if g * bits <= 31 else torch.int64  # int32 shifts are faster where a group fits
    word = padded.view(rows, groups, g).to(wide)
    shifts = torch.arange(g, device=codes.device, dtype=wide) * bits
    word = (word << shifts).sum(dim=2, dtype=wide)  # disjoint bit ranges: the sum is an OR
    byte_shifts = torch.arange(nbytes, device=codes.device, dtype=wide) * 8
    out = ((word.unsqueeze(2) >> byte_shifts) & 0xFF).to(torch.uint8).view(rows, groups * nbytes)
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
    full = torch.zeros(rows, groups * nbytes, dtype=torch.uint8, device=packed.device)
    full[:, : packed.shape[1]] = packed
    wide = torch.int32 if g * bits <= 31 else torch.int64
    byte_shifts = torch.arange(nbytes, device=packed.device, dtype=wide) * 8
    word = (full.view(rows, groups, nbytes).to(wide) << byte_shifts).sum(dim=2, dtype=wide)
    shifts = torch.arange(g, device=packed.device, dtype=wide) * bits
    codes = ((word.unsqueeze(2) >> shifts) & ((1 << bits) - 1)).to(torch.uint8).view(rows, groups * g)
    return codes[:, :n].contiguous()
