"""The CUDA sync audit: which calls inside a training step make the host wait for the GPU.

Every such call drains the GPU's queue, so the host never runs ahead of it. With `AQPIPE_CUDA_SYNC_AUDIT=1` in its
environment, a rank on a GPU runs each training step from the third on (the first two build caches, seed m(ξ) and
warm the allocator) under `torch.cuda.set_sync_debug_mode("warn")` and prints one line per step to its log —
``cuda sync audit: step N: K synchronizing calls`` — followed by one line per place in aqpipe that made them, most
frequent first. The GPU checks (`benchmarks/gpu_check.sh`, `tests/test_gpu.py`) read those lines. torch counts a
stream's or the device's synchronize and a copy that waits, not a wait on a CUDA event: an AQ-SGD sender's wait
for its verdicts' copy (`aqsgd_rows.Candidates.read_all`) reports itself as torch would; a link's outbox thread's
for a message's bytes, off the compute thread, is not counted.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ENV = "AQPIPE_CUDA_SYNC_AUDIT"
FIRST_AUDITED_STEP = 2
_PACKAGE = str(Path(__file__).resolve().parents[2])  # aqpipe/ (this file: aqpipe/pipeline/execution/)


def enabled(device: torch.device) -> bool:
    """Whether this process audits its steps: asked for in the environment, and computing on a GPU."""
    return device.type == "cuda" and os.environ.get(ENV, "") not in ("", "0")


def _ours(frame: traceback.FrameSummary) -> bool:
    return frame.filename.startswith(_PACKAGE) and not frame.filename.endswith("sync_audit.py")


def _caller(stack: list[traceback.FrameSummary], filename: str, lineno: int) -> str:
    """Where a warning's synchronizing call was made: the aqpipe frame the warning names (a helper that warns for its
    caller, with stacklevel, names that caller), else the innermost aqpipe frame of its stack."""
    frames = [f for f in stack if (f.filename, f.lineno) == (filename, lineno) and _ours(f)]
    frames = frames or [f for f in stack if _ours(f)]
    if not frames:
        return "(outside aqpipe)"
    frame = frames[-1]
    return f"{Path(frame.filename).relative_to(Path(_PACKAGE).parent)}:{frame.lineno} {frame.name}"


@contextmanager
def audited(step: int, device: torch.device) -> Iterator[None]:
    """Run the body under CUDA's sync debug mode when auditing, and print what it counted to the rank's log."""
    if not enabled(device) or step < FIRST_AUDITED_STEP:
        yield
        return
    places: Counter[str] = Counter()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):  # warnings.showwarning's signature
        if "synchronizing CUDA operation" in str(message):
            places[_caller(traceback.extract_stack()[:-1], filename, lineno)] += 1
        else:
            show(message, category, filename, lineno, file, line)

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    print(f"cuda sync audit: step {step}: {sum(places.values())} synchronizing calls", file=sys.stderr, flush=True)
    for place, count in places.most_common():
        print(f"cuda sync audit:   {count:4d}  {place}", file=sys.stderr, flush=True)
