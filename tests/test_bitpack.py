"""Bit packing: exact byte counts and lossless round trips for every width."""

import pytest
import torch

from aqpipe.compress.bitpack import pack, packed_bytes, unpack


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 9, 24, 1000, 4099])
def test_round_trip_and_exact_size(bits, n):
    g = torch.Generator().manual_seed(bits * 10_000 + n)
    codes = torch.randint(0, 1 << bits, (3, n), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, (n * bits + 7) // 8) == (3, packed_bytes(n, bits))
    assert torch.equal(unpack(packed, bits, n), codes)


def test_bit_layout_is_little_endian_code_by_code():
    codes = torch.tensor([[1, 2, 3, 0, 1]], dtype=torch.uint8)  # 2 bits each: 01 10 11 00 | 01
    assert pack(codes, 2).tolist() == [[0b00111001, 0b01]]
    assert pack(torch.tensor([[5, 3]], dtype=torch.uint8), 3).tolist() == [[0b011101]]


def test_rows_pack_independently():
    codes = torch.randint(0, 8, (4, 13), dtype=torch.int64).to(torch.uint8)
    whole = pack(codes, 3)
    for r in range(4):
        assert torch.equal(pack(codes[r : r + 1], 3), whole[r : r + 1])


@pytest.mark.parametrize("bits", [0, 9])
def test_bad_widths(bits):
    with pytest.raises(ValueError):
        pack(torch.zeros(1, 4, dtype=torch.uint8), bits)


def test_wrong_byte_count_on_unpack():
    with pytest.raises(ValueError, match="cannot hold exactly"):
        unpack(torch.zeros(1, 3, dtype=torch.uint8), 4, 8)


@pytest.mark.parametrize("bits", range(1, 8))
def test_the_gpus_one_broadcast_packs_the_same_bytes_as_the_cpus_columns(monkeypatch, bits):
    """A GPU assembles every column of a group in one broadcast shift; it must give the bytes the column-at-a-time
    CPU path gives (both run here on the host), and unpack them back."""
    from aqpipe.compress import bitpack

    codes = torch.randint(0, 1 << bits, (3, 1001), dtype=torch.uint8)
    by_column = bitpack.pack(codes, bits)
    monkeypatch.setattr(bitpack, "_at_once", lambda device: True)
    at_once = bitpack.pack(codes, bits)
    assert torch.equal(at_once, by_column)
    assert torch.equal(bitpack.unpack(at_once, bits, 1001), codes)
