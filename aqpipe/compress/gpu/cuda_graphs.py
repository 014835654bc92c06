"""CUDA graphs for the codecs' kernels: a message's quantize, pack, unpack and m(ξ) arithmetic replayed as one
launch on a GPU.

At the size of one micro-batch's activation a codec's time on a GPU is its kernels' launches, not their arithmetic
(AQ-SGD's encode is ~70 small kernels, each ~5 µs to launch, for a few µs of work), and AQ-SGD's host must read
each message's verdicts before it sends, so none of that launch time hides behind the model's compute. A pure
tensor function of fixed shapes — which every coder's core is — is captured once per input signature and replayed:
the same kernels on the same inputs, so the same bits as running it op by op (the GPU tests compare them).

`graphed(key, fn, *tensors)` runs `fn(*tensors)` (a tuple of tensors out): directly on the host, on the first call
of a signature, where graphs are switched off (`AQPIPE_CUDA_GRAPHS=0`) or where a capture failed; replayed from a
graph otherwise. Inputs are copied into the graph's own buffers and outputs copied out of them, so a caller keeps
what it was given across later calls. `fn` must be a pure function of its tensors and the `key` (nothing it reads
may change between calls: no random numbers, no host values), and must not wait for the device — save for tensors
it is given as `held` (a slab of m(ξ) that AQ-SGD's fused step reads and writes in place), which a graph reads and
writes where they lie, never copied, and `addressed` ones (an activation), reached at each call where the address
fed among its inputs says. A capture that fails anyway turns graphs off for the rest of the process, with a
warning: a failed capture can leave the CUDA allocator's bookkeeping behind, and the codecs are only faster with
graphs, never different.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

log = logging.getLogger(__name__)

HOST = torch.device("cpu")
SWITCH = "AQPIPE_CUDA_GRAPHS"  # "0" turns every graph off: each call runs op by op
MAX_GRAPHS = 64  # signatures kept per process; past it, new ones run op by op (each graph holds its own buffers)
# An addressed tensor's offset from a boundary of this many bytes is part of a graph's signature: a kernel reaching it
# through an address may take the shift from the tensor it was captured with as a multiple of it (`fused`'s do).
ADDRESS_GRAIN = 64

Signature = tuple[Hashable, ...]


@dataclass
class _Graph:
    """One captured call: its graph, the buffers it reads and the outputs it writes."""

    graph: Any  # a torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Cache:
    """The process's graphs by signature; signatures seen once (the next call captures); whether a capture failed
    (every call runs op by op from then on) or the limit was reached (new signatures do)."""

    graphs: dict[Signature, _Graph] = field(default_factory=dict)
    seen: set[Signature] = field(default_factory=set)
    failed: bool = False
    full: bool = False
    streams: dict[torch.device, Any] = field(default_factory=dict)  # each device's one capturing stream
    version: int = 0  # counts the graphs added and dropped (what `held_on` last measured is good until it moves)
    measured: tuple[int, torch.device, int] | None = None  # (version, device, bytes): `held_on`'s last answer
    # reentrant: a codec's finalizer (`forget`) may run in a garbage collection inside a capture, which holds it
    lock: threading.RLock = field(default_factory=threading.RLock)


_cache = _Cache()
_capturing = threading.local()  # set while this thread captures: a graphed call inside runs inline
_unreplayed = threading.local()  # set inside `op_by_op` on this thread


def enabled() -> bool:
    """Whether codecs replay CUDA graphs (on by default; `AQPIPE_CUDA_GRAPHS=0` turns them off)."""
    return os.environ.get(SWITCH, "1") != "0"


def graphed(key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]], *tensors: torch.Tensor, borrow: bool = False,
            held: tuple[torch.Tensor, ...] = (), addressed: tuple[torch.Tensor, ...] = ()
            ) -> tuple[torch.Tensor, ...]:
    """`fn(*tensors)`, replayed from a CUDA graph where the tensors are on one GPU (some may be on the host beside
    them: fed, see below) and this signature (key, each tensor's shape, strides, dtype and device, the current
    stream) has run before; `key` names `fn` and every non-tensor value it depends on. Every tensor `fn` reads
    besides its arguments (a level table) must live as long as the process, or as long as the graphs of its key
    (`forget`): a graph reads it where it was at capture.

    A tensor given on the host, beside tensors on a GPU, is fed: copied straight into the graph's buffer, rather
    than moved to the GPU by the caller and copied again — a copy and an allocation saved (AQ-SGD's slots). The host
    does not wait for the GPU: pageable memory is staged by the driver before the call returns (it may be written at
    once), pinned memory is read later (it must not be written until the copy is done). Run op by op, `fn` gets it
    moved to the GPU. Not inside another graph's capture, where a copy from the host cannot be captured. (Worth it
    for what the host makes just before the call: a large input that could have been on its way meanwhile — a
    received message's rows — is better sent to the GPU as early as it can be.)

    With `borrow`, a replay returns the graph's own output buffers, not copies: the caller must have queued every use
    of them on the current stream (a copy, a scatter, a read) before it calls this signature again, whose replay
    writes them anew — a copy call saved per output. The graph's lock covers its replay, not those uses: only a
    signature that one thread calls (a codec's own, on its compute thread) may be borrowed.

    `held` tensors (a slab of m(ξ) that `fn` reads and writes in place) are passed to `fn` after `tensors` and never
    copied: a graph reads and writes them where they lay at its capture, so their addresses are part of the
    signature (a graph of the same call on tensors that have since moved — a slab that grew — is dropped). Since `fn`
    then changes what it is given, a capture does not run it first on the capturing stream (it would run twice): the
    signature's first, uncaptured call must make all it needs, so it runs on copies of `tensors`, as the capture
    will. (A Triton kernel is compiled and loaded per alignment of its pointers: given a message's rows at an odd
    offset in its payload, and their copy in the capture, it would be compiled inside the capture, which fails —
    seen on an H100 — and a failed capture leaves the allocator holding back frees for the process's life.)

    `addressed` tensors (AQ-SGD's activation in, or the place its decoded activation goes) are passed to `fn` after
    `tensors` and before `held`, never copied either, but may lie elsewhere at each call: `fn` must reach them only
    through addresses it reads from `tensors` (a replay runs the kernels captured with the capture's tensors, which
    move themselves to the address given). Their layouts are part of the signature, and each one's offset from an
    `ADDRESS_GRAIN` boundary (Triton compiles a kernel per alignment of its pointers), not their addresses: a copy
    in or out saved per call."""
    device = _device_of(tensors + addressed + held)
    passed = addressed + held  # (given to `fn` as they are)
    if (not may_replay(device) or any(t.device != device for t in passed)
            or any(t.device != device and t.device != HOST for t in tensors) or getattr(_capturing, "now", False)):
        # (inside another graph's capture: its kernels become part of that graph)
        return fn(*(_on(device, t) for t in tensors), *passed)
    signature = (key, _stream_id(device), tuple(_layout(t) for t in tensors),
                 tuple((_layout(t), t.data_ptr() % ADDRESS_GRAIN) for t in addressed),
                 tuple((t.data_ptr(), _layout(t)) for t in held))
    entry = _cache.graphs.get(signature)
    if entry is None:
        entry, first = _first_calls(signature, fn, tensors, passed)
        if entry is None:
            if first and passed:  # (copies, as the capture will have: see above)
                return fn(*(_copy_on(device, t) for t in tensors), *passed)
            return fn(*(_on(device, t) for t in tensors), *passed)
    with entry.lock:  # one thread at a time fills the buffers, replays and copies out
        for buffer, t in zip(entry.inputs, tensors):
            buffer.copy_(t, non_blocking=True)  # (from the host: fed without the host waiting)
        entry.graph.replay()
        return entry.outputs if borrow else tuple(out.clone() for out in entry.outputs)


def _device_of(tensors: tuple[torch.Tensor, ...]) -> torch.device:
    """The device a graphed call runs on: that of its first tensor off the host, else the host."""
    return next((t.device for t in tensors if t.device != HOST), tensors[0].device)


def _on(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """`t` on `device`: moved there where it was fed from the host (as `graphed` says, the host does not wait)."""
    return t if t.device == device else t.to(device, non_blocking=True)


def _copy_on(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` of its own on `device` (a buffer of the graph's, or what the signature's first call runs on)."""
    return t.clone() if t.device == device else t.to(device, non_blocking=True)


def _layout(t: torch.Tensor) -> tuple[Hashable, ...]:
    """What a graph's kernels depend on in a tensor they are given: its shape, strides, dtype and device."""
    return tuple(t.shape), t.stride(), t.dtype, t.device


def may_replay(device: torch.device) -> bool:
    """Whether a graphed call on `device` may return a graph's buffers (see `graphed`'s `borrow`)."""
    return _replays_on(device) and enabled() and not _cache.failed and not getattr(_unreplayed, "on", False)


@contextlib.contextmanager
def op_by_op() -> Iterator[None]:
    """Within it, every graphed call of this thread runs op by op, capturing and replaying nothing: for calls whose
    shapes change from message to message (a padded batch's real rows, grouped by length), each of which would
    capture a graph of its own, with buffers of its own, to replay it seldom if ever."""
    before = getattr(_unreplayed, "on", False)
    _unreplayed.on = True
    try:
        yield
    finally:
        _unreplayed.on = before


def _replays_on(device: torch.device) -> bool:
    """Whether work on `device` can be captured (a CUDA GPU)."""
    return device.type == "cuda"


def _stream_id(device: torch.device) -> int:
    """The stream the caller's work goes to (a graph is replayed on the stream it was made for): its raw handle, as
    Triton's launcher reads it (no Stream object made per call)."""
    return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())


def _raw_stream_reader() -> Callable[[int], int]:
    """torch's reader of a GPU's current raw stream handle (a CUDA build's), else one through a Stream object."""
    try:
        from torch._C import _cuda_getCurrentRawStream
    except ImportError:  # (a CPU build of torch: no GPU to ask, but the tests' stand-ins do not ask either)
        return lambda index: torch.cuda.current_stream(index).cuda_stream
    return _cuda_getCurrentRawStream


_raw_stream = _raw_stream_reader()


def _first_calls(signature: Signature, fn: Callable[..., tuple[torch.Tensor, ...]],
                 tensors: tuple[torch.Tensor, ...], passed: tuple[torch.Tensor, ...] = ()
                 ) -> tuple[_Graph | None, bool]:
    """The signature's graph, captured at its second call (replacing every graph of the same call whose held tensors
    lay elsewhere: see `_moved`), and whether this is its first call; no graph for the first call (run op by op: it
    fills the caches `fn` reads, such as level tables, which a capture could not), after a failed capture, or past
    `MAX_GRAPHS`. `passed`: the tensors `fn` gets as they are (`graphed`'s addressed and held)."""
    with _cache.lock:
        if signature in _cache.graphs:
            return _cache.graphs[signature], False
        if _cache.failed:
            return None, False
        if signature not in _cache.seen:
            _cache.seen.add(signature)
            return None, True
        moved = [s for s in _cache.graphs if _moved(s, signature)]
        if len(_cache.graphs) - len(moved) >= MAX_GRAPHS:
            if not _cache.full:
                _cache.full = True
                log.warning("%d codec CUDA graphs held: further message shapes run their codec op by op",
                            MAX_GRAPHS)
            return None, False
        _capturing.now = True
        try:
            entry = _capture(fn, tensors, passed)
        except Exception as e:
            _cache.failed = True
            log.warning("codec kernels run op by op from now on: the CUDA graph capture of %s failed (%s: %s)",
                        signature[0], type(e).__name__, e)
            return None, False
        finally:
            _capturing.now = False
        for old in moved:  # (each reads and writes memory that is no longer the held tensors')
            del _cache.graphs[old]
        _cache.graphs[signature] = entry
        _cache.version += 1
        return entry, False


def _moved(old: Signature, new: Signature) -> bool:
    """Whether the graph of signature `old` is of the same call as `new` (key, stream, inputs' and addressed tensors'
    layouts, whatever the latter's offsets, as many held tensors) over held tensors that have since moved (a slab
    that grew)."""
    if not len(old) == len(new) == 5 or old[:3] != new[:3]:
        return False
    (old_addressed, old_held), (new_addressed, new_held) = cast(tuple, old[3:]), cast(tuple, new[3:])
    return (len(old_held) == len(new_held) > 0 and old_held != new_held
            and [layout for layout, _ in old_addressed] == [layout for layout, _ in new_addressed])


def _capture(fn: Callable[..., tuple[torch.Tensor, ...]], tensors: tuple[torch.Tensor, ...],
             passed: tuple[torch.Tensor, ...] = ()) -> _Graph:
    """Capture `fn` on copies of `tensors` (and on `passed` as they are: `graphed`'s addressed and held tensors), on
    a side stream ordered after the caller's stream's work so far. No device-wide synchronize (torch.cuda.graph's
    own), which would stall every stream of a training step."""
    stream = torch.cuda.current_stream(_device_of(tensors + passed))
    side = _capturing_stream(stream.device)
    side.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        inputs = tuple(_copy_on(side.device, t) for t in tensors)
        if not passed:  # a warm-up on the capturing stream: library workspaces are made here, not inside the capture
            fn(*inputs)
        # thread_local: other threads' CUDA calls (the outbox's copies, the prefetchers) go on meanwhile
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            outputs = tuple(fn(*inputs, *passed))
        except BaseException:
            _end_failed(graph, stream.device)
            raise
        try:
            graph.capture_end()
        except BaseException:
            _stop_allocating_to(graph, stream.device)
            _release_generators(stream.device)
            raise
    stream.wait_stream(side)
    for t in tensors:  # the inputs' memory must not be reused before the side stream's copies of them are done
        if t.device == side.device:  # (a host tensor's copy: pinned memory's is recorded by the copy itself)
            t.record_stream(side)
    return _Graph(graph, inputs, outputs)


def _capturing_stream(device: torch.device) -> Any:
    """The device's one stream for captures, made at the first (as torch.cuda.graph keeps one): a new stream per
    capture would cycle through torch's shared pool, and sooner or later capture on a stream a collective uses."""
    if device not in _cache.streams:
        _cache.streams[device] = torch.cuda.Stream(device)
    return _cache.streams[device]


def _end_failed(graph: Any, device: torch.device) -> None:
    """End a capture that `fn` broke off, so the stream leaves capture mode (ending an invalidated capture raises,
    and then the allocator still routes this thread's allocations to the graph's pool: stopped here)."""
    try:
        graph.capture_end()
    except Exception:
        _stop_allocating_to(graph, device)
        _release_generators(device)


def _stop_allocating_to(graph: Any, device: torch.device) -> None:
    """What torch's capture_end does after a successful end, done after a failed one: the caching allocator stops
    counting this capture as underway (else it would defer every stream-recorded free for the process's life).
    Best effort: a private torch call, absent or refusing in some versions. Not enough on torch 2.11 (an H200 and an
    H100 showed it): a capture broken off before its end also stays counted as active in the allocator, which no
    Python call undoes (pytorch/pytorch#190308), so after one failed capture stream-recorded frees are held back —
    one more reason graphs go off for the process at the first failure."""
    try:
        torch._C._cuda_endAllocateToPool(device.index if device.index is not None else torch.cuda.current_device(),
                                         graph.pool())
    except Exception as e:
        log.debug("after a failed capture the allocator's pool could not be closed: %s", e)


def _release_generators(device: torch.device) -> None:
    """What torch's capture_end does after a successful end, done after a failed one: the device's default random
    generator, which every capture registers, leaves capture mode (else the next random draw outside a graph raises
    "Offset increment outside graph capture encountered unexpectedly" — seen on an H100 after a failed capture). Its
    state is replaced by a copy of itself: the same seed and offset, out of capture mode. Best effort, as above."""
    try:
        generator = torch.cuda.default_generators[device.index if device.index is not None
                                                  else torch.cuda.current_device()]
        generator.graphsafe_set_state(generator.clone_state())
    except Exception as e:
        log.debug("after a failed capture the random generator could not be reset: %s", e)


def forget(owner: Hashable) -> None:
    """Drop the graphs of every key `(owner, …)`: a codec that ends takes its graphs' memory with it."""
    def owned(signature: Signature) -> bool:
        return isinstance(signature[0], tuple) and signature[0][:1] == (owner,)

    with _cache.lock:
        for signature in [s for s in _cache.graphs if owned(s)]:
            del _cache.graphs[signature]
            _cache.version += 1
        _cache.seen = {s for s in _cache.seen if not owned(s)}


def device_bytes() -> dict[Hashable, int]:
    """Device bytes the graphs of each key hold (their memory pools' segments and their inputs' copies), as the CUDA
    caching allocator reports them: what `aqpipe.compress.gpu.graph_memory` predicts, measured."""
    pools: dict[tuple[int, ...], int] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        pools[pool] = pools.get(pool, 0) + segment["total_size"]
    held: dict[Hashable, int] = {}
    with _cache.lock:
        for signature, entry in _cache.graphs.items():
            inputs = sum(t.untyped_storage().nbytes() for t in entry.inputs)
            held[signature[0]] = held.get(signature[0], 0) + pools.get(tuple(entry.graph.pool()), 0) + inputs
    return held


def held_on(device: torch.device) -> int:
    """Device bytes this process's graphs hold (`device_bytes`, summed: a rank's graphs are all on its one GPU); 0
    off a GPU. Measured again only after a graph was added or dropped: a memory snapshot walks the allocator."""
    cache = _cache  # (one cache throughout: `clear` may replace it meanwhile)
    if device.type != "cuda" or not cache.graphs:
        return 0
    if cache.measured is None or cache.measured[:2] != (cache.version, device):
        cache.measured = (cache.version, device, sum(device_bytes().values()))
    return cache.measured[2]


def captured() -> int:
    """How many graphs this process holds (for tests and logs)."""
    return len(_cache.graphs)


def stopped() -> str | None:
    """Why this process captures no new graph, or None while it would: after a failed capture every graphed call
    runs op by op; while `MAX_GRAPHS` are held (and a signature was turned away) a signature not among them does —
    until `forget` drops some (for benchmarks: a codec timed meanwhile may not be timed on its graphs)."""
    if _cache.failed:
        return "a capture failed: every graphed call runs op by op"
    if _cache.full and len(_cache.graphs) >= MAX_GRAPHS:
        return f"{MAX_GRAPHS} graphs held: a signature not among them runs op by op"
    return None


def clear() -> None:
    """Drop every graph and forget a failed capture (tests; a process that changes device)."""
    global _cache
    _cache = _Cache()
