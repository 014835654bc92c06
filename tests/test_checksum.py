"""The m(ξ) checksum: exact integer sums that see any changed 16-bit word, the same in slices as in one piece, and
folded in sample order (a value not kept counts as absent)."""

import pytest
import torch

from aqpipe.compress.link import checksum
from aqpipe.compress.link.checksum import fold_checksum, row_sums, store_checksum


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_one_changed_word_changes_its_rows_sum_and_no_other(dtype):
    values = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = row_sums(values)
    words = values.view(torch.int16).reshape(3, -1)
    for position in (0, 17, words.shape[1] - 1):
        changed = words.clone()
        changed[1, position] ^= 1  # the lowest bit of one word
        after = row_sums(changed.view(dtype).view(values.shape))
        assert after[1] != before[1] and after[0] == before[0] and after[2] == before[2]


def test_minus_zero_is_not_zero():
    assert row_sums(torch.tensor([[0.0]]).half()) != row_sums(torch.tensor([[-0.0]]).half())


def test_a_value_summed_in_slices_gives_the_sums_of_one_piece(monkeypatch):
    values = torch.randn(2, 1000, generator=torch.Generator().manual_seed(1)).half()
    whole = row_sums(values)
    monkeypatch.setattr(checksum, "_CHECKSUM_ELEMENTS", 128)  # 64 columns of 2 rows: 16 slices, the last ragged
    assert torch.equal(row_sums(values), whole)


def test_a_large_batchs_sums_hold_a_bounded_transient_whatever_its_rows():
    """The int64 words and products are formed a slice at a time, sized by the batch's elements, not its columns
    alone: a micro-batch of 8 SmolLM2 activations (8 x 1024 x 576, fp16) once held 75 MB of them at the peak, and a
    codec's CUDA graph keeps its peak for the run."""
    from aqpipe.compress.gpu import graph_memory as gm

    values = gm.stand_in((8, 1024, 576), torch.float16)
    transient = gm.held_bytes(gm.GraphCall("sums", lambda v: (row_sums(v),), (values,))) - values.numel() * 2
    segments = gm.SMALL_SEGMENT + gm.MID_SEGMENT  # (a graph's part-used segments, whatever its blocks)
    assert transient <= 2 * 8 * checksum._CHECKSUM_ELEMENTS + segments + 4096, transient  # (and the sums)


def test_the_checksum_folds_the_kept_values_in_sample_order():
    a, b = torch.randn(4, 3).half(), torch.randn(4, 3).half()
    assert store_checksum([a, None, b]) == fold_checksum([0, 2], row_sums(torch.stack([a, b])).tolist())
    assert store_checksum([a, None, b]) != store_checksum([b, None, a])  # the same values, other samples
    assert store_checksum([a, None, b]) != store_checksum([a, b, None])  # kept by other samples
    assert store_checksum([None, None]) == 0
    assert 0 <= store_checksum([a, b]) < 2**32


def test_weight_tables_for_many_lengths_are_prefixes_of_a_few_power_of_two_tables():
    """Over real rows a link's m(ξ) values have as many lengths as its samples have real tokens: each length's
    weights are the first n of one table per power of two, so every length weighs alike and the tables of 300
    lengths take at most twice the longest."""
    from aqpipe.compress.link import checksum

    multiplier, modulus = checksum.CHECKSUM_WEIGHTS
    before = set(checksum._position_weights)
    for n in range(1, 301):
        expected = 1 + (torch.arange(n, dtype=torch.int64) * multiplier) % modulus
        assert torch.equal(checksum._weights(n, torch.device("cpu")), expected)
    new = [key for key in checksum._position_weights if key not in before and key[1] == "cpu"]
    assert sum(size for size, _ in new) <= 2 * 512
