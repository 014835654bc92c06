"""benchmarks/copies_paused.py sets each step under travelling copies against the steps at its place of the checkpoint
cycle in the paused turns on both sides (so that step times drifting over the run cancel out), leaving out the
first step of every turn (what the switch itself costs) and the steps under no copies."""

import json

import pytest

from benchmarks.copies_paused import load_raw, ratios

EVERY = 12
TURNS = [("paused", 19, 30), ("travelling", 31, 54), ("paused", 55, 66)]  # (turns begin half a cycle past a save)


def runs_of(seconds: dict[int, float], windows: dict) -> dict:
    return {"records": [{"step": s, "step_seconds": t} for s, t in seconds.items()],
            "appeared": {s: 10.0 * s for s in seconds}, "windows": windows, "steps": TURNS}


def timed(slower: float, drift: float) -> dict[int, float]:
    """Step times drifting by `drift` a step, `slower` in the travelling turn, twice as long around a save, and 50 s
    for a turn's first step."""
    seconds = {}
    for step in range(19, 67):
        travelling = 31 <= step <= 54
        seconds[step] = (1 + slower * travelling) * (1 + drift * step) * (2.0 if step % EVERY in (0, 1) else 1.0)
    for _, first, _ in TURNS:
        seconds[first] = 50.0
    return seconds


def test_a_drift_of_step_times_cancels_out_and_each_turns_first_step_is_left_out():
    result = ratios(runs_of(timed(0.10, 0.001), {12: (100.0, float("inf"))}), EVERY)
    # (a reference from the paused turn after alone would say +8.1%: the drift over 24 steps)
    assert result["slowdown"] == pytest.approx(0.10, abs=0.002)
    assert result["time"] == pytest.approx(0.10, abs=0.002)  # (the extra time: slow steps at their weight)
    # steps 32-54: not 31 (the turn's first), nor 43 (its place, 7, is every paused turn's first)
    assert result["steps_travelling"] == 22
    assert result["drift"] == pytest.approx(0.036 / 1.04, abs=0.003)  # (36 steps apart at 0.1% a step)


def test_steps_under_no_copies_count_on_neither_side():
    # the copies were kept at t=455, during step 46: the paused turn after them is under none
    result = ratios(runs_of(timed(0.10, 0.0), {12: (100.0, 455.0)}), EVERY)
    assert result["steps_travelling"] == 13  # steps 32-45 less 43
    assert result["slowdown"] == pytest.approx(0.10)
    assert result["drift"] is None  # (no paused turn after under copies to set against the one before)


def test_a_run_whose_copies_never_travelled_says_so():
    result = ratios(runs_of(timed(0.10, 0.0), {}), EVERY)
    assert result["slowdown"] is None and result["steps_travelling"] == 0


def test_a_saved_run_analyses_again_to_the_same_figures(tmp_path):
    runs = runs_of(timed(0.10, 0.001), {12: (100.0, float("inf"))})
    (tmp_path / "run.raw.json").write_text(json.dumps(runs))  # (as `measure` saves it: JSON's keys are strings)
    assert ratios(load_raw(tmp_path / "run.raw.json"), EVERY) == ratios(runs, EVERY)


def test_the_extra_time_counts_slow_steps_at_their_weight_where_the_median_step_does_not():
    seconds = timed(0.0, 0.0)
    for step in range(32, 36):  # four travelling steps three times as long
        seconds[step] *= 3
    result = ratios(runs_of(seconds, {12: (100.0, float("inf"))}), EVERY)
    assert result["slowdown"] == pytest.approx(0.0)
    assert result["time"] > 0.25
