"""The worker's events: progress of a long phase is told at most once a heartbeat period, and at its end."""

import json
from types import SimpleNamespace

from aqpipe.runtime import events


def _lines(capsys) -> list[dict]:
    out = capsys.readouterr().out
    return [json.loads(line[len(events.EVENT_PREFIX):]) for line in out.splitlines()]


def test_progress_goes_out_at_most_once_a_heartbeat_and_always_at_the_end(monkeypatch, capsys):
    monkeypatch.setenv("AQPIPE_EVENTS", "1")
    monkeypatch.setattr(events, "_last_progress", {})
    now = [100.0]
    monkeypatch.setattr(events, "time", SimpleNamespace(monotonic=lambda: now[0]))  # (this module's clock only)
    for done in range(1, 5):  # four batches within one heartbeat period: the first is told, the rest wait
        events.progress("held-out pass", done, 10, "batches")
        now[0] += 0.2
    now[0] += 1.0
    events.progress("held-out pass", 5, 10, "batches")
    events.progress("final weights", 10, 200, "bytes")  # another phase has a period of its own
    events.progress("held-out pass", 10, 10, "batches")  # the end, however soon
    assert [(e["phase"], e["done"]) for e in _lines(capsys)] == [
        ("held-out pass", 1), ("held-out pass", 5), ("final weights", 10), ("held-out pass", 10)]


def test_outside_the_launcher_progress_writes_nothing(monkeypatch, capsys):
    monkeypatch.delenv("AQPIPE_EVENTS", raising=False)
    events.progress("final weights", 1, 2, "bytes")
    assert capsys.readouterr().out == ""
