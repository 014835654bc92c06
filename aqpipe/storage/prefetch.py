"""Prefetch and write-behind around a message store, so disk reads and writes of m(ξ) hide behind compute.

`prefetch(link, side, ids)` loads the m(ξ) of coming micro-batches on a reader thread; `put` returns once the value
is queued and a single writer thread persists values in the order they were put. Reads always see the newest value,
and exactly the value the disk will hold: `put` encodes a value the way the backend stores it (a low-bit store
quantizes it) on the calling thread, keeps what those bytes decode to in the pending table, and the writer stores
those very bytes — so a read before and after the write lands returns the same bits, whenever each side of a link
flushes. A read still in flight when its key is written or deleted is marked stale and never installed. The writer
queue is bounded: a producer that runs ahead of the disk waits (backpressure) instead of growing memory.

A GPU's values (`put`, `scatter`) reach the host as one queued copy into pinned memory, and the store's next call
that reads or writes (`_land`) waits for it — by then long done — and encodes and queues them as above (the
encoding, and any wait for the writer, happen there): the host never waits for the GPU to store m(ξ).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from aqpipe.compress.gpu.copies import Landing, to_host
from aqpipe.storage.base import on_device
from aqpipe.storage.memory import crosses_to_the_host, from_a_gpu

Key = tuple[int, str, int]
MAX_QUEUED_WRITES = 16  # put batches (one micro-batch of one link each) waiting for the disk


class PrefetchingStore:
    """A MessageStore that reads ahead and writes behind on background threads."""

    def __init__(self, backend, max_queued_writes: int = MAX_QUEUED_WRITES) -> None:
        self.backend = backend
        self.dtype = backend.dtype
        self.stats = backend.stats
        self._lock = threading.Lock()
        self._sequence = itertools.count(1)
        self._pending: dict[Key, tuple[int, torch.Tensor]] = {}  # written, not yet on disk: (put number, value)
        self._cache: dict[Key, torch.Tensor | None] = {}  # prefetched: value, or None for absent/damaged
        self._stale: set[Key] = set()  # reads in flight that a put or delete overtook
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mstore-read")
        self._inflight: dict[Key, Future] = {}
        self._writes: queue.Queue = queue.Queue(maxsize=max_queued_writes)
        self._write_error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="mstore-write", daemon=True)
        self._writer.start()
        # the last put of a GPU's values, still crossing to the host: (link, side, ids, host batch, its copy)
        self._crossing: tuple[int, str, list[int], torch.Tensor, Landing | None] | None = None

    @property
    def step(self) -> int:
        return getattr(self.backend, "step", 0)

    @step.setter
    def step(self, value: int) -> None:
        self.backend.step = value

    # -- reading ---------------------------------------------------------------------------------------------------
    def prefetch(self, link: int, side: str, ids: Sequence[int]) -> None:
        """Start loading the m(ξ) of `ids` in the background."""
        with self._lock:
            keys = [(link, side, int(i)) for i in ids]
            crossing = self._crossing_keys()
            todo = [k for k in keys if k not in self._pending and k not in self._cache and k not in self._inflight
                    and k not in crossing]
            for key in todo:
                self._inflight[key] = self._reader.submit(self._load, key)

    def _load(self, key: Key) -> None:
        try:
            value = self.backend.get(key[0], key[1], [key[2]])[0]
        except KeyError:  # absent or damaged: the codec will send this sample at full precision
            value = None
        with self._lock:
            self._inflight.pop(key, None)
            if key in self._stale:  # a put or delete came after this read started: its value is not current
                self._stale.discard(key)
            else:
                self._cache[key] = value

    def _lookup(self, key: Key) -> tuple[bool, torch.Tensor | None]:
        """(known, value) from the pending writes or the prefetch cache; (False, None) if neither has the key."""
        with self._lock:
            if key in self._pending:
                return True, self._pending[key][1]
            if key in self._cache:
                return True, self._cache[key]
            future = self._inflight.get(key)
        if future is not None:
            future.result()
            return self._lookup(key)
        return False, None

    def contains(self, link: int, side: str, ids: Sequence[int]) -> list[bool]:
        self._land()
        found = []
        for i in ids:
            known, value = self._lookup((link, side, int(i)))
            if known:
                found.append(value is not None)
                if value is not None:
                    self.stats.hits += 1
                else:
                    self.stats.misses += 1
            else:
                found.append(self.backend.contains(link, side, [i])[0])
        return found

    def get(self, link: int, side: str, ids: Sequence[int]) -> list[torch.Tensor]:
        self._land()
        out = []
        for i in ids:
            key = (link, side, int(i))
            known, value = self._lookup(key)
            if not known:
                value = self.backend.get(link, side, [i])[0]
            elif value is None:
                raise KeyError(f"no sound m(xi) for link {link} side {side} sample {int(i)}")
            with self._lock:
                self._cache.pop(key, None)  # consumed: the next read of this sample comes after its next put
            out.append(value)
        return out

    # -- writing ---------------------------------------------------------------------------------------------------
    def storable_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Whether each row of a batch survives the backend's encoding, as a bool tensor on its device."""
        return self.backend.storable_rows(values)

    def put(self, link: int, side: str, ids: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        """Make the values visible to reads — as the store will hold them — and queue them for the disk, waiting
        while the writer is MAX_QUEUED_WRITES batches behind; a GPU's values cross to the host first (see above)."""
        if crosses_to_the_host(values, torch.device("cpu")):
            self.scatter(link, side, ids, torch.stack(list(values)))
            return
        self._raise_write_error()
        self._land()
        self._keep(link, side, ids, on_device(values, "cpu"))

    def scatter(self, link: int, side: str, ids: Sequence[int], values: torch.Tensor) -> None:
        """`put` of the rows of `values` [B, ...], copied (the caller may reuse `values` once its stream has passed
        this call): a GPU's batch crosses to the host in one queued copy, landed by the next call."""
        self._raise_write_error()
        self._land()
        if not from_a_gpu(values):
            self._keep(link, side, ids, [v.clone() for v in values.unbind(0)])
            return
        host, ready = to_host(values)
        self._crossing = (link, side, [int(i) for i in ids], host, ready)

    def _raise_write_error(self) -> None:
        if self._write_error is not None:
            raise self._write_error

    def _land(self) -> None:
        """Finish the last crossing of a GPU's values: wait for its copy, then keep pageable copies of them (a queued
        write holds its values until the disk has them: not pinned blocks)."""
        if self._crossing is None:
            return
        link, side, ids, host, ready = self._crossing
        if ready is not None:
            ready.synchronize()
        self._crossing = None  # (only now: should the wait raise, the next call waits again)
        self._keep(link, side, ids, list(host.clone().unbind(0)))

    def _crossing_keys(self) -> set[Key]:
        if self._crossing is None:
            return set()
        link, side, ids, _, _ = self._crossing
        return {(link, side, i) for i in ids}

    def _keep(self, link: int, side: str, ids: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        """Encode host values as the backend stores them, make what they decode to visible, and queue the bytes."""
        raws = [self.backend.encode_raw(v) for v in values]
        stored = [self.backend.decode_raw(raw, tuple(v.shape)) for raw, v in zip(raws, values)]
        batch = []
        with self._lock:
            for i, raw, value in zip(ids, raws, stored):
                key = (link, side, int(i))
                number = next(self._sequence)
                self._pending[key] = (number, value)
                self._cache.pop(key, None)
                if key in self._inflight:
                    self._stale.add(key)
                batch.append((key, number, raw, tuple(value.shape)))
        self._writes.put(batch)

    def _write_loop(self) -> None:
        while True:
            batch = self._writes.get()
            if batch is None:
                self._writes.task_done()
                return
            try:
                by_link: dict[tuple[int, str], tuple[list[int], list, list]] = {}
                for (link, side, sample), _number, raw, shape in batch:
                    ids, raws, shapes = by_link.setdefault((link, side), ([], [], []))
                    ids.append(sample)
                    raws.append(raw)
                    shapes.append(shape)
                for (link, side), (ids, raws, shapes) in by_link.items():
                    self.backend.put_raw(link, side, ids, raws, shapes)
                with self._lock:
                    for key, number, _raw, _shape in batch:
                        if self._pending.get(key, (None,))[0] == number:  # a newer put keeps its own entry
                            del self._pending[key]
            except BaseException as e:  # noqa: BLE001 - surfaced on the next put or flush
                self._write_error = e
            finally:
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until every put is on disk; raise the writer's error if one happened."""
        self._land()
        self._writes.join()
        if self._write_error is not None:
            raise self._write_error

    def items(self):
        self.flush()
        return self.backend.items()

    def present(self, link: int, side: str, ids: Sequence[int]) -> list[bool]:
        """Whether a sound m(ξ) exists for each id (pending writes and read-ahead first; not counted as lookups)."""
        self._land()
        found = []
        for i in ids:
            known, value = self._lookup((link, side, int(i)))
            found.append(value is not None if known else self.backend.present(link, side, [i])[0])
        return found

    def delete(self, link: int, side: str, ids: Sequence[int]) -> None:
        """Remove m(ξ) of each id once pending writes are on disk, and forget any read-ahead copy."""
        self.flush()
        with self._lock:
            for i in ids:
                key = (link, side, int(i))
                self._cache.pop(key, None)
                if key in self._inflight:
                    self._stale.add(key)
        self.backend.delete(link, side, ids)

    def checkpointed(self, step: int, kept: Collection[int]) -> None:
        """Once every put is on disk: the store as it is now belongs to the checkpoint of `step` (`LMDBStore`)."""
        self.flush()
        self.backend.checkpointed(step, kept)

    def rewind(self, step: int) -> int | None:
        """Every value back to what it held at the checkpoint of `step`, read-ahead copies forgotten (`LMDBStore`)."""
        self.flush()
        with self._lock:
            self._cache.clear()
            self._stale.update(self._inflight)
        return self.backend.rewind(step)

    def bookkeeping_entries(self) -> int:
        """Entries held for coordination (pending writes, read-ahead, stale marks): bounded by what is in flight, not
        by the number of samples ever seen."""
        self._land()
        with self._lock:
            return len(self._pending) + len(self._cache) + len(self._stale) + len(self._inflight)

    def close(self) -> None:
        """Persist everything, stop the threads, close the backend."""
        try:
            self.flush()
        finally:
            self._writes.put(None)
            self._writer.join(timeout=30)
            self._reader.shutdown(wait=True)
            self.backend.close()
