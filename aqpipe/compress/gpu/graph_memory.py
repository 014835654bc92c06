"""What the codecs' CUDA graphs hold on a GPU, worked out on the meta device, for the capacity plan.

A captured call (`aqpipe.compress.gpu.cuda_graphs`) keeps, for its codec's life, copies of its inputs and a memory pool
of its own, which holds every block the call had allocated at the moment it held the most — its outputs included —
since a pool lends its blocks to no other graph and no other tensor. A codec names the calls a message of a given
shape may replay (`LinkCodec.graph_calls`); each runs here on meta tensors, once to make the caches it reads (as the
first, uncaptured call does on a GPU), then once more while every storage its ops create is counted from its first
op to the death of its last tensor, block and segment sizes as CUDA's caching allocator makes them. The fused
Triton kernels take the meta device as a GPU and make their outputs there without running (`aqpipe.compress.gpu.fused`),
so the count follows the path a GPU takes. It is an estimate: a kernel's own workspace and the allocator's
fragmentation are not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# How CUDA's caching allocator sizes what it holds: blocks rounded up to 512 bytes, those of 10 MiB or more to 2 MiB;
# blocks up to 1 MiB cut from 2 MiB segments, those up to 10 MiB from 20 MiB segments. A graph's pool is its own,
# so each graph holds, beyond its blocks at their peak, up to one part-used segment of each size it cut blocks from.
BLOCK, LARGE_BLOCK, LARGE = 512, 2 << 20, 10 << 20
SMALL, SMALL_SEGMENT, MID_SEGMENT = 1 << 20, 2 << 20, 20 << 20


@dataclass(frozen=True)
class GraphCall:
    """One call a codec may replay as a CUDA graph: its name, its function (a pure function of its tensors, as
    `graphed` requires), stand-in inputs of the shapes and dtypes a message gives it (meta tensors), and the key
    `graphed` files it under (calls of one key and input shapes share one graph; None: a graph of its own)."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, ...]]
    inputs: tuple[torch.Tensor, ...]
    key: Hashable = None

    def signature(self) -> Hashable:
        """What names this call's graph: its key and its inputs' shapes and dtypes (None key: the call itself)."""
        shapes = tuple((tuple(t.shape), t.dtype) for t in self.inputs)
        return (id(self), shapes) if self.key is None else (self.key, shapes)


def stand_in(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` with no memory behind it, to run a graph's call on."""
    return torch.empty(shape, dtype=dtype, device="meta")


def held_bytes(call: GraphCall) -> int:
    """Device bytes the graph of `call` holds once captured: its inputs' copies and the most its ops held at once."""
    call.fn(*call.inputs)  # (the caches it reads: made by the first call, which no graph captures)
    meter = LiveBytes(call.inputs)
    with meter:
        outputs = call.fn(*call.inputs)
    del outputs
    inputs = sum(_rounded(t.untyped_storage().nbytes()) for t in call.inputs)
    segments = SMALL_SEGMENT * any(n <= SMALL for n in meter.sizes)
    segments += MID_SEGMENT * any(SMALL < n < LARGE for n in meter.sizes)
    return inputs + meter.peak + segments


def graphs_bytes(calls: list[GraphCall]) -> int:
    """Device bytes the graphs of `calls` hold together: each pool is its own, and calls of one signature share a
    graph (a coder's, used by two link ends of a rank)."""
    unique = {call.signature(): call for call in calls}
    return sum(held_bytes(call) for call in unique.values())


def _rounded(nbytes: int) -> int:
    """A block's size as the allocator holds it."""
    unit = LARGE_BLOCK if nbytes >= LARGE else BLOCK
    return max(BLOCK, -(-nbytes // unit) * unit)


def _key(t: torch.Tensor) -> int:
    """A storage's identity (views share it)."""
    return t.untyped_storage()._cdata


@dataclass
class _Storage:
    """A storage the metered call made: its block's size, and how many of its tensors are alive."""

    nbytes: int
    tensors: int = 0


class LiveBytes(TorchDispatchMode):
    """The most bytes of storage the ops run under it held at once, and the block sizes they made: a storage counts
    from the op that made it until the last tensor on it dies; views of tensors from outside (the inputs, cached
    tables) count nothing."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self._live: dict[int, _Storage] = {}
        self._outside = {_key(t) for t in inputs}
        self.now = self.peak = 0
        self.sizes: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = self._outside | {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, given)
        return out

    def _track(self, t: torch.Tensor, given: set[int]) -> None:
        key = _key(t)
        storage = self._live.get(key)
        if storage is None:
            if key in given:  # a view of, or an in-place op on, a tensor this call did not make
                return
            storage = self._live[key] = _Storage(_rounded(t.untyped_storage().nbytes()))
            self.sizes.add(storage.nbytes)
            self.now += storage.nbytes
            self.peak = max(self.peak, self.now)
        storage.tensors += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        storage = self._live[key]
        storage.tensors -= 1
        if storage.tensors == 0:
            self.now -= storage.nbytes
            del self._live[key]
