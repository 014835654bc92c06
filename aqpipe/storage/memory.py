"""The in-memory message store: a dict from (link, side, sample id) to a tensor in the store dtype."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypeGuard

import torch

from aqpipe.compress.gpu.copies import Landing, to_host
from aqpipe.disk import save_atomic
from aqpipe.storage.base import StoreStats, on_device
from aqpipe.storage.encoding import storable_rows
from aqpipe.storage.slab import SlabStore


def compact(value: torch.Tensor) -> torch.Tensor:
    """`value` if it owns exactly its own storage, else a contiguous copy that does."""
    return value if _owns_its_storage(value) else value.clone(memory_format=torch.contiguous_format)


def compact_all(values: Sequence[torch.Tensor], always: bool = False) -> list[torch.Tensor]:
    """`compact` of each value (with `always`: a copy of each, even of a value owning its storage), the copies made
    together (one kernel launch for a message's rows on a GPU, not one copy call per row)."""
    kept = list(values)
    borrowed = [i for i, v in enumerate(kept) if always or not _owns_its_storage(v)]
    if borrowed:
        copies = [torch.empty_like(kept[i], memory_format=torch.contiguous_format) for i in borrowed]
        torch._foreach_copy_(copies, [kept[i] for i in borrowed])
        for i, copy in zip(borrowed, copies):
            kept[i] = copy
    return kept


def _owns_its_storage(value: torch.Tensor) -> bool:
    whole = value.is_contiguous() and value.storage_offset() == 0
    return whole and value.untyped_storage().nbytes() == value.numel() * value.element_size()


class MemoryStore:
    """m(ξ) kept in RAM or in a GPU's memory (`device`), one tensor per (link, side, sample id).

    Host values are not page-locked: the pinned allocator rounds every block up to a power of two (1.8x for a
    576 KB value) and pins each new one with a slow, globally locked driver call, while a message's m(ξ) moves to
    the GPU in one batched copy per message anyway.

    A message's new m(ξ) computed on a GPU reaches host RAM without making the host wait: `put` queues one copy
    into a pinned block (reused from torch's cache) and keeps views of it, and the next call that needs the values
    (the next put, a get, a dump) waits for that copy — by then long done — and gives each value pageable storage
    of its own."""

    def __init__(self, dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu") -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.stats = StoreStats()
        self.step = 0  # the training step, set by the worker (the LMDB store stamps it into values)
        self._values: dict[tuple[int, str, int], torch.Tensor] = {}
        self._crossing: tuple[list[tuple[int, str, int]], list[torch.Tensor], Landing | None] | None = None

    def contains(self, link: int, side: str, ids: Sequence[int]) -> list[bool]:
        return self.stats.looked_up([(link, side, int(i)) in self._values for i in ids])

    def get(self, link: int, side: str, ids: Sequence[int]) -> list[torch.Tensor]:
        self._land()
        try:
            return [self._values[(link, side, int(i))] for i in ids]
        except KeyError as e:
            raise KeyError(f"no m(xi) for link {link} side {side} sample {e.args[0][2]}") from None

    def put(self, link: int, side: str, ids: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        """Keep each value as a compact tensor of its own: a row of a stacked micro-batch would pin the whole batch."""
        for v in values:
            self._check_dtype(v)
        self._land()
        if crosses_to_the_host(values, self.device):
            self._cross(link, side, ids, torch.stack(list(values)))
            return
        for i, v in zip(ids, compact_all(on_device(values, self.device))):
            self._values[(link, side, int(i))] = v

    def scatter(self, link: int, side: str, ids: Sequence[int], values: torch.Tensor) -> None:
        """Keep the rows of `values` [B, ...] as m(ξ) of `ids`, each copied into storage of its own (a GPU's batch
        bound for host RAM in one queued copy), so the caller may reuse `values` at once."""
        self._check_dtype(values)
        self._land()
        if self.device.type == "cpu" and from_a_gpu(values):
            self._cross(link, side, ids, values)
            return
        for i, v in zip(ids, compact_all(values.to(self.device).unbind(0), always=True)):
            self._values[(link, side, int(i))] = v

    def _check_dtype(self, value: torch.Tensor) -> None:
        if value.dtype != self.dtype:
            raise TypeError(f"the store keeps {self.dtype}, got {value.dtype}")

    def _cross(self, link: int, side: str, ids: Sequence[int], batch: torch.Tensor) -> None:
        """Keep a GPU's batch `batch` as host values: its copy is queued into a pinned block, whose rows serve until
        the copy is waited for (`_land`)."""
        host, ready = to_host(batch)
        keys, rows = [(link, side, int(i)) for i in ids], list(host.unbind(0))
        self._values.update(zip(keys, rows))
        self._crossing = (keys, rows, ready)

    def _land(self) -> None:
        """Finish the last put's copy from the GPU: wait for it, then give each of its values (those not replaced or
        deleted since) pageable storage of its own; the pinned block goes back to torch's cache."""
        if self._crossing is None:
            return
        keys, rows, ready = self._crossing
        if ready is not None:
            ready.synchronize()
        for key, row in zip(keys, rows):
            if self._values.get(key) is row:
                self._values[key] = row.clone()
        self._crossing = None  # (only now: should the wait raise, the next call waits again)

    def storable_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Whether each row of a batch (in the store dtype) is finite, as a bool tensor on its device: an inf or NaN
        m(ξ) would poison every later epoch."""
        return storable_rows(values)

    def encode_raw(self, value: torch.Tensor) -> torch.Tensor:
        """What a value is kept as (the write-behind interface; in memory, a compact copy of the value itself)."""
        return compact(value.to(self.dtype))

    def decode_raw(self, raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return raw.view(shape)

    def put_raw(self, link: int, side: str, ids: Sequence[int], raws: Sequence[torch.Tensor],
                shapes: Sequence[tuple[int, ...]]) -> None:
        self.put(link, side, ids, [r.view(shape) for r, shape in zip(raws, shapes)])

    def value_bytes(self) -> int:
        """Bytes of storage the kept values hold."""
        self._land()
        return sum(v.untyped_storage().nbytes() for v in self._values.values())

    def present(self, link: int, side: str, ids: Sequence[int]) -> list[bool]:
        """Whether m(ξ) exists for each id (not counted as lookups)."""
        return [(link, side, int(i)) in self._values for i in ids]

    def delete(self, link: int, side: str, ids: Sequence[int]) -> None:
        """Forget m(ξ) of each id (its next sight goes at full precision and re-seeds it)."""
        for i in ids:
            self._values.pop((link, side, int(i)), None)

    def load(self, entries: dict[str, torch.Tensor]) -> None:
        """Replace the contents with `dump`-style entries ('link/side/id' → value), e.g. from a checkpoint."""
        self._land()
        self._values = {}
        for key, value in entries.items():
            link, side, sample = key.split("/")
            self._values[(int(link), side, int(sample))] = compact(value.to(self.dtype).to(self.device))

    def entries(self) -> dict[str, torch.Tensor]:
        """Every entry keyed 'link/side/id' (what `dump` writes and `load` reads)."""
        self._land()
        return {f"{link}/{s}/{i}": v.cpu() for (link, s, i), v in self._values.items()}

    def items(self):
        """Every ((link, side, id), value) pair."""
        self._land()
        return self._values.items()

    def close(self) -> None:
        """Nothing to release but a copy still on its way: the values live as long as the process."""
        self._land()

    def __len__(self) -> int:
        return len(self._values)

    def dump(self, path: Path) -> None:
        """Save every entry (keys as 'link/side/id') for offline comparison of the two sides of a link."""
        save_atomic(path, lambda f: torch.save(self.entries(), f))


def in_memory(store: object) -> TypeGuard[MemoryStore | SlabStore]:
    """Whether `store` keeps m(ξ) in memory (host RAM or a GPU's), where only a checkpoint or a dump can keep it."""
    return isinstance(store, (MemoryStore, SlabStore))


def memory_store(dtype: torch.dtype, device: torch.device | str, rows_hint: int | None = None
                 ) -> MemoryStore | SlabStore:
    """m(ξ) kept in memory on `device`: in a GPU's memory as slabs (one gather and one scatter a message; each link
    side's first slab sized for `rows_hint` samples), in host RAM a tensor per sample."""
    if torch.device(device).type == "cuda":
        return SlabStore(dtype, device, rows_hint)
    return MemoryStore(dtype, device)


def crosses_to_the_host(values: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether `values` are a message's m(ξ) on a GPU, of one shape, bound for a store in host RAM: what `put` copies
    without waiting."""
    return (device.type == "cpu" and len(values) > 0 and all(v.device.type == "cuda" for v in values)
            and len({(v.device, tuple(v.shape)) for v in values}) == 1)


def from_a_gpu(batch: torch.Tensor) -> bool:
    """Whether a batch of m(ξ) is a GPU's, whose copy to the host a store queues rather than waits for."""
    return batch.device.type == "cuda" and len(batch) > 0
