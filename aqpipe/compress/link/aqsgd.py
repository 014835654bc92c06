"""AQ-SGD (Wang et al. 2022, Algorithm 1): send Q(a(ξ) − m(ξ)) and let both sides set m(ξ) ← m(ξ) + Q(a(ξ) − m(ξ)).

A sample with no m(ξ) yet (first sight, or any sample during the warm-up epochs) travels in fp32 and seeds
m(ξ) on both sides. Payload: one mode byte per sample (0 = full fp32, 1 = quantized delta), then each sample's
segment in order — its fp32 values, or its fp16 scales and packed codes. The header carries a checksum of the
m(ξ) values the receiver must end up with, so a divergence of the two copies is caught at the first message.

The arithmetic runs on the activation's device (a GPU's m(ξ) update never visits the host); m(ξ) is kept wherever
the store keeps it, and moved to the device for the update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from aqpipe.compress.link.codecs import (
    CODE_AQSGD,
    FLAG_NO_CHECK,
    HOST,
    CodecError,
    DeltaFidelity,
    Encoded,
    LinkCodec,
    QuantOptions,
    bytes_as,
    generator_on,
    numel,
    to_host,
)
from aqpipe.compress.link.directq import decode_samples, encode_samples, sample_bytes
from aqpipe.compress.quantize import FP16_MAX, dequantize, quantize

MODE_FULL, MODE_DELTA = 0, 1


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

    def present(self, ids: Sequence[int]) -> list[bool]: ...

    def storable(self, values: Sequence[torch.Tensor]) -> list[bool]: ...

    def delete(self, ids: Sequence[int]) -> None: ...


_MERSENNE_61 = (1 << 61) - 1
_CHECKSUM_COLUMNS = 1 << 20
_position_weights: dict[tuple[int, str], torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """Pseudo-random weights 1 … 65521 for the n 16-bit words of a value (cached per length and device)."""
    key = (n, str(device))
    if key not in _position_weights:
        if len(_position_weights) > 32:
            _position_weights.clear()
        _position_weights[key] = 1 + (torch.arange(n, dtype=torch.int64, device=device) * 40503) % 65521
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
    words = torch.stack([v.contiguous().view(torch.int16).reshape(-1) for _, v in kept])
    weights = _weights(words.shape[1], words.device)
    # |word| < 2^15 and weight < 2^16: each row's sum stays below 2^63 for up to 2^31 words (8 GB per sample); the
    # int64 products are formed a slice of columns at a time, so the transient stays small beside a large batch
    sums = torch.zeros(words.shape[0], dtype=torch.int64, device=words.device)
    for start in range(0, words.shape[1], _CHECKSUM_COLUMNS):
        part = slice(start, start + _CHECKSUM_COLUMNS)
        sums += (words[:, part].to(torch.int64) * weights[part]).sum(dim=1)
    h = 0
    for (position, _), s in zip(kept, sums.tolist()):
        h = (h * 1_000_003 + position * 7919 + s) % _MERSENNE_61
    return (h ^ (h >> 32)) & 0xFFFFFFFF


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


def _row_sq(t: torch.Tensor) -> torch.Tensor:
    """Each sample's squared norm, in float64 (the norm itself in float32: no full-size float64 copy)."""
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1).double().square()


def _fidelity(x: torch.Tensor, delta: list[int], m_old: torch.Tensor, change: torch.Tensor, m_new: torch.Tensor,
              as_delta: list[int]) -> DeltaFidelity:
    """The squared norms, over the samples sent as deltas (`as_delta` among the `delta` rows of `x`), of the
    activation, of its change since m(ξ), and of what m(ξ) still misses after the update in the store's dtype —
    what the receiver computes on. One full-size temporary: m_new − m_old − change = m_new − x."""
    error = m_new.to(torch.float32, copy=True).sub_(m_old).sub_(change)
    signal = _row_sq(x)[[delta[j] for j in as_delta]]
    return DeltaFidelity(signal.sum(), _row_sq(change)[as_delta].sum(), _row_sq(error)[as_delta].sum())


class AQSGDCodec(LinkCodec):
    """Delta quantization against the per-sample message store, one side of one link."""

    code = CODE_AQSGD

    def __init__(self, bits: int, view: SampleMemory, options: QuantOptions, check: bool = True,
                 device: torch.device = HOST) -> None:
        self.bits, self.view, self.options, self.check, self.device = bits, view, options, check, device
        self.name = f"aqsgd:{bits}"
        self._generator = generator_on(device, options.seed * 7919 + view.link)

    # -- sender ------------------------------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, ids: torch.Tensor, compress: bool = True) -> Encoded:
        """Quantized deltas for samples with an m(ξ), fp32 for the others (all of them while not compressing).

        A sample whose new m(ξ) would not be finite in the store's dtype (an activation beyond fp16's range, an inf
        or NaN) goes at full precision instead, and if even its fp32 value cannot be stored, m(ξ) is dropped on both
        sides (counted as `overflow`) rather than kept poisoned for every later epoch."""
        x = tensor.detach().float().contiguous()
        id_list = ids.tolist()
        known = self.view.contains(id_list) if compress else [False] * len(id_list)
        delta = [i for i, k in enumerate(known) if k]
        segments: list[torch.Tensor | None] = [None] * len(id_list)
        new_m: list[torch.Tensor | None] = [None] * len(id_list)
        fidelity = None
        if delta:
            m_old = torch.stack(self.view.get([id_list[i] for i in delta])).to(x.device, torch.float32)
            change = x[delta] - m_old
            # an fp16 scale cannot span a change beyond 65504 (nor an inf or NaN): those samples go in full
            in_range = (change.abs() <= FP16_MAX).reshape(len(delta), -1).all(dim=1).tolist()
            for i, ok in zip(delta, in_range):
                known[i] = ok
            if not all(in_range):
                rows_in_range = torch.tensor(in_range, device=x.device)
                delta = [i for i, ok in zip(delta, in_range) if ok]
                m_old, change = m_old[rows_in_range], change[rows_in_range]
        if delta:
            q = quantize(change, self.bits, self.options.per, self.options.stochastic, self._generator,
                         self.options.grid)
            rows = encode_samples(q)
            # the sender updates its copy from exactly the codes and fp16 scales the receiver will unpack
            m_new = (m_old + dequantize(q, tuple(m_old.shape))).to(self.view.dtype)
            as_delta = []
            for j, (i, fits) in enumerate(zip(delta, self.view.storable(list(m_new)))):
                if fits:
                    segments[i], new_m[i] = rows[j], m_new[j]
                    as_delta.append(j)
                else:
                    known[i] = False  # sent in full below; the receiver does the same with the same fp32 value
            if as_delta:
                fidelity = _fidelity(x, delta, m_old, change, m_new, as_delta)
        full = [i for i, k in enumerate(known) if not k]
        firsts = [x[i].to(self.view.dtype, copy=True) for i in full]  # never a view of the live activation
        for i, value, fits in zip(full, firsts, self.view.storable(firsts)):
            segments[i] = x[i].view(torch.uint8).reshape(-1)
            new_m[i] = value if fits else None
        self.view.store.stats.overflow += len(keep(self.view, id_list, new_m))
        modes = torch.tensor([MODE_DELTA if k else MODE_FULL for k in known], dtype=torch.uint8, device=x.device)
        payload = to_host(torch.cat([modes, *_every(segments)]))
        flags = (self.bits << 8) | (0 if self.check else FLAG_NO_CHECK)
        check = store_checksum(new_m) if self.check else 0
        return Encoded(payload, tuple(x.shape), torch.uint8, codec_check=check, flags=flags, fidelity=fidelity)

    def forget(self, ids: list[int]) -> None:
        """Drop m(ξ) of samples the receiver lacks, so that their next message goes at full precision."""
        if ids:
            self.view.delete(ids)

    # -- receiver ----------------------------------------------------------------------------------------------
    def missing(self, ids: list[int]) -> list[int]:
        """The samples among `ids` whose m(ξ) this side lacks (never seen, or found damaged and dropped)."""
        return [i for i, present in zip(ids, self.view.present(ids)) if not present]

    def _payload_problem(self, header) -> str | None:
        """The length varies with each sample's mode; it must lie between all-delta and all-full."""
        b = header.shape[0] if header.shape else 0
        full, delta = numel(header.shape[1:]) * 4, sample_bytes(header.shape, self.bits, self.options.per)
        low, high = b + b * min(full, delta), b + b * max(full, delta)
        if not low <= header.payload_len <= high:
            return f"payload length {header.payload_len} is outside {low}..{high} for shape {header.shape}"
        return None

    def decode(self, header, payload: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rebuild the activation and update this side's m(ξ) exactly as the sender did."""
        shape = header.shape
        b = shape[0]
        payload = payload.to(self.device)
        modes = payload[:b].tolist()
        if any(m not in (MODE_FULL, MODE_DELTA) for m in modes):
            raise CodecError(f"aqsgd payload has unknown sample modes {sorted(set(modes))}")
        full, delta = numel(shape[1:]) * 4, sample_bytes(shape, self.bits, self.options.per)
        sizes = [delta if m == MODE_DELTA else full for m in modes]
        if b + sum(sizes) != payload.numel():
            raise CodecError(f"aqsgd payload of {payload.numel()} bytes does not match its sample modes")
        id_list = ids.tolist()
        out = torch.empty(shape, dtype=torch.float32, device=self.device)
        new_m: list[torch.Tensor | None] = [None] * b
        offset, delta_rows, delta_at = b, [], []
        for i, (mode, size) in enumerate(zip(modes, sizes)):
            segment = payload[offset : offset + size]
            offset += size
            if mode == MODE_FULL:
                out[i] = bytes_as(segment.view(1, -1), torch.float32).view(shape[1:])
                value = out[i].to(self.view.dtype, copy=True)
                new_m[i] = value if self.view.storable([value])[0] else None  # the sender's rule, on the same value
            else:
                delta_rows.append(segment)
                delta_at.append(i)
        if delta_at:
            try:
                m_old = torch.stack(self.view.get([id_list[i] for i in delta_at])).to(self.device, torch.float32)
            except KeyError as e:
                raise CodecError(f"m(xi) diverged: the sender sent a delta but this side has never seen the sample "
                                 f"({e.args[0]})") from None
            deltas = decode_samples(torch.stack(delta_rows), tuple(m_old.shape), self.bits, self.options.per,
                                    self.options.grid)
            m_new = (m_old + deltas).to(self.view.dtype)
            for j, i in enumerate(delta_at):
                new_m[i] = m_new[j]
                out[i] = m_new[j].float()
        if not header.flags & FLAG_NO_CHECK and store_checksum(new_m) != header.codec_check:
            raise CodecError(f"m(xi) diverged on link {self.view.link}: this side's copy fails the sender's checksum "
                             f"at step {header.step} micro-batch {header.micro_batch}")
        keep(self.view, id_list, new_m)
        return out


def _every(items: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """`items`, each of which the code before has set."""
    filled = [item for item in items if item is not None]
    if len(filled) != len(items):
        raise RuntimeError("an AQ-SGD message left a sample without its segment")
    return filled
