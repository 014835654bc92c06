"""Copies between the host and a device that make neither side wait: a message's bytes to the host (into pinned
memory, marked by a CUDA event: `to_host`, `Landing`) and values to the device (`to_device`).

Codecs compute on the tensor's device: on a GPU only the packed payload crosses to the host, and a received payload
is decoded on the codec's device; the m(ξ) stores copy their rows the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HOST = torch.device("cpu")


def to_host(payload: torch.Tensor, spin: bool = False) -> tuple[torch.Tensor, Landing | None]:
    """A message's encoded bytes on their way to the host, where the socket reads them, and what marks their arrival
    (None: host bytes, ready as they are). The one device-to-host copy a message makes goes into
    pinned memory without waiting (a DMA queued behind the encode), so the compute thread never waits for the GPU:
    whoever reads the bytes waits on the event first (the outbox thread; `Encoded.payload`). A thread that waits
    sleeps (a link's thread, for a message's bytes) or, with `spin`, spins: the compute thread, waiting for a few
    numbers it needs at once, is not put to sleep and woken (tens of µs) on a step's critical path."""
    if payload.device.type == "cpu":
        return payload, None
    host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
    host.copy_(payload, non_blocking=True)  # queued on the payload's device's current stream
    event = torch.cuda.Event(blocking=not spin)
    event.record(torch.cuda.current_stream(payload.device))
    return host, Landing(event, payload.device)


@dataclass
class Landing:
    """The CUDA event that marks a payload's queued copy to the host, and the GPU it was queued on."""

    event: torch.cuda.Event
    device: torch.device

    def synchronize(self) -> None:
        """Wait until the bytes are on the host, with the copy's GPU current: a thread that has never chosen one is
        on GPU 0, and a wait from there would make a CUDA context on GPU 0 (memory, and a share of its time)."""
        with torch.cuda.device(self.device):
            self.event.synchronize()


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host values on `device` without making the host wait; on the host, the values themselves. A pageable source
    is staged by the driver before the call returns, so it may change afterwards; a pinned one (a GPU's received
    message, a stacked m(ξ)) is read by the copy later — torch keeps its block from reuse until then, and nothing may
    write it meanwhile."""
    if device.type == "cpu" or values.device == device:
        return values
    return values.to(device, non_blocking=True)
