"""AQ-SGD (Wang et al. 2022, Algorithm 1): send Q(a(ξ) − m(ξ)) and let both sides set m(ξ) ← m(ξ) + Q(a(ξ) − m(ξ)).

A sample with no m(ξ) yet (first sight, a re-seed, or any sample during the warm-up epochs) seeds m(ξ) on both
sides from the same bytes: losslessly, in the activation's own dtype (fp32, or bf16/fp16 under mixed precision), or
— outside the warm-up, with a first-sight coder (`--first-sight rtq:4`) — quantized, both sides seeding m(ξ) from
exactly the dequantized values. The change of a known sample goes through the delta coder (B-bit quantization with
per-sample scales). Payload: one mode byte per sample (`aqsgd_rows`), then each sample's segment in order. The header
carries a checksum of the m(ξ) values the receiver must end up with, so a divergence of the two copies is caught at
the first message (a GPU receiver checks a message of deltas once its sums reach the host, by the end of its step at
the latest: `late_checks`).

The arithmetic runs on the activation's device (a GPU's m(ξ) update never visits the host); m(ξ) is kept wherever
the store keeps it, and moved to the device for the update. On a GPU each kind of row is coded by one replayed CUDA
graph whose outputs the codec borrows (`aqpipe.compress.gpu.cuda_graphs`), and a message of one kind of sample — the
steady state — goes as that graph's payload, its m(ξ) read and written in one gather and one scatter. A large
message's deltas (`fused.delta_fusable`) go through fused kernels instead (`aqsgd_fused`), which read m(ξ) in place
from a slab store's rows and write the payload whole: m(ξ) is never gathered, and (once the kernels have run in the
process, for a batch of distinct samples) the new m(ξ) is written over the old in those rows, with no scatter — from
then on replayed from a graph of their own that holds the slab where it lies.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from aqpipe.compress.gpu.copies import HOST, to_device, to_host
from aqpipe.compress.gpu.cuda_graphs import forget, graphed, may_replay
from aqpipe.compress.gpu.graph_memory import GraphCall, stand_in
from aqpipe.compress.link.aqsgd_fused import FusedDelta, fused_delta
from aqpipe.compress.link.aqsgd_rows import (
    LATE_CHECKED,
    LOSSLESS_MODES,
    MODE_DELTA,
    MODE_DTYPES,
    MODE_FIRST,
    MODE_FULL,
    MODE_FULL_BF16,
    MODE_FULL_FP16,
    Candidates,
    SampleMemory,
    delta_fidelity,
    every,
    keep,
    lossless_dtype_of,
    lossless_payload,
    present,
    read_modes,
    rows_of,
    segments_by_mode,
)
from aqpipe.compress.link.aqsgd_steps import RowSteps
from aqpipe.compress.link.base import CodecParts, DeltaFidelity, Encoded, LinkCodec, bytes_as, generator_on, numel
from aqpipe.compress.link.checksum import fold_checksum, refuse_divergence, store_checksum
from aqpipe.compress.link.codes import CODE_AQSGD, CODE_AQSGD_RTQ, FLAG_NO_CHECK
from aqpipe.compress.link.late_checks import LateChecks
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.sample_coders import (
    CastCoder,
    QuantCoder,
    RotatedCoder,
    SampleCoder,
    batch_problem,
    coder_calls,
    delta_coder,
    sample_coder,
)
from aqpipe.compress.link.specs import LOSSLESS, CodecError, CodecSpec

__all__ = ["AQSGDCodec", "MODE_DELTA", "MODE_FIRST", "MODE_FULL", "MODE_FULL_BF16", "MODE_FULL_FP16", "SampleMemory",
           "store_checksum"]
_serials = itertools.count()


class AQSGDCodec(LinkCodec):
    """Delta quantization against the per-sample message store, one side of one link. Its parts: `delta`, the coder
    of a known sample's change (default: B-bit quantization with the options' scales and grid), and `first_sight`,
    the coder of a sample without m(ξ) once the link compresses (None: lossless)."""

    code = CODE_AQSGD
    keeps_messages = True
    raw_messages = False

    @classmethod
    def from_spec(cls, spec: CodecSpec, parts: CodecParts) -> AQSGDCodec:
        first = None if parts.first_sight.lossless else sample_coder(parts.first_sight, parts.options)
        return cls(spec.bits, parts.store_view, parts.options, parts.check, parts.device,
                   delta=delta_coder(spec, parts.options), first_sight=first)

    @classmethod
    def message_bytes(cls, spec: CodecSpec, shape: tuple[int, ...], dtype: torch.dtype, options: QuantOptions,
                      first_sight: CodecSpec = LOSSLESS, first_sights: bool = False) -> int:
        """A mode byte per sample, then every sample's delta — or, with `first_sights`, its first sight: the
        `first_sight` coder's row, or (fp32) its values in the activation's own lossless dtype."""
        if not first_sights:
            coder: SampleCoder = delta_coder(spec, options)
        elif first_sight.lossless:
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
        self.steps = RowSteps(self.delta, self.first_sight, view)  # each kind of row's arithmetic, in torch ops
        self._sizes: dict[tuple[int, ...], dict[int, int]] = {}  # each mode's segment length, by message shape
        # this codec's CUDA graphs: named by a serial (its coders and store rule are fixed for its life), dropped
        # with it, and never made where a part rounds stochastically (a replay would repeat its random draws)
        self._graphs = f"aqsgd-{next(_serials)}"
        weakref.finalize(self, forget, self._graphs)
        self._replayable = not any(getattr(getattr(part, "options", None), "stochastic", False)
                                   for part in (self.delta, self.first_sight)) and not options.stochastic
        # on a GPU a receiver checks a delta message's checksum once its sums reach the host, not while it waits
        # (a function of the link, not a method: a codec that is dropped goes at once, its graphs with it, with no
        # reference cycle through its checks to wait for the garbage collector)
        self.late_checks: LateChecks | None = (LateChecks(functools.partial(refuse_divergence, view.link))
                                               if device.type == "cuda" else None)

    # -- sender ------------------------------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, ids: torch.Tensor, compress: bool = True) -> Encoded:
        """Quantized deltas for samples with an m(ξ); for the others the first-sight coder's rows, or (while not
        compressing, or without one) the lossless values.

        A sample whose new m(ξ) would not be finite in the store's dtype (an activation beyond fp16's range, an inf
        or NaN) goes losslessly instead, and if even that value cannot be stored, m(ξ) is dropped on both sides
        (counted as `overflow`) rather than kept poisoned for every later epoch."""
        raw = tensor.detach()
        # in float32, made where a path codes it so (the fused delta step reads a bf16 or fp16 activation as it is)
        floats = _once(lambda: raw.float().contiguous())
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
        lend = self._borrows(raw.device)
        delta = [i for i, m in enumerate(modes) if m == MODE_DELTA]
        groups: dict[int, Candidates] = {}
        queued = squares = None
        if delta:
            payload, m_new, verdicts, norms, squares, lent = self._delta_encode(raw, floats, delta, id_list, lend)
            groups[MODE_DELTA] = Candidates(delta, m_new, verdicts, payload, lent)
            if len(delta) == b:  # (the steady state) the verdicts' copy to the host queued, then the bytes' — which
                # goes on while the host, waiting for the verdicts alone, reads them and builds the message — and the
                # fidelity squares made its own, that call's host time hidden behind the device's work; wasted only
                # where a row cannot go
                groups[MODE_DELTA].fetch()
                queued = to_host(payload)
                squares = squares.clone() if lent else squares
        if first := [i for i, m in enumerate(modes) if m == MODE_FIRST]:
            payload, seeds, verdicts = self._graphed("first-encode", self.steps.first_rows, rows_of(floats(), first),
                                                       borrow=lend)
            groups[MODE_FIRST] = Candidates(first, seeds, verdicts, payload, lend)
        if full := [i for i, m in enumerate(modes) if m == MODE_FULL]:
            groups[MODE_FULL] = self._lossless(full, floats())
        Candidates.read_all(list(groups.values()))
        if len(groups) == 1 and all((only := next(iter(groups.values()))).fits):
            # one kind of sample, each going its way (the steady state: all deltas): the payload in one piece
            if only.values is not None:  # (else the kernels wrote m(ξ) in place)
                self.view.scatter(id_list, only.values)
            check = fold_checksum(list(range(b)), only.sums) if self.check else 0
            fidelity = DeltaFidelity(squares) if squares is not None else None
            wire = only.payload if only.payload is not None else lossless_payload(tensor)
            return Encoded.of(wire, tuple(raw.shape), torch.uint8, queued, codec_check=check, flags=flags,
                              fidelity=fidelity)
        as_delta = [j for j, ok in enumerate(groups[MODE_DELTA].fits) if ok] if delta else []
        self._read_back(list(groups.values()), id_list, raw.device)
        return self._encode_mixed(tensor, floats(), id_list, modes, [g.owned() for g in groups.values()], flags,
                                  delta_fidelity(norms, as_delta) if as_delta else None)

    def _delta_encode(self, raw: torch.Tensor, floats: Callable[[], torch.Tensor], at: list[int], id_list: list[int],
                      lend: bool) -> tuple[Any, ...]:
        """Rows `at` of the activation as deltas (`raw`: as given, `floats()`: in float32): `RowSteps.delta_rows`' outputs and
        whether they are lent (a CUDA graph's buffers). Where the fused kernels take the rows, they read the
        activation as it is and m(ξ) where the store keeps it (a slab's rows, read and written in place: the new m(ξ)
        is then None; in the steady state from their graph, `aqsgd_fused`); else the torch ops run, replayed from a
        graph on a GPU."""
        ids = [id_list[i] for i in at]
        step = self._fused_delta(raw.device, (len(at), *raw.shape[1:]))
        if step is not None:
            m, slots = self._rows_of(ids, raw.device)
            done = step.encode(rows_of(raw, at), m, slots, ids, lend)
            if done is not None:
                return done
        x = rows_of(floats(), at)
        return (*self._graphed("delta-encode", self.steps.delta_rows, x, self._recall(ids, x.device), borrow=lend), lend)

    def _encode_mixed(self, tensor: torch.Tensor, x: torch.Tensor, id_list: list[int], modes: list[int],
                      groups: list[Candidates], flags: int, fidelity: DeltaFidelity | None) -> Encoded:
        """A message of several kinds of sample, or with rows that cannot go their way (sent losslessly instead),
        its verdicts read: each row's segment in order, and m(ξ) kept row by row."""
        b = len(id_list)
        lossless_dtype = lossless_dtype_of(tensor)
        segments: list[torch.Tensor | None] = [None] * b
        new_m: list[torch.Tensor | None] = [None] * b
        sums: list[int] = [0] * b
        late = []  # rows a coder could not carry, or whose coded m(ξ) could not be stored: sent losslessly
        for group in groups:
            coded = group.segments
            if coded is None:
                continue
            for j, i in enumerate(group.at):
                if group.fits[j]:
                    segments[i], new_m[i], sums[i] = coded[j], present(group.values)[j], group.sums[j]
                else:
                    late.append(i)
        lossless = [g for g in groups if g.payload is None]
        if late:
            lossless.append(self._lossless(sorted(late), x).owned())
            Candidates.read_all(lossless[-1:])
        raw = tensor.detach().to(lossless_dtype)
        for group in lossless:
            for j, i in enumerate(group.at):
                modes[i] = LOSSLESS_MODES[lossless_dtype]
                segments[i] = raw[i].contiguous().view(torch.uint8).reshape(-1)
                new_m[i], sums[i] = (present(group.values)[j], group.sums[j]) if group.fits[j] else (None, 0)
        self.view.store.stats.overflow += len(keep(self.view, id_list, new_m))
        mode_bytes = to_device(torch.tensor(modes, dtype=torch.uint8), x.device)
        kept = [i for i in range(b) if new_m[i] is not None]
        check = fold_checksum(kept, [sums[i] for i in kept]) if self.check else 0
        return Encoded.of(torch.cat([mode_bytes, *(s.reshape(-1) for s in every(segments))]), tuple(x.shape),
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
        return graphed(self._graph_key(kind), fn, *tensors, borrow=borrow)

    def _graph_key(self, kind: str) -> tuple[str, str]:
        """The key this codec's graph of `kind` is filed under (`forget` drops every key of its serial)."""
        return (self._graphs, kind)

    def graph_calls(self, shape: tuple[int, ...], sending: bool, warmup: bool = False) -> list[GraphCall]:
        """The graphs a message of `shape` in the steady state replays at this end (a message mixing kinds of sample
        replays smaller ones besides): deltas, first sights (with a first-sight coder) and lossless seeds — a
        sender's only where whole messages go losslessly (`warmup` epochs, or no first-sight coder); a receiver's
        seeds its first sights too. Where a part rounds stochastically nothing of this codec's is replayed, but a
        receiver's coders still replay their decodes."""
        if not self._replayable:
            return [] if sending else [call for coder in (self.delta, self.first_sight) if coder is not None
                                       for call in coder_calls(coder, shape, sending=False)]
        x, m_old = stand_in(shape, torch.float32), stand_in(shape, self.view.dtype)
        step = self._fused_delta(torch.device("meta"), shape)
        if step is None and sending:
            deltas = [self._graph_call("delta-encode", self.steps.delta_rows, x, m_old)]
        elif step is None:
            rows = stand_in((shape[0], self.delta.sample_bytes(shape)), torch.uint8)
            deltas = [self._graph_call("delta-decode", self.steps.delta_values, rows, m_old)]
        else:  # (the fused step replays a graph only over a slab's rows; over m(ξ) kept otherwise it runs ungraphed)
            deltas = step.graph_calls(shape, m_old.dtype, sending) if self.view.keeps_rows else []
        if sending:
            calls = deltas
            if self.first_sight is not None:
                calls.append(self._graph_call("first-encode", self.steps.first_rows, x))
            if self.first_sight is None or warmup:
                calls.append(self._graph_call("seed", self.steps.seeds, x))
            return calls
        calls = deltas + [self._graph_call("seed", self.steps.seeds, x)]
        if self.first_sight is not None:  # a quantizing first-sight coder's decode is a graph of its own
            calls += coder_calls(self.first_sight, shape, sending=False)
        return calls

    def _graph_call(self, kind: str, fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor
                    ) -> GraphCall:
        """This codec's graph of `kind` (see `_graphed`), on stand-in inputs."""
        return GraphCall(kind, fn, inputs, self._graph_key(kind))

    def _fused_delta(self, device: torch.device, shape: tuple[int, ...]) -> FusedDelta | None:
        """The delta step as fused kernels, for delta rows of `shape` on `device` (`aqsgd_fused.fused_delta`),
        replayed from this codec's graphs where it may be; else None."""
        return fused_delta(self.delta, device, shape, self.view.dtype,
                           self._graphs if self._replayable else None)

    def _rows_of(self, ids: list[int], device: torch.device) -> tuple[torch.Tensor, list[int] | None]:
        """Where m(ξ) of `ids` is, for the fused kernels to read in place: a slab on `device` and their slots in it
        (numbers on the host, from which the step makes its index: see `FusedDelta`), or, from any other store, the
        values gathered (`_recall`) and None."""
        rows = self.view.slots(ids)
        if rows is not None and rows[0].device == device:
            return rows
        return self._recall(ids, device), None

    def _recall(self, ids: list[int], device: torch.device) -> torch.Tensor:
        """m(ξ) of `ids`, as one batch on `device` in the store's dtype (a slab store's one gather; from host RAM
        in one copy the host does not wait for)."""
        return self.view.gather(ids, device)

    def _lossless(self, at: list[int], x: torch.Tensor) -> Candidates:
        """Rows `at` sent losslessly: m(ξ) becomes the value itself (a copy, never a view of the live activation),
        or, where the store cannot keep it, is dropped on both sides."""
        return self._seeded(at, rows_of(x, at), self._borrows(x.device))

    def _seeded(self, at: list[int], values: torch.Tensor, lend: bool) -> Candidates:
        """Rows `at` whose m(ξ) the values `values` (float32) seed: in the store's dtype, with their verdicts
        (`lend`: see `graphed`'s borrow)."""
        seeds, verdicts = self._graphed("seed", self.steps.seeds, values, borrow=lend)
        return Candidates(at, seeds, verdicts, lent=lend)

    def _read_back(self, groups: list[Candidates], id_list: list[int], device: torch.device) -> None:
        """Give each group whose new m(ξ) the kernels wrote in place (its values None) those values, read from the
        store: a message not all of one kind keeps m(ξ) row by row, from every row's value."""
        for group in groups:
            if group.values is None:
                group.values = self.view.gather([id_list[i] for i in group.at], device)

    def forget(self, ids: list[int]) -> None:
        """Drop m(ξ) of samples the receiver lacks, so that their next message seeds it again."""
        if ids:
            self.view.delete(ids)

    # -- receiver ----------------------------------------------------------------------------------------------
    def missing(self, ids: list[int]) -> list[int]:
        """The samples among `ids` whose m(ξ) this side lacks (never seen, or found damaged and dropped)."""
        return [i for i, held in zip(ids, self.view.present(ids)) if not held]

    def _segment_bytes(self, shape: tuple[int, ...]) -> dict[int, int]:
        """Each mode's segment length for a message of `shape` (kept per shape: a link has a few; read, not
        written, by the callers)."""
        sizes = self._sizes.get(shape)
        if sizes is None:
            n = numel(shape[1:])
            sizes = {mode: n * dtype.itemsize for mode, dtype in MODE_DTYPES.items()}
            sizes[MODE_DELTA] = self.delta.sample_bytes(shape)
            if self.first_sight is not None:
                sizes[MODE_FIRST] = self.first_sight.sample_bytes(shape)
            self._sizes[shape] = sizes
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

    def _read_layout(self, header, payload: torch.Tensor) -> tuple[list[int], dict[int, int]]:
        """Each sample's mode byte, read on the host bytes and checked against the payload's length, and each mode's
        segment length."""
        sizes = self._segment_bytes(header.shape)
        return read_modes(payload, header.shape[0], sizes), sizes

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor, layout: Any = None) -> torch.Tensor:
        """Rebuild the activation and update this side's m(ξ) exactly as the sender did (`layout`: the samples'
        modes and each mode's segment length)."""
        shape = header.shape
        b = shape[0]
        modes, sizes = layout
        id_list = ids.tolist()
        kinds = segments_by_mode(modes, payload, sizes)
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
                seeds, values, verdicts, lent = self._delta_decode(rows, [id_list[i] for i in at], shape, lend)
                group = Candidates(at, seeds, verdicts, lent=lent)
            groups.append(group)
            outs.append(values)
        if len(groups) == 1:  # one kind of sample (the steady state: all deltas)
            out = outs[0]
        else:
            out = torch.empty(shape, dtype=torch.float32, device=self.device)
            for group, values in zip(groups, outs):
                out.index_copy_(0, to_device(torch.tensor(group.at, dtype=torch.int64), out.device), values)
        if self.late_checks is not None and set(kinds) <= LATE_CHECKED:
            # every delta and first sight is kept (the sender sent each so only where it could be: the same values
            # here): m(ξ) written now, the checksum checked once its sums reach the host
            written = [g for g in groups if g.values is not None]  # (the kernels wrote the others' in place)
            if len(written) == 1:
                self.view.scatter([id_list[i] for i in written[0].at], present(written[0].values))
            elif written:  # (in one call: a host-RAM store's next put would wait for the copy the last one queued)
                self.view.scatter([id_list[i] for g in written for i in g.at],
                                  torch.cat([present(g.values) for g in written]))
            if not header.flags & FLAG_NO_CHECK:
                self.late_checks.add(header, *Candidates.device_sums(groups))
            return out
        # whether each new m(ξ) may be kept (the sender's rule, on the same values) and the checksum sums, read in
        # one wait for the device — after the checks left for later, which that wait covers, so a divergence is named
        # by the first message it shows in
        if self.late_checks is not None:
            self.late_checks.settle()
        Candidates.read_all(groups)
        if len(groups) == 1 and all(groups[0].fits):
            self._verify(header, fold_checksum(list(range(b)), groups[0].sums))
            if groups[0].values is not None:
                self.view.scatter(id_list, groups[0].values)
            return out
        self._read_back(groups, id_list, self.device)
        new_m: list[torch.Tensor | None] = [None] * b
        sums: list[int] = [0] * b
        for group in groups:
            group.owned()
            for j, i in enumerate(group.at):
                if group.fits[j]:
                    new_m[i], sums[i] = present(group.values)[j], group.sums[j]
        kept = [i for i in range(b) if new_m[i] is not None]
        self._verify(header, fold_checksum(kept, [sums[i] for i in kept]))
        keep(self.view, id_list, new_m)
        return out

    def _delta_decode(self, rows: torch.Tensor, ids: list[int], shape: tuple[int, ...], lend: bool
                      ) -> tuple[Any, ...]:
        """The receiver's side of `_delta_encode`: the new m(ξ), the activation (a tensor of its own: the caller's)
        and the verdicts of the delta rows `rows` of samples `ids`, and whether the new m(ξ) and verdicts are lent (a
        CUDA graph's buffers) — fused straight from where the store keeps m(ξ) (a slab's rows, written in place: the
        new m(ξ) is then None), or in torch ops replayed from a graph."""
        batch = (len(ids), *shape[1:])
        step = self._fused_delta(rows.device, batch)
        if step is not None:
            m, slots = self._sent(self._rows_of, ids, rows.device)
            done = step.decode(rows, m, slots, ids, batch, lend)
            if done is not None:
                return done
        seeds, values, verdicts = self._graphed("delta-decode", self.steps.delta_values, rows,
                                                self._sent(self._recall, ids, self.device), borrow=lend)
        return seeds, values.clone() if lend else values, verdicts, lend

    def _sent(self, read: Callable[[list[int], torch.device], Any], ids: list[int], device: torch.device) -> Any:
        """`read(ids, device)` of m(ξ) of samples the sender sent as deltas (`_rows_of`, `_recall`): this side must
        hold them."""
        try:
            return read(ids, device)
        except KeyError as e:
            raise CodecError(f"m(xi) diverged: the sender sent a delta but this side has never seen the "
                             f"sample ({e.args[0]})") from None

    def settle(self) -> None:
        """Make the checksum checks left for later (`late_checks`), waiting for their sums: a CodecError names the
        first message after which this side's m(ξ) differs from the sender's."""
        if self.late_checks is not None:
            self.late_checks.settle()

    def _verify(self, header, check: int) -> None:
        """Refuse a message after which this side's m(ξ) would differ from the sender's (`refuse_divergence`)."""
        refuse_divergence(self.view.link, header, check)


def _once(make: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`make`, called at most once: its value kept for the calls after (what `functools.cache` does, without its
    wrapper's set-up on every message)."""
    made: list[torch.Tensor] = []

    def value() -> torch.Tensor:
        if not made:
            made.append(make())
        return made[0]

    return value
