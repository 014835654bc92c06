"""The worker's side of the launcher's event protocol: one machine-readable stdout line per event, and a heartbeat.

A line is `@@aqpipe ` followed by one JSON object with an `event` field (start, step, eval, progress, resumed, done,
error, alive). The local launcher reads them to draw progress and to tell a hung rank (silent) from a busy one;
outside it (torchrun, DeepSpeed) nothing is written.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

EVENT_PREFIX = "@@aqpipe "
HEARTBEAT_SECONDS = 1.0
_EMIT_LOCK = threading.Lock()
_last_progress: dict[str, float] = {}  # phase -> when its last progress event went out (monotonic seconds)


def _enabled() -> bool:
    return os.environ.get("AQPIPE_EVENTS") == "1"


def emit(event: dict) -> None:
    """Tell the local launcher about progress (a machine-readable stdout line); no-op outside it."""
    if _enabled():
        with _EMIT_LOCK:  # the heartbeat thread emits too; one write per line keeps lines whole
            sys.stdout.write(EVENT_PREFIX + json.dumps(event) + "\n")
            sys.stdout.flush()


def start_heartbeat() -> None:
    """Tell the local launcher every second that this process is alive (a stopped or hung rank falls silent)."""
    if not _enabled():
        return

    def beat() -> None:
        while True:
            emit({"event": "alive"})
            time.sleep(HEARTBEAT_SECONDS)

    threading.Thread(target=beat, name="aqpipe-heartbeat", daemon=True).start()


def progress(phase: str, done: int, total: int, unit: str) -> None:
    """Tell the local launcher that a long phase between step records (the held-out pass, the final weights' way to
    rank 0) moves on — `done` of `total` `unit` — at most once a heartbeat period, and at its end: over a slow link
    such a phase can outlast --stall-timeout, and the launcher counts only events other than `alive` as progress."""
    now = time.monotonic()
    if done < total and now - _last_progress.get(phase, float("-inf")) < HEARTBEAT_SECONDS:
        return
    _last_progress[phase] = now
    emit({"event": "progress", "phase": phase, "done": done, "total": total, "unit": unit})
