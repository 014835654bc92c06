"""The per-sample message store m(ξ): interface and counters (its dtypes: `aqpipe.storage.dtypes`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

SIDES = ("send", "recv")  # the two copies of a link's m(ξ): the sending stage's and the receiving stage's


def stage_holding(link: int, side: str) -> int:
    """The pipeline stage that keeps `side` of link `link`'s m(ξ) and runs that end of the link: link k joins stage k
    (it sends activations down and receives gradients back) to stage k + 1. The one statement of that rule."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    return link if side == "send" else link + 1


@dataclass
class StoreStats:
    """How often a lookup found m(ξ) (hits), found none (misses: first sight), or found it damaged (reseeded), and
    how many values were not stored because they were not finite in the store's dtype (overflow; counted by the
    sender, so each sample once)."""

    hits: int = 0
    misses: int = 0
    reseeded: int = 0
    overflow: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "reseeded": self.reseeded, "overflow": self.overflow}

    def looked_up(self, found: list[bool]) -> list[bool]:
        """Count a lookup's answers (whether each sample had m(ξ)) as hits and misses; returns them."""
        hits = sum(found)
        self.hits += hits
        self.misses += len(found) - hits
        return found


class MessageStore(Protocol):
    """m(ξ) for every (link, side, sample id) this rank holds; values are kept in the store's dtype."""

    dtype: torch.dtype
    stats: StoreStats

    def contains(self, link: int, side: str, ids: Sequence[int]) -> list[bool]: ...

    def get(self, link: int, side: str, ids: Sequence[int]) -> list[torch.Tensor]: ...

    def put(self, link: int, side: str, ids: Sequence[int], values: Sequence[torch.Tensor]) -> None: ...

    def delete(self, link: int, side: str, ids: Sequence[int]) -> None: ...

    def present(self, link: int, side: str, ids: Sequence[int]) -> list[bool]: ...

    def storable_rows(self, values: torch.Tensor) -> torch.Tensor: ...

    def items(self): ...

    def close(self) -> None: ...


@dataclass
class StoreView:
    """One side of one link of a store: what an AQ-SGD codec holds."""

    store: MessageStore
    link: int
    side: str

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {self.side!r}")

    @property
    def dtype(self) -> torch.dtype:
        return self.store.dtype

    def contains(self, ids: Sequence[int]) -> list[bool]:
        """Whether m(ξ) exists for each id."""
        return self.store.contains(self.link, self.side, ids)

    def get(self, ids: Sequence[int]) -> list[torch.Tensor]:
        """m(ξ) of each id (all must exist)."""
        return self.store.get(self.link, self.side, ids)

    def put(self, ids: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        """Replace m(ξ) of each id (values already in the store dtype)."""
        self.store.put(self.link, self.side, ids, values)

    def gather(self, ids: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
        """m(ξ) of `ids` as one batch [B, ...] on `device` (None: where the store keeps it; all must exist): one
        gather from a slab store, else the values stacked (`stacked_on`)."""
        gather = getattr(self.store, "gather", None)
        if gather is None:
            return stacked_on(self.store.get(self.link, self.side, ids), device)
        batch = gather(self.link, self.side, ids)
        return batch if device is None or batch.device == device else batch.to(device, non_blocking=True)

    def slots(self, ids: Sequence[int]) -> tuple[torch.Tensor, list[int]] | None:
        """Where m(ξ) of `ids` lies, for a kernel to read in place: a slab store's slab [N, ...] and the slots of
        `ids` in it, as numbers on the host (all must exist, with one shape); None from a store without slabs."""
        slots = getattr(self.store, "slots", None)
        return None if slots is None else slots(self.link, self.side, ids)

    @property
    def keeps_rows(self) -> bool:
        """Whether the store keeps m(ξ) as rows of slabs, which `slots` hands a kernel to read and write in place."""
        return hasattr(self.store, "slots")

    def scatter(self, ids: Sequence[int], values: torch.Tensor) -> None:
        """Replace m(ξ) of `ids` with the rows of `values` [B, ...] (in the store dtype). The store copies them: the
        caller may reuse `values` once its stream has passed this call (a codec's CUDA graph writes them again)."""
        scatter = getattr(self.store, "scatter", None)
        if scatter is not None:
            scatter(self.link, self.side, ids, values)
        else:
            self.store.put(self.link, self.side, ids, values.unbind(0))

    def present(self, ids: Sequence[int]) -> list[bool]:
        """Whether a sound m(ξ) exists for each id, without counting lookups (a damaged one is dropped and counted)."""
        return self.store.present(self.link, self.side, ids)

    def storable_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Whether each row of a batch [B, ...] (in the store dtype) can be kept — finite, and in range of a low-bit
        encoding — as a bool tensor [B] on its device (nothing read, so a GPU is not waited for)."""
        return self.store.storable_rows(values)

    def delete(self, ids: Sequence[int]) -> None:
        """Forget m(ξ) of each id."""
        self.store.delete(self.link, self.side, ids)


def stacked_on(values: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """`values` stacked into one batch on `device` (None: where they are). Host values bound for a GPU are stacked
    into page-locked memory (a block of torch's cache), so their one copy is a DMA the host does not wait for: from
    pageable memory the driver holds the host until it has staged every byte (a micro-batch's m(ξ) is megabytes)."""
    if device is None or device.type != "cuda" or any(v.device.type != "cpu" for v in values) or not values:
        batch = torch.stack(list(values))
        return batch if device is None else batch.to(device, non_blocking=True)
    first = values[0]
    host = torch.empty((len(values), *first.shape), dtype=first.dtype, pin_memory=True)
    torch.stack(list(values), out=host)
    return host.to(device, non_blocking=True)  # torch keeps the block from reuse until this copy is done


def on_device(values: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """`values` on `device`, each owning its storage: those from elsewhere (a GPU's m(ξ) going to host RAM or disk)
    cross in one copy — one wait for the GPU, not one per value — when they share a shape."""
    device = torch.device(device)
    away = [j for j, v in enumerate(values) if v.device != device]
    if len(away) < 2 or len({tuple(values[j].shape) for j in away}) > 1:
        return [v.to(device) for v in values]
    moved = torch.stack([values[j] for j in away]).to(device).unbind(0)
    out = list(values)
    for j, v in zip(away, moved):
        out[j] = v.clone()  # a row of its own, not a view that would keep the whole copy alive
    return out
