"""AQ-SGD's delta rows through the fused kernels (`aqpipe.compress.gpu.fused`): which rows they take, and how they run.

In the steady state of a GPU run — m(ξ) a slab's rows on the GPU (`--store-device cuda`), a batch of distinct
samples, the kernels proven in the process so they write m(ξ) in place — each end replays its step from one CUDA
graph (`aqpipe.compress.gpu.cuda_graphs`, the slab held where it lies): the kernels' launches, their buffers'
allocations and the mode bytes' fill become one replay, for one copy into the graph from the host: the step's
index — the slots, where the store's index made them, then the addresses of the activation (or of the received
rows and of the decoded activation). The kernels read and write those where the caller has them (`fused.addressable`):
no 18.9 MB copy in or out at SmolLM2's 8 × 1024 × 576, where a message's time on an H100 was its host's calls, a
quarter of them Triton's launcher, against ~215 µs of device time a pair, 36 of them those two copies
(benchmarks/README.md).
Elsewhere — m(ξ) in host RAM or per-sample tensors, a sample twice in a batch, the first messages — the kernels are
launched one by one, as the graph replays them: the bits are the same either way.
"""

from __future__ import annotations

import array
import functools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from aqpipe.compress.gpu import fused
from aqpipe.compress.gpu.copies import to_device
from aqpipe.compress.gpu.cuda_graphs import graphed
from aqpipe.compress.gpu.graph_memory import GraphCall, stand_in
from aqpipe.compress.link.aqsgd_rows import MODE_DELTA
from aqpipe.compress.link.checksum import CHECKSUM_WEIGHTS
from aqpipe.compress.link.sample_coders import QuantCoder, SampleCoder

Step = Callable[..., tuple[torch.Tensor, ...]]


class KernelsFailed(RuntimeError):
    """The fused kernels failed before writing anything: the torch ops can still take the message."""


@dataclass(frozen=True)
class FusedDelta:
    """One link end's fused delta step: its coder's `bits` and `grid`, and the key its graphs are filed under
    (None: never replayed from a graph, as where a part of the codec rounds stochastically)."""

    bits: int
    grid: str
    graphs: Hashable | None

    def encode(self, x: torch.Tensor, m: torch.Tensor, slots: list[int] | None, ids: list[int], lend: bool
               ) -> tuple | None:
        """The sender's step on rows `x` of samples `ids`, m(ξ) in `m` (`slots`: a slab's rows; None: `m` is the
        batch's m(ξ) gathered): (payload, new m(ξ) or None where written in place, verdicts, norms, squares, lent —
        whether they are a graph's buffers, see `graphed`'s borrow); None if the kernels failed before writing
        anything. Replayed from the step's graph, the slots go from the host straight into its buffer, with the
        activation's address after them (`fused.addressable`: no copy of it into the graph; one not contiguous, or
        of 8-byte elements, is copied in)."""
        if slots is not None and self._replays(slots, ids, "encode", m.device):
            done = self._graphed("encode", encode_in_place, slots, (x,), m, lend)
            return None if done is None else (done[0], None, *done[1:], lend)
        at = None if slots is None else to_device(_index(slots), m.device)  # (launched one by one: on the slab's GPU)
        coded = fused.delta_encode(x, m, at, self.bits, self.grid, CHECKSUM_WEIGHTS, MODE_DELTA,
                                   in_place=writable(slots, ids))
        if coded is None:
            return None
        return coded.payload, coded.m_new, coded.verdicts, coded.norms, coded.squares, False

    def decode(self, rows: torch.Tensor, m: torch.Tensor, slots: list[int] | None, ids: list[int],
               batch: tuple[int, ...], lend: bool) -> tuple | None:
        """The receiver's step on coded rows `rows` of samples `ids` (`batch`: their activation's shape; `m`,
        `slots` as `encode`): (new m(ξ) or None where written in place, the activation — a tensor of its own, which
        a replayed graph writes where its address in the step's index says: no copy of it out of the graph —,
        verdicts, lent); None if the kernels failed before writing anything. The graph reads the rows where they
        lie too (where `fused.addressable`), through their address in the index."""
        if slots is not None and self._replays(slots, ids, "decode", m.device):
            out = torch.empty(batch, dtype=torch.float32, device=m.device)  # (always `fused.addressable`)
            done = self._graphed("decode", decode_in_place, slots, (rows, out), m, lend)
            return None if done is None else (None, out, done[0], lend)
        at = None if slots is None else to_device(_index(slots), m.device)
        decoded = fused.delta_decode(rows, m, at, batch, self.bits, self.grid, CHECKSUM_WEIGHTS,
                                     in_place=writable(slots, ids))
        return None if decoded is None else (*decoded, False)

    def graph_calls(self, shape: tuple[int, ...], m_dtype: torch.dtype, sending: bool) -> list[GraphCall]:
        """The graph this end replays for delta rows of `shape` where m(ξ) is a slab's rows on its GPU, on stand-in
        inputs: its index alone (the slab is the store's; the activation, and a receiver's rows, the caller's,
        reached through their addresses in the index)."""
        slab, activation = stand_in(shape, m_dtype), stand_in(shape, torch.float32)
        if sending:
            run = functools.partial(encode_in_place, self.bits, self.grid, 1)
            index = stand_in((shape[0] + 1,), torch.int64)
            return [GraphCall("fused-encode", lambda at: run(at, activation, slab), (index,), self._key("encode"))]
        run = functools.partial(decode_in_place, self.bits, self.grid, 2)
        index = stand_in((shape[0] + 2,), torch.int64)
        coded = stand_in((shape[0], fused.row_bytes(math.prod(shape[1:-1]), shape[-1], self.bits)), torch.uint8)
        return [GraphCall("fused-decode", lambda at: run(at, coded, activation, slab), (index,), self._key("decode"))]

    def _graphed(self, step: str, fn: Step, slots: list[int], reached: tuple[torch.Tensor, ...], slab: torch.Tensor,
                 lend: bool) -> tuple[torch.Tensor, ...] | None:
        """`fn` (`encode_in_place`, `decode_in_place`) over the slab's rows `slots`, replayed from this end's graph of
        `step` where it may be; None if the kernels failed before writing anything. `fn` is given how many tensors
        it reaches through its index, then its index (the slots, then the addresses of the last of `reached` that
        `fused.addressable` allows: the graph reaches them there), then `reached` — those before them copied into
        the graph — and the slab."""
        copied = len(reached)
        while copied and fused.addressable(reached[copied - 1]):
            copied -= 1
        moved = reached[copied:]
        try:
            return graphed(self._key(step), functools.partial(fn, self.bits, self.grid, len(moved)),
                           _index(slots, *moved), *reached[:copied], addressed=moved, held=(slab,), borrow=lend)
        except KernelsFailed:
            return None

    def _key(self, step: str) -> tuple[Hashable, str]:
        """The key this end's graph of `step` is filed under (the codec's, so that it goes with the codec)."""
        return self.graphs, f"fused-{step}"

    def _replays(self, slots: list[int], ids: list[int], step: str, device: torch.device) -> bool:
        """Whether this step, over a slab's rows, runs from its graph: rows it writes in place (distinct, the
        kernels proven in the process)."""
        return self.graphs is not None and writable(slots, ids) and fused.writes_in_place(step, device)


def fused_delta(delta: SampleCoder, device: torch.device, shape: tuple[int, ...], m_dtype: torch.dtype,
                graphs: Hashable | None) -> FusedDelta | None:
    """The fused step of delta coder `delta` for delta rows of `shape` on `device`, m(ξ) in `m_dtype` (`graphs`:
    see `FusedDelta`): where `fused.delta_fusable` says, for a nearest-rounding `QuantCoder`; else None. Each end
    decides on its own delta rows, so on a message mixing kinds of rows the two ends of a link may decide
    differently: the bits are the same either way."""
    if type(delta) is not QuantCoder or delta.options.stochastic:
        return None
    options = delta.options
    if not fused.delta_fusable(device, shape, m_dtype, delta.bits, options.per, options.grid):
        return None
    return FusedDelta(delta.bits, options.grid, graphs)


def writable(slots: list[int] | None, ids: list[int]) -> bool:
    """Whether the fused kernels may write the new m(ξ) of `ids` over the old: rows of a slab (`slots`), one per
    sample (a sample twice in a batch would have two programs write one row)."""
    return slots is not None and len(set(ids)) == len(ids)


def encode_in_place(bits: int, grid: str, moved: int, index: torch.Tensor, x: torch.Tensor, slab: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:
    """The sender's fused step over a slab's rows, the new m(ξ) written over the old: (payload, verdicts, norms,
    squares), as a graph captures it (`index`: the rows' slots, then — with `moved` 1 — the address x is read at);
    KernelsFailed if they failed before writing anything."""
    coded = fused.delta_encode(x, slab, index, bits, grid, CHECKSUM_WEIGHTS, MODE_DELTA, in_place=True,
                               x_moved=moved == 1)
    if coded is None:
        raise KernelsFailed("the fused delta kernels failed")  # (in a capture: graphs go off, the step runs again)
    return coded.payload, coded.verdicts, coded.norms, coded.squares


def decode_in_place(bits: int, grid: str, moved: int, index: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                    slab: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The receiver's fused step over a slab's rows, the new m(ξ) written over the old and the activation at the
    address `index` ends with (`out`: a tensor of its layout): (verdicts,), as a graph captures it; KernelsFailed if
    they failed before writing anything. `index`: the rows' slots, then — with `moved` 2 — the rows' address, then
    the activation's (`moved` 1: the activation's alone)."""
    if moved < 1:
        raise ValueError("the decoded activation is written at an address in the index, which must carry it")
    decoded = fused.delta_decode(rows, slab, index, tuple(out.shape), bits, grid, CHECKSUM_WEIGHTS, in_place=True,
                                 into=out, rows_moved=moved == 2)
    if decoded is None:
        raise KernelsFailed("the fused delta kernels failed")
    return (decoded[2],)


def _index(slots: list[int], *moved: torch.Tensor) -> torch.Tensor:
    """The fused step's index on the host: the rows' slots, then the address of each of `moved` (the tensors its
    kernels reach there, see `fused.addressable`)."""
    # (over an array's buffer: about half torch.tensor's time from a list, on a GPU message's host path)
    return torch.frombuffer(array.array("q", [*slots, *(t.data_ptr() for t in moved)]), dtype=torch.int64)
