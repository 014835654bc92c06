"""benchmarks/copies_slowdown.py counts a step as "during copies" while copies still travel when the jobs stop: the
copies of a full fine-tune's checkpoint outlast several turns, and the steps under its last, unfinished one are not
the control (steps with no copies in flight)."""

from types import SimpleNamespace

from benchmarks.copies_slowdown import copy_windows
from benchmarks.host_loss import HOSTS, Marks, overlapping


def marks_of(seen: dict[tuple[int, str], float]) -> Marks:
    marks = Marks(SimpleNamespace(), None)
    marks.seen = {key: {host: when + host * 0.1 for host in range(HOSTS)} for key, when in seen.items()}
    return marks


def test_steps_under_copies_still_travelling_at_the_end_are_during_copies_and_never_the_control():
    # a checkpoint at step 12 (complete at t=100, copies kept at t=400); the one at 24 came while they travelled and
    # was never copied; the one at 36 (t=500) was copied, its copies unfinished when the jobs stopped at step 52, so
    # that the one at 48 (t=650) came while they travelled, and was never copied
    marks = marks_of({(12, "COMPLETE"): 100, (12, "REPLICATED"): 400, (24, "COMPLETE"): 200, (36, "COMPLETE"): 500,
                      (48, "COMPLETE"): 650})
    appeared = {step: 50.0 + 12.5 * step for step in range(1, 53)}  # (12.5 s a step; step 36's record at t=500)
    records = [{"step": s, "step_seconds": 12.5, "checkpoint_bytes": 0 if 28 <= s <= 36 else 4 << 20}
               for s in range(13, 53)]
    windows = copy_windows(marks, records, appeared)
    assert set(windows) == {12, 36}
    during = set(overlapping(records, appeared, windows))
    assert set(range(37, 53)) <= during  # (step 37's record at t=512.5, after step 36's checkpoint at t=500.3)
    assert not {30, 31, 32, 33, 34, 35} & during  # (between the kept copies' end, t=400.3, and the next checkpoint)
    assert {14, 20, 27} <= during


def test_a_checkpoint_kept_uncopied_opens_no_window():
    # step 24's checkpoint came while step 12's copies travelled: nothing sent after those copies were kept
    marks = marks_of({(12, "COMPLETE"): 100, (12, "REPLICATED"): 400, (24, "COMPLETE"): 200})
    appeared = {step: 50.0 + 12.5 * step for step in range(1, 33)}
    records = [{"step": s, "step_seconds": 12.5, "checkpoint_bytes": 4 << 20 if s <= 28 else 0} for s in range(13, 33)]
    assert set(copy_windows(marks, records, appeared)) == {12}
