"""benchmarks/copies_paused.py sets each step under travelling copies against its round's paused steps under
copies, leaving out the first step of every turn (what the switch itself costs) and the steps around a save."""

import pytest

from benchmarks.copies_paused import ratios


def test_travelling_steps_are_set_against_their_rounds_paused_steps_without_turn_starts_or_saves():
    every = 12
    seconds = {}
    for step in range(12, 48):
        travelling = step < 24 or 36 <= step
        seconds[step] = (1.1 if travelling else 1.0) * (2.0 if step % every in (0, 1) else 1.0)
    seconds[12] = seconds[36] = seconds[24] = 50.0  # (the first step of each turn: left out whatever it took)
    seconds[25] = 0.5
    records = [{"step": s, "step_seconds": t} for s, t in seconds.items()]
    appeared = {s: 10.0 * s for s in seconds}
    runs = {"records": records, "appeared": appeared, "windows": {12: (119.0, float("inf"))},
            "steps": {"travelling": [(12, 23), (36, 47)], "paused": [(24, 35), (48, 47)]}}
    result = ratios(runs, every)
    assert result["rounds_kept"] == 1  # (the second round has no paused steps)
    assert result["steps_travelling"] == 10  # steps 14-23: not 12 (the turn's first), nor 13 (after the save)
    assert result["steps_paused"] == 10  # steps 26-35
    assert result["slowdown"] == pytest.approx(0.1)


def test_steps_outside_every_copy_window_count_on_neither_side():
    records = [{"step": s, "step_seconds": 1.0 if s < 30 else 3.0} for s in range(12, 48)]
    appeared = {s: 10.0 * s for s in range(12, 48)}
    runs = {"records": records, "appeared": appeared, "windows": {12: (119.0, 295.0)},
            "steps": {"travelling": [(12, 23)], "paused": [(24, 35)]}}
    result = ratios(runs, 12)
    assert result["steps_paused"] == 4  # steps 26-29: the copies were kept at t=295, during step 29
    assert result["slowdown"] == pytest.approx(0.0)
