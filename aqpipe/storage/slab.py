"""m(ξ) kept as slabs (`--store-device cuda`): one tensor per link side and value shape, each sample a row of it.

On a GPU an AQ-SGD message's time is its host's calls, not its arithmetic. Kept one tensor per sample, a message's
m(ξ) takes a call per sample to read (a stack of B rows) and a copy call per sample to write; kept as rows of one
slab it takes one gather to read and one scatter to write, whatever the micro-batch (`gather`, `scatter`). A slab is
sized up front from the samples a rank will see (`rows_hint`: what the capacity plan counts against the GPU), and
grows by half again should more samples come.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aqpipe.disk import save_atomic
from aqpipe.storage.base import StoreStats
from aqpipe.storage.encoding import storable_rows

Key = tuple[int, str, int]  # (link, side, sample id)
SlabKey = tuple[int, str, tuple[int, ...]]  # (link, side, value shape)
FIRST_ROWS = 16  # a slab's rows when no hint was given


@dataclass
class _Slab:
    """The values of one link side and shape: `rows[slot]` is a sample's m(ξ); `free` lists the slots not in use;
    `hint`: the rows it is first given (0: `FIRST_ROWS`)."""

    rows: torch.Tensor
    hint: int = 0
    free: list[int] = field(default_factory=list)

    def take(self, count: int) -> list[int]:
        """`count` free slots, growing the slab when too few are free: at first to its hint, then by half again."""
        if count == 0:
            return []
        if len(self.free) < count:
            old = self.rows.shape[0]
            new = max(old + count - len(self.free), old + old // 2, self.hint or FIRST_ROWS)
            grown = self.rows.new_empty((new, *self.rows.shape[1:]))
            grown[:old].copy_(self.rows)
            self.rows = grown
            self.free.extend(range(new - 1, old - 1, -1))
        taken = self.free[-count:]
        del self.free[-count:]
        return taken[::-1]


class SlabStore:
    """m(ξ) of every (link, side, sample id) this rank holds, as rows of slabs on `device` in `dtype`."""

    def __init__(self, dtype: torch.dtype = torch.float16, device: torch.device | str = "cuda",
                 rows_hint: int | None = None) -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.rows_hint = rows_hint or 0  # rows a link side's slab starts with (the samples it will see)
        self.stats = StoreStats()
        self.step = 0  # the training step, set by the worker
        self._slabs: dict[SlabKey, _Slab] = {}
        self._index: dict[Key, tuple[SlabKey, int]] = {}  # where each sample's row is
        self._last: tuple[tuple[Key, ...], list[int], torch.Tensor] | None = None  # the last index sent to the device

    # -- a message's rows at once -------------------------------------------------------------------------------
    def gather(self, link: int, side: str, ids: Sequence[int]) -> torch.Tensor:
        """m(ξ) of `ids` as one batch [B, *shape] on the store's device, read in one gather (all must exist, with one
        shape)."""
        slab, slots = self.rows(link, side, ids)
        return slab.index_select(0, slots)

    def rows(self, link: int, side: str, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The slab that holds m(ξ) of `ids` [N, *shape] and their slots in it (int64 [B] on the store's device), for
        a kernel to read them in place: good until the next scatter, which may grow the slab (all must exist, with
        one shape)."""
        keys, slab, slots = self._slots(link, side, ids)
        return slab, self._slots_on_device(keys, slots)

    def slots(self, link: int, side: str, ids: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """`rows`, the slots as numbers on the host: for a caller that makes its own index of them (a CUDA graph's
        buffer, fed with more than the slots)."""
        return self._slots(link, side, ids)[1:]

    def _slots(self, link: int, side: str, ids: Sequence[int]
               ) -> tuple[tuple[Key, ...], torch.Tensor, list[int]]:
        """The keys of `ids`, the slab that holds them and their slots in it (see `rows`)."""
        keys = tuple([(link, side, int(i)) for i in ids])  # (lists, not generators: on a GPU's hot path)
        if not keys:
            raise ValueError(f"a gather of no samples on link {link} side {side}: its shape is unknown")
        places = [self._place(key) for key in keys]
        slab_key = places[0][0]
        if any(place[0] != slab_key for place in places):
            raise ValueError(f"the m(xi) of samples {list(ids)} on link {link} side {side} have different shapes: "
                             f"{sorted({shape for (_, _, shape), _ in places})}")
        return keys, self._slabs[slab_key].rows, [slot for _, slot in places]

    def scatter(self, link: int, side: str, ids: Sequence[int], values: torch.Tensor) -> None:
        """Replace m(ξ) of `ids` with the rows of `values` [B, *shape] (in the store's dtype) in one scatter; the
        values are copied, so the caller may reuse them at once (on a GPU: once its stream has passed this call)."""
        if values.dtype != self.dtype:
            raise TypeError(f"the store keeps {self.dtype}, got {values.dtype}")
        keys = [(link, side, int(i)) for i in ids]
        if len(keys) != len(values):
            raise ValueError(f"a scatter of {len(keys)} samples but {len(values)} rows on link {link} side {side}")
        if len(set(keys)) != len(keys):  # a sample twice in one batch: its last row wins, as one put after another
            last = {key: j for j, key in enumerate(keys)}
            rows = torch.tensor(list(last.values()), dtype=torch.int64).to(values.device, non_blocking=True)
            keys, values = list(last), values.index_select(0, rows)  # (a list as an index would wait for a GPU)
        if not keys:
            return
        slab_key = (link, side, tuple(values.shape[1:]))
        slab = self._slabs.get(slab_key)
        if slab is None:  # the hint sizes a link side's first slab (a value shape seen later starts small)
            first = not any(key[:2] == (link, side) for key in self._slabs)
            slab = self._slabs[slab_key] = _Slab(values.new_empty((0, *values.shape[1:]), device=self.device),
                                                 self.rows_hint if first else 0)
        places = [self._index.get(key) for key in keys]
        new = sum(1 for place in places if place is None or place[0] != slab_key)
        taken = iter(slab.take(new))  # (first: growing may fail, and nothing has changed yet)
        slots = []
        for key, place in zip(keys, places):
            if place is not None and place[0] == slab_key:
                slots.append(place[1])
                continue
            if place is not None:  # kept before with another shape: its old row is free
                self._slabs[place[0]].free.append(place[1])
            slots.append(next(taken))
            self._index[key] = (slab_key, slots[-1])
        index = self._slots_on_device(tuple(keys), slots)
        slab.rows.index_copy_(0, index, values.to(self.device, non_blocking=True))

    def _slots_on_device(self, keys: tuple[Key, ...], slots: list[int]) -> torch.Tensor:
        """`slots` as an index on the store's device, reused when the last call asked for the same samples in the
        same rows (a message's scatter follows its gather): one copy to the device saved per message."""
        if self._last is not None and self._last[0] == keys and self._last[1] == slots:
            return self._last[2]
        index = torch.tensor(slots, dtype=torch.int64)
        if self.device.type != "cpu":
            index = index.to(self.device, non_blocking=True)
        self._last = (keys, slots, index)
        return index

    def _place(self, key: Key) -> tuple[SlabKey, int]:
        try:
            return self._index[key]
        except KeyError:
            raise KeyError(f"no m(xi) for link {key[0]} side {key[1]} sample {key[2]}") from None

    # -- the message store's calls ---------------------------------------------------------------------------------
    def contains(self, link: int, side: str, ids: Sequence[int]) -> list[bool]:
        return self.stats.looked_up([(link, side, int(i)) in self._index for i in ids])

    def get(self, link: int, side: str, ids: Sequence[int]) -> list[torch.Tensor]:
        """m(ξ) of each id, a copy of its own (a later put leaves it as it was)."""
        return [self._row(self._place((link, side, int(i)))).clone() for i in ids]

    def put(self, link: int, side: str, ids: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        """Replace m(ξ) of each id (values of one shape go in one scatter)."""
        values = list(values)
        if len({tuple(v.shape) for v in values}) == 1:
            self.scatter(link, side, ids, torch.stack(values))
            return
        for i, value in zip(ids, values):
            self.scatter(link, side, [i], value.unsqueeze(0))

    def present(self, link: int, side: str, ids: Sequence[int]) -> list[bool]:
        """Whether m(ξ) exists for each id (not counted as lookups)."""
        return [(link, side, int(i)) in self._index for i in ids]

    def delete(self, link: int, side: str, ids: Sequence[int]) -> None:
        """Forget m(ξ) of each id (its row is free for another sample)."""
        for i in ids:
            place = self._index.pop((link, side, int(i)), None)
            if place is not None:
                self._slabs[place[0]].free.append(place[1])

    def storable_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Whether each row of a batch (in the store dtype) is finite, as a bool tensor on its device."""
        return storable_rows(values)

    def _row(self, place: tuple[SlabKey, int]) -> torch.Tensor:
        return self._slabs[place[0]].rows[place[1]]

    def items(self) -> Iterator[tuple[Key, torch.Tensor]]:
        """Every ((link, side, id), value) pair; each value a view of its slab, good until the next put."""
        for key, place in list(self._index.items()):
            yield key, self._row(place)

    def entries(self) -> dict[str, torch.Tensor]:
        """Every entry keyed 'link/side/id', each in host memory of its own (one copy from the device per slab)."""
        out: dict[str, torch.Tensor] = {}
        for slab_key, slab in self._slabs.items():
            held = [(key, slot) for key, (where, slot) in self._index.items() if where == slab_key]
            if not held:
                continue
            index = torch.tensor([slot for _, slot in held], dtype=torch.int64, device=slab.rows.device)
            host = slab.rows.index_select(0, index).cpu()
            for j, ((link, side, sample), _) in enumerate(held):
                out[f"{link}/{side}/{sample}"] = host[j].clone()
        return out

    def load(self, entries: dict[str, torch.Tensor]) -> None:
        """Replace the contents with `entries`-style values ('link/side/id' → value), e.g. from a checkpoint."""
        self._slabs, self._index, self._last = {}, {}, None
        groups: dict[SlabKey, tuple[list[int], list[torch.Tensor]]] = {}
        for key, value in entries.items():
            link, side, sample = key.split("/")
            ids, values = groups.setdefault((int(link), side, tuple(value.shape)), ([], []))
            ids.append(int(sample))
            values.append(value.to(self.dtype))
        for (link_id, side_name, _), (ids, values) in groups.items():
            self.scatter(link_id, side_name, ids, torch.stack(values).to(self.device))

    def value_bytes(self) -> int:
        """Bytes the slabs hold (rows not in use included)."""
        return sum(slab.rows.untyped_storage().nbytes() for slab in self._slabs.values())

    def close(self) -> None:
        """Nothing to release: the slabs live as long as the store."""

    def __len__(self) -> int:
        return len(self._index)

    def dump(self, path: Path) -> None:
        """Save every entry (keys as 'link/side/id') for offline comparison of the two sides of a link."""
        save_atomic(path, lambda f: torch.save(self.entries(), f))
