"""An AQ-SGD receiver's checksum checks made once their sums reach the host (aqpipe.compress.link.late_checks):
in order, at the next message or when the step settles, the ones still on their way waited for only when they must
be (a stand-in event here; tests/test_gpu_codecs.py runs a GPU receiver's, whose sums cross as a copy the host does
not wait for)."""

import pytest
import torch

from aqpipe.compress.link import late_checks
from aqpipe.compress.link.checksum import fold_checksum
from aqpipe.compress.link.late_checks import LateChecks, _Pending


class Copy:
    """A stand-in for a CUDA event: whether the sums' copy has arrived, and whether anyone waited for it."""

    def __init__(self, done: bool = False) -> None:
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited, self.done = True, True


def recorder():
    made: list[tuple[str, int]] = []
    return made, LateChecks(lambda header, check: made.append((header, check)))


def test_a_messages_check_is_made_at_the_next_message_or_when_the_step_settles():
    made, checks = recorder()
    sums = torch.tensor([3, -5, 7], dtype=torch.int64)
    checks.add("first", sums)
    assert made == [] and len(checks) == 1
    checks.add("second", sums * 2)
    assert made == [("first", fold_checksum([0, 1, 2], [3, -5, 7]))] and len(checks) == 1
    checks.settle()
    assert made[1] == ("second", fold_checksum([0, 1, 2], [6, -10, 14])) and len(checks) == 0
    checks.settle()  # (nothing left: nothing made twice)
    assert len(made) == 2


def test_sums_of_a_message_mixing_kinds_of_row_are_folded_in_row_order():
    made, checks = recorder()
    checks.add("mixed", torch.tensor([30, 10, 20]), rows=[2, 0, 1])  # (a group's rows, then another's)
    checks.settle()
    assert made == [("mixed", fold_checksum([0, 1, 2], [10, 20, 30]))]


def test_sums_still_on_their_way_are_not_waited_for_until_the_step_settles():
    made, checks = recorder()
    on_the_way, arrived = Copy(), Copy(done=True)
    checks._pending.extend([_Pending("slow", torch.tensor([1]), on_the_way), _Pending("fast", torch.tensor([2]), arrived)])
    checks.check()
    assert made == [] and not on_the_way.waited  # in order: the second waits behind the first
    on_the_way.done = True
    checks.check()
    assert [h for h, _ in made] == ["slow", "fast"] and not on_the_way.waited
    late = Copy()
    checks._pending.append(_Pending("last", torch.tensor([3]), late))
    checks.settle()
    assert late.waited and [h for h, _ in made] == ["slow", "fast", "last"]


def test_a_caller_that_never_settles_keeps_a_bounded_number_waiting(monkeypatch):
    monkeypatch.setattr(late_checks, "MOST_PENDING", 3)
    made, checks = recorder()
    copies = [Copy() for _ in range(3)]
    checks._pending.extend(_Pending(i, torch.tensor([i]), copy) for i, copy in enumerate(copies))
    checks.add("next", torch.tensor([9]))
    assert copies[0].waited and not copies[1].waited and [h for h, _ in made] == [0] and len(checks) == 3


def test_a_divergence_found_late_is_refused_at_the_next_message_or_when_the_step_settles():
    def verify(header, check):
        if header == "bad":
            raise ValueError("m(xi) diverged")

    checks = LateChecks(verify)
    checks.add("bad", torch.tensor([1]))
    with pytest.raises(ValueError, match="diverged"):
        checks.add("good", torch.tensor([2]))
    checks.add("good", torch.tensor([2]))
    checks.add("bad", torch.tensor([1]))
    with pytest.raises(ValueError, match="diverged"):
        checks.settle()
    assert len(checks) == 0


def test_a_gpu_receiver_that_is_dropped_goes_at_once_with_its_graphs(monkeypatch):
    """A GPU receiver's late checks refuse a divergence by its link alone, holding no reference back to the codec:
    a codec that is dropped (a benchmark's next variant, a rebuilt link) is freed at once, and its CUDA graphs —
    tens of MB each — are forgotten with it, not whenever the garbage collector next finds a cycle. (Built here on
    the CPU as on a GPU: `device` cuda, its random generator on the host.)"""
    import gc
    import weakref

    from aqpipe.compress.link import aqsgd
    from aqpipe.compress.link.factory import build_codec
    from aqpipe.compress.link.options import QuantOptions
    from aqpipe.storage import SlabStore, StoreView

    monkeypatch.setattr(aqsgd, "generator_on", lambda device, seed: torch.Generator().manual_seed(seed))
    forgotten = []
    monkeypatch.setattr(aqsgd, "forget", forgotten.append)
    gc.disable()
    try:
        receiver = build_codec("aqsgd:3", "fw", StoreView(SlabStore(torch.float16, "cpu"), 3, "recv"), QuantOptions(),
                               device="cuda")
        assert receiver.late_checks is not None
        gone, serial = weakref.ref(receiver), receiver._graphs
        del receiver
        assert gone() is None and forgotten == [serial]
    finally:
        gc.enable()
