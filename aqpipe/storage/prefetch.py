"""Prefetch and write-behind around a message store, so disk reads and writes of m(ξ) hide behind compute.

`prefetch(link, side, ids)` loads the m(ξ) of coming micro-batches on a reader thread; `put` returns at once
and a single writer thread persists values in the order they were put. Reads always see the newest value:
a value whose write is still pending is served from the pending table, and every put bumps a per-key version
so that a prefetch which started before the put can never install its older value afterwards. Reads and writes
use separate threads and separate buffers (values are immutable tensors), so nothing is shared unordered.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

Key = tuple[int, str, int]


class PrefetchingStore:
    """A MessageStore that reads ahead and writes behind on background threads."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.dtype = backend.dtype
        self.stats = backend.stats
        self._lock = threading.Lock()
        self._version: dict[Key, int] = {}
        self._pending: dict[Key, tuple[int, torch.Tensor]] = {}  # written, not yet on disk: (version, value)
        self._cache: dict[Key, tuple[int, torch.Tensor | None]] = {}  # prefetched: (version read at, value or None)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mstore-read")
        self._inflight: dict[Key, Future] = {}
        self._writes: queue.Queue = queue.Queue()
        self._write_error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="mstore-write", daemon=True)
        self._writer.start()

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
            todo = [k for k in keys if k not in self._pending and k not in self._cache and k not in self._inflight]
            for key in todo:
                self._inflight[key] = self._reader.submit(self._load, key, self._version.get(key, 0))

    def _load(self, key: Key, version: int) -> None:
        try:
            value = self.backend.get(key[0], key[1], [key[2]])[0]
        except KeyError:  # absent or damaged: the codec will send this sample at full precision
            value = None
        with self._lock:
            self._inflight.pop(key, None)
            if self._version.get(key, 0) == version:  # no put happened meanwhile: the value is still current
                self._cache[key] = (version, value)

    def _lookup(self, key: Key) -> tuple[bool, torch.Tensor | None]:
        """(known, value) from the pending writes or the prefetch cache; (False, None) if neither has the key."""
        with self._lock:
            if key in self._pending:
                return True, self._pending[key][1]
            cached = self._cache.get(key)
            if cached is not None and cached[0] == self._version.get(key, 0):
                return True, cached[1]
            future = self._inflight.get(key)
        if future is not None:
            future.result()
            return self._lookup(key)
        return False, None

    def contains(self, link: int, side: str, ids: Sequence[int]) -> list[bool]:
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
    def put(self, link: int, side: str, ids: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        """Make the values visible to reads at once and queue them for the disk."""
        if self._write_error is not None:
            raise self._write_error
        batch = []
        with self._lock:
            for i, v in zip(ids, values):
                key = (link, side, int(i))
                version = self._version.get(key, 0) + 1
                self._version[key] = version
                self._pending[key] = (version, v)
                self._cache.pop(key, None)
                batch.append((key, version, v))
        self._writes.put(batch)

    def _write_loop(self) -> None:
        while True:
            batch = self._writes.get()
            if batch is None:
                self._writes.task_done()
                return
            try:
                by_link: dict[tuple[int, str], tuple[list[int], list[torch.Tensor]]] = {}
                for (link, side, sample), _version, value in batch:
                    ids, vals = by_link.setdefault((link, side), ([], []))
                    ids.append(sample)
                    vals.append(value)
                for (link, side), (ids, vals) in by_link.items():
                    self.backend.put(link, side, ids, vals)
                with self._lock:
                    for key, version, _value in batch:
                        if self._pending.get(key, (None,))[0] == version:  # a newer put keeps its own entry
                            del self._pending[key]
            except BaseException as e:  # noqa: BLE001 - surfaced on the next put or flush
                self._write_error = e
            finally:
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until every put is on disk; raise the writer's error if one happened."""
        self._writes.join()
        if self._write_error is not None:
            raise self._write_error

    def items(self):
        self.flush()
        return self.backend.items()

    def present(self, link: int, side: str, ids: Sequence[int]) -> list[bool]:
        """Whether a sound m(ξ) exists for each id (pending writes and read-ahead first; not counted as lookups)."""
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
                self._version[key] = self._version.get(key, 0) + 1  # a read still in flight is stale
        self.backend.delete(link, side, ids)

    def close(self) -> None:
        """Persist everything, stop the threads, close the backend."""
        try:
            self.flush()
        finally:
            self._writes.put(None)
            self._writer.join(timeout=30)
            self._reader.shutdown(wait=True)
            self.backend.close()
