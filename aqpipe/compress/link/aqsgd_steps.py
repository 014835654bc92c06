"""The arithmetic of each kind of AQ-SGD row, in torch ops: pure functions of a message's tensors, which a CUDA graph
captures and replays (`aqpipe.compress.gpu.cuda_graphs`).

A sender codes known samples as deltas against their m(ξ) (`delta_rows`), first sights through a first-sight coder
(`first_rows`) and lossless values as seeds (`seeds`); a receiver decodes deltas (`delta_values`) and seeds first
sights and lossless values alike. Each step returns what m(ξ) would become and its verdicts (`aqsgd_rows.verdicts_of`:
whether each row can go its way, and its checksum sum), for the codec (`aqsgd.AQSGDCodec`) to read in one wait and
decide the message by. The fused kernels (`aqpipe.compress.gpu.fused`) give the delta steps' bits in fewer passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aqpipe.compress.link.aqsgd_rows import (
    MODE_DELTA,
    MODE_FIRST,
    SampleMemory,
    fidelity_norms,
    payload_of,
    present,
    verdicts_of,
)
from aqpipe.compress.link.checksum import row_sums
from aqpipe.compress.link.sample_coders import SampleCoder


@dataclass(frozen=True, eq=False)
class RowSteps:
    """One link end's row steps: its `delta` coder, its `first_sight` coder (None: first sights go losslessly) and
    its view of m(ξ) (the store's dtype, and which values the store can keep)."""

    delta: SampleCoder
    first_sight: SampleCoder | None
    view: SampleMemory

    def delta_rows(self, x: torch.Tensor, m_old: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Known samples `x` against their m(ξ) (`m_old`, in the store's dtype): the payload of a message of them all
        as deltas (their mode bytes, then the coded changes), the new m(ξ) — updated from exactly the codes and fp16
        scales the receiver will unpack — the verdicts (whether each row can go as a delta, its checksum sums), the
        fidelity norms per row, and their squares summed over the rows."""
        # m(ξ) is read in its own dtype (promoted exactly, value by value) and the dequantized change, a tensor of
        # this call's own, takes m(ξ) in place (addition commutes bit for bit): no full-size float32 copy of m(ξ) and
        # no sum of its own, which a CUDA graph of this call would keep for the run
        change = x - m_old
        coded, deq = self.delta.encode(change, values=True)
        m_new = present(deq).add_(m_old).to(self.view.dtype)
        del deq  # (in a 16-bit store m_new is a copy: the float32 sum goes now, not at the call's end)
        sums, norms = row_sums(m_new), fidelity_norms(x, m_old, change, m_new)
        ok = self.sendable(self.delta.carried(x, coded), m_new)
        return payload_of(MODE_DELTA, coded), m_new, verdicts_of(ok, sums), norms, norms.double().square_().sum(dim=0)

    def first_rows(self, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """First sights `values`: the payload of a message of them alone (mode bytes, then their coded rows), the
        m(ξ) they seed, and the verdicts (whether each can go so, its checksum sums)."""
        coder = present(self.first_sight)
        coded, deq = coder.encode(values, values=True)
        seeds = present(deq).to(self.view.dtype, copy=True)
        return (payload_of(MODE_FIRST, coded), seeds,
                verdicts_of(self.sendable(coder.carried(values, coded), seeds), row_sums(seeds)))

    def delta_values(self, rows: torch.Tensor, m_old: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The receiver's side of `delta_rows`: the new m(ξ) from the coded rows, it in float32, and the verdicts
        (each row kept — the sender sent a delta only where it could be — and its checksum sums)."""
        seeds = self.delta.decode(rows, tuple(m_old.shape)).add_(m_old).to(self.view.dtype)  # (as the sender's)
        values, sums = seeds.float(), row_sums(seeds)
        return seeds, values, verdicts_of(torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device), sums)

    def seeds(self, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The m(ξ) that `values` seed (a copy in the store's dtype) and their verdicts (whether the store can keep
        each, its checksum sums)."""
        seeds = values.to(self.view.dtype, copy=True)
        return seeds, verdicts_of(self.view.storable_rows(seeds), row_sums(seeds))

    def sendable(self, carried: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """Per row, on the device: the coder carried the row without clipping (its fp16 scales below 65504, a cast
        finite) and the store can keep `stored`."""
        return carried & self.view.storable_rows(stored)
