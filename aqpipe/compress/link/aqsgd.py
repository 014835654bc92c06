"""AQ-SGD (Wang et al. 2022, Algorithm 1): send Q(a(ξ) − m(ξ)) and let both sides set m(ξ) ← m(ξ) + Q(a(ξ) − m(ξ)).

A sample with no m(ξ) yet (first sight, a re-seed, or any sample during the warm-up epochs) seeds m(ξ) on both
sides from the same bytes: losslessly, in the activation's own dtype (fp32, or bf16/fp16 under mixed precision), or
— outside the warm-up, with a first-sight coder (`--first-sight rtq:4`) — quantized, both sides seeding m(ξ) from
exactly the dequantized values. The change of a known sample goes through the delta coder (B-bit quantization with
per-sample scales). Payload: one mode byte per sample (MODES), then each sample's segment in order. The header
carries a checksum of the m(ξ) values the receiver must end up with, so a divergence of the two copies is caught at
the first message.

The arithmetic runs on the activation's device (a GPU's m(ξ) update never visits the host); m(ξ) is kept wherever
the store keeps it, and moved to the device for the update.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from aqpipe.compress import fused
from aqpipe.compress.cuda_graphs import forget, graphed, may_replay
from aqpipe.compress.link.codecs import (
    CODE_AQSGD,
    CODE_AQSGD_RTQ,
    FLAG_NO_CHECK,
    HOST,
    CodecError,
    CodecParts,
    DeltaFidelity,
    Encoded,
    LinkCodec,
    QuantOptions,
    bytes_as,
    generator_on,
    numel,
    to_device,
)
from aqpipe.compress.link.sample_coders import (
    CastCoder,
    QuantCoder,
    RotatedCoder,
    SampleCoder,
    batch_problem,
    sample_coder,
)
from aqpipe.compress.link.specs import CodecSpec

# A sample's mode byte: what its segment holds.
MODE_FULL, MODE_DELTA, MODE_FIRST, MODE_FULL_BF16, MODE_FULL_FP16 = 0, 1, 2, 3, 4
LOSSLESS_MODES = {torch.float32: MODE_FULL, torch.bfloat16: MODE_FULL_BF16, torch.float16: MODE_FULL_FP16}
MODE_DTYPES = {mode: dtype for dtype, mode in LOSSLESS_MODES.items()}


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

    def gather(self, ids: Sequence[int]) -> torch.Tensor: ...

    def scatter(self, ids: Sequence[int], values: torch.Tensor) -> None: ...

    def present(self, ids: Sequence[int]) -> list[bool]: ...

    def storable_rows(self, values: torch.Tensor) -> torch.Tensor: ...

    def delete(self, ids: Sequence[int]) -> None: ...


_serials = itertools.count()
_MERSENNE_61 = (1 << 61) - 1
_CHECKSUM_COLUMNS = 1 << 20
_position_weights: dict[tuple[int, str], torch.Tensor] = {}


CHECKSUM_WEIGHTS = (40503, 65521)  # word i of a value weighs 1 + (i · 40503) mod 65521 (the fused kernels too)


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """Pseudo-random weights 1 … 65521 for the n 16-bit words of a value (cached per length and device, for the
    process's life: a codec's CUDA graph reads the table it was captured with; a run has a few lengths)."""
    key = (n, str(device))
    if key not in _position_weights:
        multiplier, modulus = CHECKSUM_WEIGHTS
        _position_weights[key] = 1 + (torch.arange(n, dtype=torch.int64, device=device) * multiplier) % modulus
    return _position_weights[key]


def store_checksum(values: list[torch.Tensor | None]) -> int:
    """A 32-bit checksum of the m(ξ) values kept, in sample order (their raw bits in the store dtype; None: not
    kept), computed where the values are: each value's 16-bit words weighted by position and summed in int64 — exact
    integer arithmetic, so every device and every summation order gives the same number — and only one number per
    sample crosses to the host. Any single changed word changes each sample's sum (folded to 32 bits, two copies
    that differ still collide once in 2^32)."""
    kept = [(position, v) for position, v in enumerate(values) if v is not None]
    if not kept:
        return 0
    sums = row_sums(torch.stack([v.contiguous() for _, v in kept])).tolist()
    return fold_checksum([position for position, _ in kept], sums)


def row_sums(values: torch.Tensor) -> torch.Tensor:
    """Each row's position-weighted sum of its 16-bit words (int64 [B], on the values' device): what
    `store_checksum` folds, formed before anything is read so that it can cross to the host with other numbers."""
    words = values.contiguous().view(torch.int16).reshape(values.shape[0], -1)
    weights = _weights(words.shape[1], words.device)
    # |word| < 2^15 and weight < 2^16: each row's sum stays below 2^63 for up to 2^31 words (8 GB per sample); the
    # int64 products are formed a slice of columns at a time, so the transient stays small beside a large batch
    if words.shape[1] <= _CHECKSUM_COLUMNS:  # one slice: three kernels
        return (words.to(torch.int64) * weights).sum(dim=1)
    sums = torch.zeros(words.shape[0], dtype=torch.int64, device=words.device)
    for start in range(0, words.shape[1], _CHECKSUM_COLUMNS):
        part = slice(start, start + _CHECKSUM_COLUMNS)
        sums += (words[:, part].to(torch.int64) * weights[part]).sum(dim=1)
    return sums


def fold_checksum(positions: list[int], sums: list[int]) -> int:
    """The 32-bit checksum of kept values at `positions` (in order) with row sums `sums`."""
    h = 0
    for position, s in zip(positions, sums):
        h = (h * 1_000_003 + position * 7919 + s) % _MERSENNE_61
    return (h ^ (h >> 32)) & 0xFFFFFFFF


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


class _Candidates:
    """Rows `at` of a message that may go one way (as deltas, first sights or losslessly): the payload a message of
    them alone would be (their mode bytes, then their coded segments; None: lossless, sent as they are), what m(ξ)
    would become, and `verdicts_of` them — read together with every other kind's in one wait for the device
    (`read_all` fills `fits` and `sums`). `lent`: the tensors are a CUDA graph's own buffers (see `graphed`)."""

    def __init__(self, at: list[int], values: torch.Tensor, verdicts: torch.Tensor,
                 payload: torch.Tensor | None = None, lent: bool = False) -> None:
        self.at, self.values, self.verdicts, self.payload, self.lent = at, values, verdicts, payload, lent
        n = len(at)
        self.segments = None if payload is None else payload[n:].view(n, -1)
        self.fits: list[bool] = []
        self.sums: list[int] = []

    def owned(self) -> _Candidates:
        """These rows with values of their own (copies of a graph's buffers, which its next replay writes), for a
        store that may keep what it is given as it is."""
        if self.lent:
            self.values, self.lent = self.values.clone(), False
        return self

    @staticmethod
    def read_all(groups: list[_Candidates]) -> None:
        """Read every group's verdicts from the device at once, and fill each group's `fits` and `sums`."""
        if not groups:
            return
        numbers = (groups[0].verdicts if len(groups) == 1 else torch.cat([g.verdicts for g in groups])).tolist()
        start = 0
        for g in groups:
            n = len(g.at)
            g.fits = [bool(v) for v in numbers[start:start + n]]
            g.sums = numbers[start + n:start + 2 * n]
            start += 2 * n


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


def _row_norms(t: torch.Tensor) -> torch.Tensor:
    """Each sample's norm, in float32 (no full-size float64 copy)."""
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1)


def _fidelity_norms(x: torch.Tensor, m_old: torch.Tensor, change: torch.Tensor, m_new: torch.Tensor
                    ) -> torch.Tensor:
    """Per sample [B, 3]: the norm of the activation `x`, of its change since m(ξ), and of what m(ξ) still misses
    after the update in the store's dtype — what the receiver computes on. One full-size temporary: m_new − m_old −
    change = m_new − x."""
    error = m_new.to(torch.float32, copy=True).sub_(m_old).sub_(change)
    return torch.stack([_row_norms(x), _row_norms(change), _row_norms(error)], dim=1)


def _fidelity(norms: torch.Tensor, as_delta: list[int]) -> DeltaFidelity:
    """The three norms of `_fidelity_norms`, squared and summed in float64 over the samples sent as deltas (rows
    `as_delta`)."""
    return DeltaFidelity(rows_of(norms, as_delta).double().square_().sum(dim=0))


class AQSGDCodec(LinkCodec):
    """Delta quantization against the per-sample message store, one side of one link. Its parts: `delta`, the coder
    of a known sample's change (default: B-bit quantization with the options' scales and grid), and `first_sight`,
    the coder of a sample without m(ξ) once the link compresses (None: lossless)."""

    code = CODE_AQSGD
    keeps_messages = True
    raw_messages = False

    @classmethod
    def from_spec(cls, spec: CodecSpec, parts: CodecParts) -> AQSGDCodec:
        first = None if parts.first_sight == "fp32" else sample_coder(parts.first_sight, parts.options)
        return cls(spec.bits, parts.store_view, parts.options, parts.check, parts.device,
                   delta=_delta_coder(spec, parts.options), first_sight=first)

    @classmethod
    def message_bytes(cls, spec: CodecSpec, shape: tuple[int, ...], dtype: torch.dtype, options: QuantOptions,
                      first_sight: str = "fp32", first_sights: bool = False) -> int:
        """A mode byte per sample, then every sample's delta — or, with `first_sights`, its first sight: the
        `first_sight` coder's row, or (fp32) its values in the activation's own lossless dtype."""
        if not first_sights:
            coder: SampleCoder = _delta_coder(spec, options)
        elif first_sight == "fp32":
            coder = CastCoder("fp32", dtype if dtype in LOSSLESS_MODES else torch.float32)
        else:
            coder = sample_coder(first_sight, options)
        return shape[0] + shape[0] * coder.sample_bytes(shape)

    def __init__(self, bits: int, view: SampleMemory, options: QuantOptions, check: bool = True,
                 device: torch.device = HOST, delta: SampleCoder | None = None,
                 first_sight: SampleCoder | None = None) -> None:
        self.bits, self.view, self.options, self.check, self.device = bits, view, options, check, device
        self._generator = generator_on(device, options.seed * 7919 + view.link)
        self.delta = delta if delta is not None else QuantCoder(bits, options)
        rotated = isinstance(self.delta, RotatedCoder)  # its own name and header code: the peer must rotate too
        self.name, self.code = (f"aqsgd-rtq:{bits}", CODE_AQSGD_RTQ) if rotated else (f"aqsgd:{bits}", CODE_AQSGD)
        self.first_sight = first_sight
        for part in (self.delta, self.first_sight):  # stochastic rounding draws from this codec's generator
            if part is not None and hasattr(part, "generator"):
                part.generator = self._generator
        # this codec's CUDA graphs: named by a serial (its coders and store rule are fixed for its life), dropped
        # with it, and never made where a part rounds stochastically (a replay would repeat its random draws)
        self._graphs = f"aqsgd-{next(_serials)}"
        weakref.finalize(self, forget, self._graphs)
        self._replayable = not any(getattr(getattr(part, "options", None), "stochastic", False)
                                   for part in (self.delta, self.first_sight)) and not options.stochastic

    # -- sender ------------------------------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, ids: torch.Tensor, compress: bool = True) -> Encoded:
        """Quantized deltas for samples with an m(ξ); for the others the first-sight coder's rows, or (while not
        compressing, or without one) the lossless values.

        A sample whose new m(ξ) would not be finite in the store's dtype (an activation beyond fp16's range, an inf
        or NaN) goes losslessly instead, and if even that value cannot be stored, m(ξ) is dropped on both sides
        (counted as `overflow`) rather than kept poisoned for every later epoch."""
        x = tensor.detach().float().contiguous()
        id_list = ids.tolist()
        b = len(id_list)
        modes = [MODE_DELTA if k else MODE_FIRST for k in self.view.contains(id_list)] if compress \
            else [MODE_FULL] * b
        if self.first_sight is None:
            modes = [MODE_FULL if m == MODE_FIRST else m for m in modes]
        flags = (self.bits << 8) | (0 if self.check else FLAG_NO_CHECK)
        # Every kind of row is coded first; whether each can go that way (in the coder's range, its new m(ξ)
        # storable) and the checksum sums are then read in one wait for the device, not one per question. A graph's
        # outputs are lent (on a GPU: its own buffers, used before its next replay, or copied).
        lend = self._borrows(x.device)
        delta = [i for i, m in enumerate(modes) if m == MODE_DELTA]
        groups: dict[int, _Candidates] = {}
        if delta:
            m_old = self._recall([id_list[i] for i in delta], x.device)
            payload, m_new, verdicts, norms, squares = self._graphed(
                "delta-encode", self._delta_rows, rows_of(x, delta), m_old, borrow=lend)
            groups[MODE_DELTA] = _Candidates(delta, m_new, verdicts, payload, lend)
        if first := [i for i, m in enumerate(modes) if m == MODE_FIRST]:
            payload, seeds, verdicts = self._graphed("first-encode", self._first_rows, rows_of(x, first), borrow=lend)
            groups[MODE_FIRST] = _Candidates(first, seeds, verdicts, payload, lend)
        if full := [i for i, m in enumerate(modes) if m == MODE_FULL]:
            groups[MODE_FULL] = self._lossless(full, x)
        _Candidates.read_all(list(groups.values()))
        if len(groups) == 1 and all((only := next(iter(groups.values()))).fits):
            # one kind of sample, each going its way (the steady state: all deltas): the payload in one piece
            self.view.scatter(id_list, only.values)
            check = fold_checksum(list(range(b)), only.sums) if self.check else 0
            fidelity = DeltaFidelity(squares.clone() if lend else squares) if delta else None
            wire = only.payload if only.payload is not None else _lossless_payload(tensor)
            return Encoded.of(wire, tuple(x.shape), torch.uint8, codec_check=check, flags=flags, fidelity=fidelity)
        as_delta = [j for j, ok in enumerate(groups[MODE_DELTA].fits) if ok] if delta else []
        return self._encode_mixed(tensor, x, id_list, modes, [g.owned() for g in groups.values()], flags,
                                  _fidelity(norms, as_delta) if as_delta else None)

    def _encode_mixed(self, tensor: torch.Tensor, x: torch.Tensor, id_list: list[int], modes: list[int],
                      groups: list[_Candidates], flags: int, fidelity: DeltaFidelity | None) -> Encoded:
        """A message of several kinds of sample, or with rows that cannot go their way (sent losslessly instead),
        its verdicts read: each row's segment in order, and m(ξ) kept row by row."""
        b = len(id_list)
        lossless_dtype = lossless_dtype_of(tensor)
        segments: list[torch.Tensor | None] = [None] * b
        new_m: list[torch.Tensor | None] = [None] * b
        sums: list[int] = [0] * b
        late = []  # rows a coder could not carry, or whose coded m(ξ) could not be stored: sent losslessly
        for group in groups:
            if group.segments is None:
                continue
            for j, i in enumerate(group.at):
                if group.fits[j]:
                    segments[i], new_m[i], sums[i] = group.segments[j], group.values[j], group.sums[j]
                else:
                    late.append(i)
        lossless = [g for g in groups if g.segments is None]
        if late:
            lossless.append(self._lossless(sorted(late), x).owned())
            _Candidates.read_all(lossless[-1:])
        raw = tensor.detach().to(lossless_dtype)
        for group in lossless:
            for j, i in enumerate(group.at):
                modes[i] = LOSSLESS_MODES[lossless_dtype]
                segments[i] = raw[i].contiguous().view(torch.uint8).reshape(-1)
                new_m[i], sums[i] = (group.values[j], group.sums[j]) if group.fits[j] else (None, 0)
        self.view.store.stats.overflow += len(keep(self.view, id_list, new_m))
        mode_bytes = to_device(torch.tensor(modes, dtype=torch.uint8), x.device)
        kept = [i for i in range(b) if new_m[i] is not None]
        check = fold_checksum(kept, [sums[i] for i in kept]) if self.check else 0
        return Encoded.of(torch.cat([mode_bytes, *(s.reshape(-1) for s in _every(segments))]), tuple(x.shape),
                          torch.uint8, codec_check=check, flags=flags, fidelity=fidelity)

    def _borrows(self, device: torch.device) -> bool:
        """Whether this codec's graphed calls on `device` may hand back a graph's own buffers."""
        return self._replayable and may_replay(device)

    def _graphed(self, kind: str, fn: Callable[..., tuple[torch.Tensor, ...]], *tensors: torch.Tensor,
                 borrow: bool = False) -> tuple[torch.Tensor, ...]:
        """`fn(*tensors)`, replayed from this codec's CUDA graph of `kind` on a GPU where it may be (`borrow`: see
        `graphed`)."""
        if not self._replayable:
            return fn(*tensors)
        return graphed((self._graphs, kind), fn, *tensors, borrow=borrow)

    def _delta_rows(self, x: torch.Tensor, m_old: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Known samples `x` against their m(ξ) (`m_old`, in the store's dtype): the payload of a message of them all
        as deltas (their mode bytes, then the coded changes), the new m(ξ) — updated from exactly the codes and fp16
        scales the receiver will unpack — the verdicts (whether each row can go as a delta, its checksum sums), the
        fidelity norms per row, and their squares summed over the rows."""
        quant = self._fused_delta(m_old)
        fast = quant and fused.delta_encode(x, m_old, quant.bits, quant.options.grid, CHECKSUM_WEIGHTS)
        if fast:  # the same bits in two kernels on a GPU
            coded, m_new, sums, norms = fast
        else:
            m_old = m_old.float()
            change = x - m_old
            coded, deq = self.delta.encode(change, values=True)
            m_new = (m_old + present(deq)).to(self.view.dtype)
            sums, norms = row_sums(m_new), _fidelity_norms(x, m_old, change, m_new)
        ok = self._sendable(self.delta.carried(x, coded), m_new)
        return _payload(MODE_DELTA, coded), m_new, verdicts_of(ok, sums), norms, norms.double().square_().sum(dim=0)

    def _first_rows(self, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """First sights `values`: the payload of a message of them alone (mode bytes, then their coded rows), the
        m(ξ) they seed, and the verdicts (whether each can go so, its checksum sums)."""
        coder = present(self.first_sight)
        coded, deq = coder.encode(values, values=True)
        seeds = present(deq).to(self.view.dtype, copy=True)
        return (_payload(MODE_FIRST, coded), seeds,
                verdicts_of(self._sendable(coder.carried(values, coded), seeds), row_sums(seeds)))

    def _delta_values(self, rows: torch.Tensor, m_old: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The receiver's side of `_delta_rows`: the new m(ξ) from the coded rows, it in float32, and the verdicts
        (each row kept — the sender sent a delta only where it could be — and its checksum sums)."""
        quant = self._fused_delta(m_old)
        fast = quant and fused.delta_decode(rows, m_old, quant.bits, quant.options.grid, CHECKSUM_WEIGHTS)
        if fast:
            seeds, values, sums = fast
        else:
            seeds = (m_old.float() + self.delta.decode(rows, tuple(m_old.shape))).to(self.view.dtype)
            values, sums = seeds.float(), row_sums(seeds)
        return seeds, values, verdicts_of(torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device), sums)

    def _fused_delta(self, m_old: torch.Tensor) -> QuantCoder | None:
        """The delta coder, where its coding and m(ξ)'s update run as fused kernels (`aqpipe.compress.fused`, when
        asked: `fused.delta_fusable`): a nearest-rounding `QuantCoder` on a batch they take, m(ξ) in a 16-bit dtype;
        else None."""
        delta = self.delta
        if type(delta) is not QuantCoder or delta.options.stochastic:
            return None
        options = delta.options
        fusable = fused.delta_fusable(m_old.device, tuple(m_old.shape), m_old.dtype, delta.bits, options.per,
                                      options.grid)
        return delta if fusable else None

    def _recall(self, ids: list[int], device: torch.device) -> torch.Tensor:
        """m(ξ) of `ids`, as one batch on `device` in the store's dtype (a slab store's one gather; from host RAM
        in one copy the host does not wait for)."""
        return to_device(self.view.gather(ids), device)

    def _sendable(self, carried: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """Per row, on the device: the coder carried the row without clipping (its fp16 scales below 65504, a cast
        finite) and the store can keep `stored`."""
        return carried & self.view.storable_rows(stored)

    def _lossless(self, at: list[int], x: torch.Tensor) -> _Candidates:
        """Rows `at` sent losslessly: m(ξ) becomes the value itself (a copy, never a view of the live activation),
        or, where the store cannot keep it, is dropped on both sides."""
        return self._seeded(at, rows_of(x, at), self._borrows(x.device))

    def _seeded(self, at: list[int], values: torch.Tensor, lend: bool) -> _Candidates:
        """Rows `at` whose m(ξ) the values `values` (float32) seed: in the store's dtype, with their verdicts
        (`lend`: see `graphed`'s borrow)."""
        seeds, verdicts = self._graphed("seed", self._seeds, values, borrow=lend)
        return _Candidates(at, seeds, verdicts, lent=lend)

    def _seeds(self, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The m(ξ) that `values` seed (a copy in the store's dtype) and their verdicts (whether the store can keep
        each, its checksum sums)."""
        seeds = values.to(self.view.dtype, copy=True)
        return seeds, verdicts_of(self.view.storable_rows(seeds), row_sums(seeds))

    def forget(self, ids: list[int]) -> None:
        """Drop m(ξ) of samples the receiver lacks, so that their next message seeds it again."""
        if ids:
            self.view.delete(ids)

    # -- receiver ----------------------------------------------------------------------------------------------
    def missing(self, ids: list[int]) -> list[int]:
        """The samples among `ids` whose m(ξ) this side lacks (never seen, or found damaged and dropped)."""
        return [i for i, held in zip(ids, self.view.present(ids)) if not held]

    def _segment_bytes(self, shape: tuple[int, ...]) -> dict[int, int]:
        """Each mode's segment length for a message of `shape`."""
        n = numel(shape[1:])
        sizes = {mode: n * dtype.itemsize for mode, dtype in MODE_DTYPES.items()}
        sizes[MODE_DELTA] = self.delta.sample_bytes(shape)
        if self.first_sight is not None:
            sizes[MODE_FIRST] = self.first_sight.sample_bytes(shape)
        return sizes

    def _payload_problem(self, header) -> str | None:
        """The length varies with each sample's mode; it must lie between all-shortest and all-longest."""
        problem = batch_problem(header)
        if problem:
            return problem
        b = header.shape[0]
        sizes = self._segment_bytes(header.shape).values()
        low, high = b + b * min(sizes), b + b * max(sizes)
        if not low <= header.payload_len <= high:
            return f"payload length {header.payload_len} is outside {low}..{high} for shape {header.shape}"
        return None

    def _read_layout(self, header, payload: torch.Tensor) -> list[int]:
        """Each sample's mode byte, read on the host bytes and checked against the payload's length."""
        b = header.shape[0]
        modes = payload[:b].tolist()
        sizes = self._segment_bytes(header.shape)
        if any(m not in sizes for m in modes):
            unknown = sorted(set(modes) - set(sizes))
            if MODE_FIRST in unknown:
                raise CodecError("the peer sends quantized first sights but this side has no --first-sight coder "
                                 "(the two sides of a link must be given the same --first-sight)")
            raise CodecError(f"aqsgd payload has unknown sample modes {unknown}")
        if b + sum(sizes[m] for m in modes) != payload.numel():
            raise CodecError(f"aqsgd payload of {payload.numel()} bytes does not match its sample modes")
        return modes

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor, layout: Any = None) -> torch.Tensor:
        """Rebuild the activation and update this side's m(ξ) exactly as the sender did (`layout`: the samples'
        modes)."""
        shape = header.shape
        b = shape[0]
        modes: list[int] = layout
        id_list = ids.tolist()
        kinds = self._kinds(modes, payload, shape)
        # a graph's outputs are lent only to a message of one kind: two kinds may replay one graph (two seeds of
        # one shape), whose second replay would write the first's outputs before they are read
        lend = self._borrows(self.device) and len(kinds) == 1
        groups, outs = [], []
        for mode, (rows, at) in kinds.items():
            if mode != MODE_DELTA:  # a lossless value or a first sight: kept where the store can (the sender's rule)
                values = (bytes_as(rows, MODE_DTYPES[mode]).view(len(at), *shape[1:]).float() if mode in MODE_DTYPES
                          else present(self.first_sight).decode(rows, (len(at), *shape[1:])))
                group = self._seeded(at, values, lend)
            else:  # the sender sent a delta only where the new m(ξ) could be kept
                seeds, values, verdicts = self._graphed("delta-decode", self._delta_values, rows,
                                                        self._recall_sent([id_list[i] for i in at]), borrow=lend)
                group = _Candidates(at, seeds, verdicts, lent=lend)
                if lend:
                    values = values.clone()  # the activation is the caller's own
            groups.append(group)
            outs.append(values)
        if len(groups) == 1:  # one kind of sample (the steady state: all deltas)
            out = outs[0]
        else:
            out = torch.empty(shape, dtype=torch.float32, device=self.device)
            for group, values in zip(groups, outs):
                out.index_copy_(0, to_device(torch.tensor(group.at, dtype=torch.int64), out.device), values)
        # whether each new m(ξ) may be kept (the sender's rule, on the same values) and the checksum sums, read in
        # one wait for the device
        _Candidates.read_all(groups)
        if len(groups) == 1 and all(groups[0].fits):
            self._verify(header, fold_checksum(list(range(b)), groups[0].sums))
            self.view.scatter(id_list, groups[0].values)
            return out
        new_m: list[torch.Tensor | None] = [None] * b
        sums: list[int] = [0] * b
        for group in groups:
            group.owned()
            for j, i in enumerate(group.at):
                if group.fits[j]:
                    new_m[i], sums[i] = group.values[j], group.sums[j]
        kept = [i for i in range(b) if new_m[i] is not None]
        self._verify(header, fold_checksum(kept, [sums[i] for i in kept]))
        keep(self.view, id_list, new_m)
        return out

    def _kinds(self, modes: list[int], payload: torch.Tensor, shape: tuple[int, ...]
               ) -> dict[int, tuple[torch.Tensor, list[int]]]:
        """The payload's segments by mode: each mode's rows [n, segment bytes] and the samples they belong to. A
        message of one kind of sample is its payload's rows as they are."""
        b = shape[0]
        if b and len(set(modes)) == 1:
            return {modes[0]: (payload[b:].view(b, -1), list(range(b)))}
        sizes = self._segment_bytes(shape)
        parts: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        offset = b
        for i, mode in enumerate(modes):
            rows, at = parts.setdefault(mode, ([], []))
            rows.append(payload[offset : offset + sizes[mode]])
            at.append(i)
            offset += sizes[mode]
        return {mode: (torch.stack(rows), at) for mode, (rows, at) in parts.items()}

    def _recall_sent(self, ids: list[int]) -> torch.Tensor:
        """m(ξ) of samples the sender sent as deltas, on this side's device."""
        try:
            return self._recall(ids, self.device)
        except KeyError as e:
            raise CodecError(f"m(xi) diverged: the sender sent a delta but this side has never seen the "
                             f"sample ({e.args[0]})") from None

    def _verify(self, header, check: int) -> None:
        """Refuse a message after which this side's m(ξ) would differ from the sender's (unless it sent no check)."""
        if not header.flags & FLAG_NO_CHECK and check != header.codec_check:
            raise CodecError(f"m(xi) diverged on link {self.view.link}: this side's copy fails the sender's checksum "
                             f"at step {header.step} micro-batch {header.micro_batch}")


def lossless_dtype_of(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a sample of `tensor` goes losslessly in: its own (fp32, bf16, fp16), else fp32."""
    return tensor.dtype if tensor.dtype in LOSSLESS_MODES else torch.float32


def _payload(mode: int, coded: torch.Tensor) -> torch.Tensor:
    """The payload of a message whose every sample goes in `mode`, with the coded rows `coded` [B, segment bytes]."""
    modes = torch.full((coded.shape[0],), mode, dtype=torch.uint8, device=coded.device)
    return torch.cat([modes, coded.reshape(-1)])


def _lossless_payload(tensor: torch.Tensor) -> torch.Tensor:
    """The payload of a message whose every sample goes losslessly, in the activation's own dtype."""
    raw = tensor.detach().to(lossless_dtype_of(tensor)).contiguous()
    return _payload(LOSSLESS_MODES[raw.dtype], raw.view(torch.uint8).reshape(raw.shape[0], -1))


def _delta_coder(spec: CodecSpec, options: QuantOptions) -> SampleCoder:
    """The coder of a known sample's change: B-bit quantization with the options' scales, or rotated tiles."""
    return RotatedCoder(spec.bits, options) if spec.kind == "aqsgd-rtq" else QuantCoder(spec.bits, options)


def present(value):
    """`value`, which the code before has set (not None)."""
    if value is None:
        raise RuntimeError("an AQ-SGD part used where none was set")
    return value


def _every(items: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """`items`, each of which the code before has set."""
    filled = [item for item in items if item is not None]
    if len(filled) != len(items):
        raise RuntimeError("an AQ-SGD message left a sample without its segment")
    return filled
