"""The parts of an AQ-SGD message: the sample modes, the rows of each kind with their verdicts (whether each can go
its way, its checksum sum), payloads, m(ξ) kept per sample, and the deltas' fidelity norms."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from aqpipe.compress.gpu.copies import Landing, to_device, to_host
from aqpipe.compress.link.base import DeltaFidelity
from aqpipe.compress.link.specs import CodecError

# A sample's mode byte: what its segment holds.
MODE_FULL, MODE_DELTA, MODE_FIRST, MODE_FULL_BF16, MODE_FULL_FP16 = 0, 1, 2, 3, 4
LOSSLESS_MODES = {torch.float32: MODE_FULL, torch.bfloat16: MODE_FULL_BF16, torch.float16: MODE_FULL_FP16}
MODE_DTYPES = {mode: dtype for dtype, mode in LOSSLESS_MODES.items()}
# The kinds of row a receiver keeps whatever its values (its sender sent each so only where the value could be kept):
# a message of them alone needs no verdict read, and a GPU receiver checks its checksum late (`late_checks`).
LATE_CHECKED = frozenset({MODE_DELTA, MODE_FIRST})


class SampleMemory(Protocol):
    """What AQ-SGD needs of one side of one link's m(ξ) store (`aqpipe.storage.StoreView` is one): the codec holds
    its memory through this, never a store type, so compression does not depend on storage."""

    link: int
    store: Any  # its `stats.overflow` counts the values no store encoding can hold

    @property
    def dtype(self) -> torch.dtype: ...

    def contains(self, ids: Sequence[int]) -> list[bool]: ...

    def get(self, ids: Sequence[int]) -> list[torch.Tensor]: ...

    def put(self, ids: Sequence[int], values: Sequence[torch.Tensor]) -> None: ...

    def gather(self, ids: Sequence[int], device: torch.device | None = None) -> torch.Tensor: ...

    def slots(self, ids: Sequence[int]) -> tuple[torch.Tensor, list[int]] | None: ...

    @property
    def keeps_rows(self) -> bool: ...

    def scatter(self, ids: Sequence[int], values: torch.Tensor) -> None: ...

    def present(self, ids: Sequence[int]) -> list[bool]: ...

    def storable_rows(self, values: torch.Tensor) -> torch.Tensor: ...

    def delete(self, ids: Sequence[int]) -> None: ...


def read_modes(payload: torch.Tensor, b: int, sizes: dict[int, int]) -> list[int]:
    """The mode bytes of a received payload of `b` samples (on the host), each a mode of `sizes` (its segment's
    length) and together the payload's length; a CodecError naming what is wrong otherwise."""
    modes = payload[:b].tolist()
    if any(m not in sizes for m in modes):
        unknown = sorted(set(modes) - set(sizes))
        if MODE_FIRST in unknown:
            raise CodecError("the peer sends quantized first sights but this side has no --first-sight coder "
                             "(the two sides of a link must be given the same --first-sight)")
        raise CodecError(f"aqsgd payload has unknown sample modes {unknown}")
    if b + sum(sizes[m] for m in modes) != payload.numel():
        raise CodecError(f"aqsgd payload of {payload.numel()} bytes does not match its sample modes")
    return modes


def segments_by_mode(modes: list[int], payload: torch.Tensor, sizes: dict[int, int]
                     ) -> dict[int, tuple[torch.Tensor, list[int]]]:
    """A payload's segments by mode (`sizes`: each mode's segment length): each mode's rows [n, segment bytes] and
    the samples they belong to. A message of one kind of sample is its payload's rows as they are."""
    b = len(modes)
    if b and len(set(modes)) == 1:
        return {modes[0]: (payload[b:].view(b, -1), list(range(b)))}
    parts: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
    offset = b
    for i, mode in enumerate(modes):
        rows, at = parts.setdefault(mode, ([], []))
        rows.append(payload[offset : offset + sizes[mode]])
        at.append(i)
        offset += sizes[mode]
    return {mode: (torch.stack(rows), at) for mode, (rows, at) in parts.items()}


def rows_of(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of a batch: the batch itself when they are all of it in order, else a gather whose index reaches
    the device without the host waiting (a Python list as an index is a synchronous copy)."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, to_device(torch.tensor(rows, dtype=torch.int64), t.device))


def verdicts_of(ok: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """What the host reads of a group of rows, as one int64 tensor [2n] on their device: whether each row can go
    its way (`ok`), then its checksum's row sum."""
    return torch.cat([ok.to(torch.int64), sums])


class Candidates:
    """Rows `at` of a message that may go one way (as deltas, first sights or losslessly): the payload a message of
    them alone would be (their mode bytes, then their coded segments; None: lossless, sent as they are), what m(ξ)
    would become, and `verdicts_of` them — read together with every other kind's in one wait for the device
    (`read_all` fills `fits` and `sums`). `lent`: the tensors are a CUDA graph's own buffers (see `graphed`);
    `values` None: the fused kernels wrote the new m(ξ) over the old, in the store."""

    def __init__(self, at: list[int], values: torch.Tensor | None, verdicts: torch.Tensor,
                 payload: torch.Tensor | None = None, lent: bool = False) -> None:
        self.at, self.values, self.verdicts, self.payload, self.lent = at, values, verdicts, payload, lent
        self.arrival: Landing | None = None  # marks the verdicts' copy to the host, where `fetch` queued one
        self.fits: list[bool] = []
        self.sums: list[int] = []

    def fetch(self) -> None:
        """Queue the verdicts' copy to the host now (from a GPU: into pinned memory, without waiting), so that
        `read_all` waits for that copy alone and not for what is queued after it: a message's bytes on their way to
        the host, whose copy then goes on while the host reads the verdicts and builds the message."""
        self.verdicts, self.arrival = to_host(self.verdicts, spin=True)

    @property
    def segments(self) -> torch.Tensor | None:
        """Each row's coded segment [n, segment bytes] (None: lossless) — a view, made only where a message mixes
        kinds of rows (two tensor calls a message saved in the steady state)."""
        n = len(self.at)
        return None if self.payload is None else self.payload[n:].view(n, -1)

    def owned(self) -> Candidates:
        """These rows with values of their own (copies of a graph's buffers, which its next replay writes), for a
        store that may keep what it is given as it is."""
        if self.lent and self.values is not None:
            self.values, self.lent = self.values.clone(), False
        return self

    @staticmethod
    def read_all(groups: list[Candidates]) -> None:
        """Read every group's verdicts from the device at once (or, where `fetch` queued their copy, once it has
        arrived), and fill each group's `fits` and `sums`."""
        if not groups:
            return
        if len(groups) > 1 and all(g.arrival is None for g in groups):
            numbers = torch.cat([g.verdicts for g in groups]).tolist()
        else:
            numbers = []
            for g in groups:
                if g.arrival is not None:
                    _wait_for(g.arrival)
                numbers += g.verdicts.tolist()
        start = 0
        for g in groups:
            n = len(g.at)
            g.fits = [bool(v) for v in numbers[start:start + n]]
            g.sums = numbers[start + n:start + 2 * n]
            start += 2 * n

    @staticmethod
    def device_sums(groups: list[Candidates]) -> tuple[torch.Tensor, list[int] | None]:
        """The checksum sums of a message's rows (each group's, on the device) and the row each belongs to (None: the
        one group's rows are the message's, in order)."""
        if len(groups) == 1:
            return groups[0].verdicts[len(groups[0].at):], None
        return (torch.cat([g.verdicts[len(g.at):] for g in groups]), [i for g in groups for i in g.at])


def _wait_for(arrival: Landing) -> None:
    """Wait for a copy's arrival on the host, reported as torch's sync debug mode reports the waits it counts (a
    stream's, not an event's): the sync audit and `set_sync_debug_mode` see this wait as they saw the device read
    it replaced."""
    if arrival.device.type == "cuda":
        mode = torch.cuda.get_sync_debug_mode()
        if mode == 2:
            raise RuntimeError("called a synchronizing CUDA operation")
        if mode == 1:
            warnings.warn("called a synchronizing CUDA operation (a wait for a copy's event)", stacklevel=2)
    arrival.synchronize()


def keep(view: SampleMemory, ids: list[int], values: list[torch.Tensor | None]) -> list[int]:
    """Store the new m(ξ) of each sample; a sample whose value is None (not storable) loses any m(ξ) it had, so its
    next sight goes at full precision on both sides. Returns those samples."""
    kept = [(i, v) for i, v in zip(ids, values) if v is not None]
    dropped = [i for i, v in zip(ids, values) if v is None]
    if kept:
        view.put([i for i, _ in kept], [v for _, v in kept])
    if dropped:
        view.delete(dropped)
    return dropped


def row_norms(t: torch.Tensor) -> torch.Tensor:
    """Each sample's norm, in float32 (no full-size float64 copy)."""
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1)


def fidelity_norms(x: torch.Tensor, m_old: torch.Tensor, change: torch.Tensor, m_new: torch.Tensor
                    ) -> torch.Tensor:
    """Per sample [B, 3]: the norm of the activation `x`, of its change since m(ξ), and of what m(ξ) still misses
    after the update in the store's dtype — what the receiver computes on. One full-size temporary: m_new − m_old −
    change = m_new − x."""
    error = m_new.to(torch.float32, copy=True).sub_(m_old).sub_(change)
    return torch.stack([row_norms(x), row_norms(change), row_norms(error)], dim=1)


def delta_fidelity(norms: torch.Tensor, as_delta: list[int]) -> DeltaFidelity:
    """The three norms of `fidelity_norms`, squared and summed in float64 over the samples sent as deltas (rows
    `as_delta`)."""
    return DeltaFidelity(rows_of(norms, as_delta).double().square_().sum(dim=0))


def lossless_dtype_of(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a sample of `tensor` goes losslessly in: its own (fp32, bf16, fp16), else fp32."""
    return tensor.dtype if tensor.dtype in LOSSLESS_MODES else torch.float32


def payload_of(mode: int, coded: torch.Tensor) -> torch.Tensor:
    """The payload of a message whose every sample goes in `mode`, with the coded rows `coded` [B, segment bytes]."""
    modes = torch.full((coded.shape[0],), mode, dtype=torch.uint8, device=coded.device)
    return torch.cat([modes, coded.reshape(-1)])


def lossless_payload(tensor: torch.Tensor) -> torch.Tensor:
    """The payload of a message whose every sample goes losslessly, in the activation's own dtype."""
    raw = tensor.detach().to(lossless_dtype_of(tensor)).contiguous()
    return payload_of(LOSSLESS_MODES[raw.dtype], raw.view(torch.uint8).reshape(raw.shape[0], -1))


def present(value):
    """`value`, which the code before has set (not None)."""
    if value is None:
        raise RuntimeError("an AQ-SGD part used where none was set")
    return value


def every(items: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """`items`, each of which the code before has set."""
    filled = [item for item in items if item is not None]
    if len(filled) != len(items):
        raise RuntimeError("an AQ-SGD message left a sample without its segment")
    return filled
