"""A stage's forward and backward times on a GPU, from CUDA events around their kernels.

On a GPU the host only queues a forward's kernels and goes on: its clock would time the queueing, and the GPU's
time would land wherever the host next needs a result (a message's verdicts, the gradient norm) — in another
instruction's time, or as waiting for a peer. Events recorded on the stream before and after the kernels measure
what the GPU spent between them, read once after the step (no wait inside it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class GpuTimer:
    """Named spans of GPU time within one step (on the host: nothing, the host's clock times the work)."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self._spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the GPU work the body queues under `name` (adds up over the step)."""
        if not self.enabled:
            yield
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((name, start, end))

    def settle(self) -> dict[str, float]:
        """Seconds per name over the spans since the last call, once the last of them has run on the GPU."""
        if not self._spans:
            return {}
        self._spans[-1][2].synchronize()
        seconds: dict[str, float] = {}
        for name, start, end in self._spans:
            seconds[name] = seconds.get(name, 0.0) + start.elapsed_time(end) / 1000
        self._spans = []
        return seconds
