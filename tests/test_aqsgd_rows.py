"""An AQ-SGD message's parts: payloads of one kind of sample, one read of every kind's verdicts, m(ξ) kept or
dropped per sample, and rows that stop being a graph's own before anything keeps them."""

import re

import pytest
import torch

from aqpipe.compress.link.aqsgd_rows import (
    MODE_DELTA,
    MODE_FIRST,
    MODE_FULL,
    MODE_FULL_BF16,
    Candidates,
    keep,
    lossless_payload,
    payload_of,
    read_modes,
    segments_by_mode,
    verdicts_of,
)
from aqpipe.storage import MemoryStore, StoreView


def test_a_payload_of_one_kind_is_its_mode_bytes_then_its_rows_in_order():
    coded = torch.arange(12, dtype=torch.uint8).view(3, 4)
    assert payload_of(MODE_DELTA, coded).tolist() == [MODE_DELTA] * 3 + list(range(12))
    activation = torch.randn(2, 3).bfloat16()
    payload = lossless_payload(activation)
    assert payload[:2].tolist() == [MODE_FULL_BF16] * 2
    assert torch.equal(payload[2:].view(torch.bfloat16).view(2, 3), activation)  # its own dtype, bit for bit


def test_every_kinds_verdicts_are_read_at_once_and_split_back(monkeypatch):
    reads = []
    real = torch.Tensor.tolist

    def counted(self):
        reads.append(self.numel())
        return real(self)

    groups = [Candidates([0, 2], torch.zeros(2, 1), verdicts_of(torch.tensor([True, False]), torch.tensor([5, 6]))),
              Candidates([1], torch.zeros(1, 1), verdicts_of(torch.tensor([True]), torch.tensor([7])))]
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    Candidates.read_all(groups)
    assert reads == [6]
    assert (groups[0].fits, groups[0].sums, groups[1].fits, groups[1].sums) == ([True, False], [5, 6], [True], [7])


def test_lent_rows_are_copied_before_they_are_kept_and_others_are_not():
    buffer = torch.randn(2, 3).half()
    lent = Candidates([0, 1], buffer, verdicts_of(torch.tensor([True, True]), torch.tensor([1, 2])), lent=True)
    assert lent.owned().values is not buffer and torch.equal(lent.values, buffer) and not lent.lent
    row = buffer[:1]
    own = Candidates([0], row, verdicts_of(torch.tensor([True]), torch.tensor([1])))
    assert own.owned().values is row  # not a graph's: no copy


def test_keep_stores_what_can_be_kept_and_drops_the_rest_on_this_side():
    store = MemoryStore(torch.float16)
    view = StoreView(store, 0, "send")
    view.put([7], [torch.ones(3).half()])
    dropped = keep(view, [5, 7], [torch.zeros(3).half(), None])
    assert dropped == [7] and view.present([5, 7]) == [True, False]


def test_a_payloads_segments_are_grouped_by_mode_in_sample_order():
    sizes = {MODE_DELTA: 2, MODE_FULL: 4}
    modes = [MODE_FULL, MODE_DELTA, MODE_FULL]
    payload = torch.tensor([*modes, 1, 1, 1, 1, 7, 8, 2, 2, 2, 2], dtype=torch.uint8)
    kinds = segments_by_mode(modes, payload, sizes)
    assert kinds[MODE_DELTA][1] == [1] and kinds[MODE_DELTA][0].tolist() == [[7, 8]]
    assert kinds[MODE_FULL][1] == [0, 2] and kinds[MODE_FULL][0].tolist() == [[1] * 4, [2] * 4]
    one = segments_by_mode([MODE_DELTA] * 2, torch.tensor([1, 1, 5, 6, 7, 8], dtype=torch.uint8), sizes)
    assert one[MODE_DELTA][0].tolist() == [[5, 6], [7, 8]]  # one kind: the payload's rows as they are


@pytest.mark.parametrize("payload,needle", [([MODE_DELTA, 9, 0, 0], "unknown sample modes [9]"),
                                            ([MODE_DELTA, MODE_FIRST, 0, 0], "no --first-sight coder"),
                                            ([MODE_DELTA, MODE_DELTA, 0, 0, 0], "does not match its sample modes")])
def test_mode_bytes_that_do_not_fit_the_payload_are_refused_by_name(payload, needle):
    from aqpipe.compress.link.specs import CodecError

    with pytest.raises(CodecError, match=re.escape(needle)):
        read_modes(torch.tensor(payload, dtype=torch.uint8), 2, {MODE_DELTA: 1})
