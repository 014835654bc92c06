"""An AQ-SGD receiver's checksum checks, made once the sums reach the host rather than while the host waits.

A receiver's message of deltas and first sights needs no number from the GPU to be decoded: the sender sent each so
only where the new m(ξ) could be kept, so every one is kept, and the decoded activation is the stage's input as it
is. Only the checksum — does this side's new m(ξ) match the sender's? — needs the sums the kernels formed, and
reading them at once makes the host wait for every kernel queued before them (a stage's last backward, say), so
the GPU idles while the host queues the forward that follows. The sums travel instead as a copy the host does not
wait for, and each is checked once it has arrived: at the receiver's next message, and at the latest when the step
ends (`settle`), before its losses are read and before any checkpoint. A divergence is still refused within the step
it happened in, naming the message, and the run stops there as before. (The message's new m(ξ) is kept before its
check, not after: once the copies differ the run cannot go on, whatever either holds.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from aqpipe.compress.link.checksum import fold_checksum

MOST_PENDING = 64  # checks left waiting before the oldest is waited for (a caller that never settles)


@dataclass
class _Pending:
    """One message's check: its header, its per-sample sums (on the host once `arrived` has passed) and the event
    that passes when their copy is done (None: they were on the host already)."""

    header: Any
    sums: torch.Tensor
    arrived: Any
    rows: list[int] | None = None  # the message's row of each sum (None: in order)


class LateChecks:
    """The checks one receiving codec has left for later; `verify(header, check)` refuses a message whose folded
    checksum is not the sender's."""

    def __init__(self, verify: Callable[[Any, int], None]) -> None:
        self._verify = verify
        self._pending: deque[_Pending] = deque()

    def add(self, header: Any, sums: torch.Tensor, rows: list[int] | None = None) -> None:
        """Check the message of `header` once its per-sample checksum sums (int64 [B], on the device the kernels
        formed them on; `rows`: the message's row of each, None: in order) reach the host: at the next `add` or
        `settle` after they have. The earlier messages' checks whose sums have arrived are made now."""
        self.check(wait=len(self._pending) >= MOST_PENDING)
        if sums.device.type == "cuda":
            host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            host.copy_(sums, non_blocking=True)  # queued behind the kernels that form them
            arrived = torch.cuda.Event()
            arrived.record(torch.cuda.current_stream(sums.device))
            self._pending.append(_Pending(header, host, arrived, rows))
        else:  # (a copy, as on a GPU: the caller may write the tensor again, as a graph does the sums it lends)
            self._pending.append(_Pending(header, sums.clone(), None, rows))

    def check(self, wait: bool = False) -> None:
        """Make, in order, each check whose sums have reached the host (with `wait`: the oldest waited for first)."""
        while self._pending:
            oldest = self._pending[0]
            if oldest.arrived is not None and not oldest.arrived.query():
                if not wait:
                    return
                oldest.arrived.synchronize()
            self._pending.popleft()
            sums = oldest.sums.tolist()
            rows = list(range(len(sums))) if oldest.rows is None else oldest.rows
            in_order = sorted(zip(rows, sums))
            self._verify(oldest.header, fold_checksum([row for row, _ in in_order], [s for _, s in in_order]))
            wait = False  # (only the oldest is waited for: the rest as they arrive)

    def settle(self) -> None:
        """Make every check left, waiting for the sums still on their way."""
        while self._pending:
            self.check(wait=True)

    def __len__(self) -> int:
        return len(self._pending)
