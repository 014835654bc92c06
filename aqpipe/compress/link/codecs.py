"""Link codecs: how one link encodes a tensor for the wire and decodes it on the other side.

Every codec has `encode(tensor, ids, compress) -> Encoded`, `decode(header, payload, ids) -> tensor`, and
`check_header(header)`, which the transport calls before it allocates a payload. With `compress=False` (the
warm-up epochs) a codec sends fp32 and flags the message raw. `aqpipe.compress.link.specs` holds the one table of
codec names: each entry names the class that implements it, whose `from_spec` builds one (`build_codec`) and whose
`message_bytes` sizes a message (`message_bytes`), and says what the codec can do.

Codecs compute on the tensor's device: on a GPU, quantizing, packing and AQ-SGD's m(ξ) arithmetic and checksum run
there, and only the packed payload crosses to the host (`to_host`: into pinned memory, without waiting; the outbox
thread waits for the copy's event); a received payload is decoded on the codec's `device`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from aqpipe.compress.graph_memory import GraphCall
from aqpipe.compress.link.specs import CODEC_KINDS, CodecError, CodecSpec, parse_spec
from aqpipe.compress.quantize import DEFAULT_GRID

FLAG_RAW = 1  # the payload is the tensor, lossless (LOSSLESS_DTYPES): warm-up, or a codec asked not to compress
FLAG_NO_CHECK = 2  # AQ-SGD: the sender did not checksum m(ξ)
(CODE_FP32, CODE_FP16, CODE_BF16, CODE_DIRECTQ, CODE_AQSGD, CODE_TOPK, CODE_RTQ, CODE_TAHQ,
 CODE_AQSGD_RTQ, CODE_RTQO) = range(1, 11)
# The float codecs by name: the dtype they send and their header code.
FLOAT_CODECS = {"fp32": (torch.float32, CODE_FP32), "fp16": (torch.float16, CODE_FP16),
                "bf16": (torch.bfloat16, CODE_BF16)}
# What a lossless message (fp32 codec, or any codec's raw message) carries: the tensor in its own float dtype, so a
# bf16/fp16 activation of a mixed-precision stage crosses at its own size, bit for bit; anything else as fp32.
LOSSLESS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HOST = torch.device("cpu")


def to_host(payload: torch.Tensor, spin: bool = False) -> tuple[torch.Tensor, Landing | None]:
    """A message's encoded bytes on their way to the host, where the socket reads them, and what marks their arrival
    (None: host bytes, ready as they are). The one device-to-host copy a message makes goes into
    pinned memory without waiting (a DMA queued behind the encode), so the compute thread never waits for the GPU:
    whoever reads the bytes waits on the event first (the outbox thread; `Encoded.payload`). A thread that waits
    sleeps (a link's thread, for a message's bytes) or, with `spin`, spins: the compute thread, waiting for a few
    numbers it needs at once, is not put to sleep and woken (tens of µs) on a step's critical path."""
    if payload.device.type == "cpu":
        return payload, None
    host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
    host.copy_(payload, non_blocking=True)  # queued on the payload's device's current stream
    event = torch.cuda.Event(blocking=not spin)
    event.record(torch.cuda.current_stream(payload.device))
    return host, Landing(event, payload.device)


@dataclass
class Landing:
    """The CUDA event that marks a payload's queued copy to the host, and the GPU it was queued on."""

    event: torch.cuda.Event
    device: torch.device

    def synchronize(self) -> None:
        """Wait until the bytes are on the host, with the copy's GPU current: a thread that has never chosen one is
        on GPU 0, and a wait from there would make a CUDA context on GPU 0 (memory, and a share of its time)."""
        with torch.cuda.device(self.device):
            self.event.synchronize()


def _owned(wire: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`wire`, or a copy of it where it is the caller's host tensor itself: the link's writer thread reads a message's
    bytes later, and the caller may change its tensor meanwhile (a GPU's bytes are copied to the host anyway)."""
    if wire.device.type == "cpu" and wire.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        return wire.clone()
    return wire


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host values on `device` without making the host wait; on the host, the values themselves. A pageable source
    is staged by the driver before the call returns, so it may change afterwards; a pinned one (a GPU's received
    message, a stacked m(ξ)) is read by the copy later — torch keeps its block from reuse until then, and nothing may
    write it meanwhile."""
    if device.type == "cpu" or values.device == device:
        return values
    return values.to(device, non_blocking=True)


@dataclass
class DeltaFidelity:
    """How far AQ-SGD's quantized deltas of one message were from the truth, as squared norms over the samples
    sent as deltas: `squares` [3] float64 on the activation's device — ‖a‖², ‖a − m_old‖², ‖a − m_new‖² — summed over
    a step before anything is read, so a GPU is not made to wait per message (and one add per message)."""

    squares: torch.Tensor

    @property
    def signal(self) -> torch.Tensor:
        """‖a‖²: the activations themselves."""
        return self.squares[0]

    @property
    def change(self) -> torch.Tensor:
        """‖a − m_old‖²: what was quantized (small when activations change slowly)."""
        return self.squares[1]

    @property
    def error(self) -> torch.Tensor:
        """‖a − m_new‖²: what the receiver computes on, against the true activation."""
        return self.squares[2]

    def __add__(self, other: DeltaFidelity) -> DeltaFidelity:
        return DeltaFidelity(self.squares + other.squares)


@dataclass
class Encoded:
    """What a codec puts on the wire for one tensor: its bytes on the host (or on their way there: `ready`)."""

    host: torch.Tensor  # flat uint8, on the host (pinned, still being filled while `ready` has not passed)
    shape: tuple[int, ...]
    wire_dtype: torch.dtype
    codec_check: int = 0
    flags: int = 0
    fidelity: DeltaFidelity | None = None  # AQ-SGD messages with deltas in them
    ready: Landing | None = None  # marks the copy to `host` (None: host bytes, ready now)

    @classmethod
    def of(cls, payload: torch.Tensor, shape: tuple[int, ...], wire_dtype: torch.dtype,
           queued: tuple[torch.Tensor, Landing | None] | None = None, **fields: Any) -> Encoded:
        """The message of encoded bytes `payload` (flat uint8, on any device), their copy to the host queued (or
        `queued` already: what `to_host(payload)` gave)."""
        host, ready = queued or to_host(payload)
        return cls(host, shape, wire_dtype, ready=ready, **fields)

    @property
    def payload(self) -> torch.Tensor:
        """The bytes, once they are on the host (waits for their copy)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host

    @property
    def payload_len(self) -> int:
        """The payload's length in bytes (known before the bytes arrive)."""
        return self.host.numel()


def bytes_as(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 rows [R, n] as `dtype` [R, n / itemsize] through a fresh copy (slices of a payload need not
    be aligned for a wider type)."""
    return rows.reshape(-1).clone().view(dtype).view(rows.shape[0], -1)


def numel(shape: tuple[int, ...]) -> int:
    """Elements in a tensor of `shape`."""
    n = 1
    for d in shape:
        n *= d
    return n


def _length_problem(header, expected: int) -> str | None:
    if header.payload_len != expected:
        return f"payload length {header.payload_len} does not match shape {header.shape} ({expected} expected)"
    return None


class LinkCodec:
    """Base of every codec: the raw fp32 path, header checks, and the codec identity carried in the header."""

    code = CODE_FP32
    name = "fp32"
    bits = 0
    device = HOST  # where received messages are decoded (build_codec sets the stage's device)
    keeps_messages = False  # a per-sample m(ξ) on both sides (AQ-SGD): see forget and missing
    raw_messages = True  # sends its lossless messages flagged raw (AQ-SGD's travel as modes of its own payload)

    @classmethod
    def from_spec(cls, spec: CodecSpec, parts: CodecParts) -> LinkCodec:
        """The codec a parsed spec names, from what `build_codec` was given."""
        raise NotImplementedError(f"{cls.__name__} does not say how to build {spec}")

    @classmethod
    def message_bytes(cls, spec: CodecSpec, shape: tuple[int, ...], dtype: torch.dtype, options: QuantOptions,
                      first_sight: str = "fp32", first_sights: bool = False) -> int:
        """Payload bytes of one compressed message of `shape` (a codec keeping m(ξ): every sample a known one, or
        with `first_sights` every sample a first sight coded by `first_sight`)."""
        codec = cls.from_spec(spec, CodecParts("fw" if "fw" in CODEC_KINDS[spec.kind].directions else "bw",
                                               None, options, True, HOST, first_sight))
        return codec.payload_bytes(SimpleNamespace(shape=shape, dtype=lossless_dtype(dtype)))

    def graph_calls(self, shape: tuple[int, ...], sending: bool, warmup: bool = False) -> list[GraphCall]:
        """The calls a message of `shape` may replay as CUDA graphs on a GPU at this codec's sending (or receiving)
        end in a run with (or without) `warmup` epochs, with stand-in inputs (`aqpipe.compress.graph_memory`, which
        the capacity plan measures them with): none unless the codec replays graphs."""
        return []

    def settle(self) -> None:
        """Finish what decoding left for later (an AQ-SGD receiver's checksum checks on a GPU), waiting for the
        device if it must: nothing for most codecs."""

    def forget(self, ids: list[int]) -> None:
        """Sender side of a re-seed: drop the m(ξ) of samples the receiver lacks (nothing to drop unless the codec
        keeps messages)."""

    def missing(self, ids: list[int]) -> list[int]:
        """Receiver side of a re-seed: the samples among `ids` whose m(ξ) this side lacks (none unless the codec
        keeps messages)."""
        return []

    def encode(self, tensor: torch.Tensor, ids: torch.Tensor, compress: bool = True) -> Encoded:
        """The wire form of `tensor` (a batch whose first dimension matches `ids`)."""
        if not compress:
            return self._raw(tensor)
        return self._encode(tensor.detach(), ids)

    def decode(self, header, payload: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The tensor a received message stands for: float32, or a raw message's own dtype. A compressed message's
        layout is read on its bytes where they arrived (`_read_layout`), before they go to the stage's device."""
        if header.flags & FLAG_RAW:
            if not self.raw_messages:
                raise CodecError(self._raw_refusal())
            return bytes_as(to_device(payload, self.device).view(1, -1), header.dtype).view(header.shape)
        layout = self._read_layout(header, payload)
        return self._decode(header, to_device(payload, self.device), ids, layout)

    def _read_layout(self, header, payload: torch.Tensor) -> Any:
        """What decoding must know of a compressed message's bytes before they go to the device — where each part
        lies, which samples are which — read, and checked, on the bytes as they arrived (the host): read on a GPU,
        each such number would make the host wait for it. None where the header says it all."""
        return None

    def check_header(self, header) -> str | None:
        """Why a header cannot belong to this codec (None if it can); called before the payload is allocated."""
        if header.codec != self.code or (header.flags >> 8) != self.bits:
            return f"the peer sends codec {header.codec}/{header.flags >> 8} bits but this side decodes {self.name}"
        if header.flags & FLAG_RAW:
            if not self.raw_messages:
                return self._raw_refusal()
            if header.dtype not in LOSSLESS_DTYPES:
                return f"a raw message must be one of {LOSSLESS_DTYPES}, not {header.dtype}"
            return _length_problem(header, numel(header.shape) * header.dtype.itemsize)
        return self._payload_problem(header)

    def _raw_refusal(self) -> str:
        return (f"the peer sends a raw message, which {self.name} never does (the two sides of a link must be given "
                f"the same codec)")

    def _payload_problem(self, header) -> str | None:
        """Why a compressed payload's length cannot fit the header's shape (codecs of variable length override)."""
        return _length_problem(header, self.payload_bytes(header))

    def flags(self, raw: bool = False) -> int:
        """Header flags: the codec's bit width in bits 8-15, plus the raw flag."""
        return (self.bits << 8) | (FLAG_RAW if raw else 0)

    def _raw(self, tensor: torch.Tensor) -> Encoded:
        wire = _owned(lossless(tensor.detach()).contiguous(), tensor)
        return Encoded.of(wire.view(torch.uint8).reshape(-1), tuple(wire.shape), wire.dtype, flags=self.flags(raw=True))

    def payload_bytes(self, header) -> int:
        """The exact payload length of a compressed message with this header."""
        return numel(header.shape) * 4

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor, layout: Any = None) -> torch.Tensor:
        """The tensor of a compressed message whose bytes are on the codec's device, with `_read_layout`'s answer."""
        return bytes_as(payload.view(1, -1), torch.float32).view(header.shape)

    def state_dict(self) -> dict:
        """What a checkpoint must keep to continue exactly: the stochastic-rounding generator's state."""
        generator = getattr(self, "_generator", None)
        return {} if generator is None else {"generator": generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output."""
        generator = getattr(self, "_generator", None)
        if generator is None or "generator" not in state:
            return
        saved = state["generator"]
        # a resume may move a run between the host and a GPU, whose generators' states differ in kind (and size):
        # stochastic rounding then goes on from the codec's own seed
        if saved.numel() == generator.get_state().numel():
            generator.set_state(saved)

    def _encode(self, tensor: torch.Tensor, ids: torch.Tensor) -> Encoded:
        return self._raw(tensor)


def lossless_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a lossless message carries a tensor of `dtype` in (its own float dtype, else fp32)."""
    return dtype if dtype in LOSSLESS_DTYPES else torch.float32


def lossless(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in the dtype a lossless message carries it in."""
    return tensor.to(lossless_dtype(tensor.dtype))


class FloatCodec(LinkCodec):
    """Sends the tensor cast to a float type: fp16 and bf16 halve the bytes; fp32 is lossless and sends a bf16 or
    fp16 tensor (a mixed-precision stage's activation) in its own dtype."""

    def __init__(self, name: str, wire_dtype: torch.dtype, code: int) -> None:
        self.name, self.wire_dtype, self.code = name, wire_dtype, code

    @classmethod
    def from_spec(cls, spec: CodecSpec, parts: CodecParts) -> FloatCodec:
        return cls(spec.kind, *FLOAT_CODECS[spec.kind])

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor of `dtype` goes on the wire as."""
        return dtype if self.wire_dtype == torch.float32 and dtype in LOSSLESS_DTYPES else self.wire_dtype

    def _payload_problem(self, header) -> str | None:
        if header.dtype != self._wire(header.dtype):
            return f"{self.name} payload announced as {header.dtype}"
        return super()._payload_problem(header)

    def payload_bytes(self, header) -> int:
        return numel(header.shape) * self._wire(header.dtype).itemsize

    def _encode(self, tensor: torch.Tensor, ids: torch.Tensor) -> Encoded:
        wire = _owned(tensor.to(self._wire(tensor.dtype)).contiguous(), tensor)
        return Encoded.of(wire.view(torch.uint8).reshape(-1), tuple(wire.shape), wire.dtype, flags=self.flags())

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor, layout: Any = None) -> torch.Tensor:
        if header.dtype != self._wire(header.dtype):
            raise CodecError(f"{self.name} payload arrived as {header.dtype}")
        value = payload.view(header.dtype).reshape(header.shape)
        return value if self.wire_dtype == torch.float32 else value.to(torch.float32)


@dataclass
class QuantOptions:
    """How quantizing codecs round and scale."""

    per: str = "channel"  # scale granularity: channel or token
    stochastic: bool = False
    seed: int = 0
    grid: str = DEFAULT_GRID  # which levels a code stands for (aqpipe.compress.quantize.GRIDS)

    @classmethod
    def of(cls, cfg: Any, rank: int = 0) -> QuantOptions:
        """The options a run's configuration asks for (`--quant-scales/-rounding/-grid`, `--seed`), for `rank`
        (each rank's stochastic rounding draws from a stream of its own)."""
        return cls(per=cfg.quant_scales, stochastic=cfg.quant_rounding == "stochastic", seed=cfg.seed + rank,
                   grid=cfg.quant_grid)


@dataclass
class CodecParts:
    """What `build_codec` hands a codec's `from_spec`."""

    direction: str  # "fw" or "bw"
    store_view: Any  # one side of one link of the message store (a codec that keeps messages needs it)
    options: QuantOptions
    check: bool  # AQ-SGD: checksum m(ξ) in every message
    device: torch.device
    first_sight: str  # AQ-SGD: the coder of a sample without m(ξ) (fp32: lossless)


def generator_on(device: torch.device, seed: int) -> torch.Generator:
    """A seeded random generator on `device` (stochastic rounding draws where it quantizes)."""
    return torch.Generator(device=device).manual_seed(seed)


def build_codec(spec: str | CodecSpec, direction: str = "fw", store_view=None, options: QuantOptions | None = None,
                check: bool = True, device: torch.device | str = "cpu", first_sight: str = "fp32") -> LinkCodec:
    """The codec for a spec, decoding onto `device`; AQ-SGD needs `store_view` (one side of one link of the message
    store) and codes a sample without m(ξ) with `first_sight` (`fp32`: losslessly)."""
    parsed = parse_spec(spec, direction) if isinstance(spec, str) else spec
    if CODEC_KINDS[parsed.kind].keeps_messages and store_view is None:
        raise CodecError(f"the {parsed.kind} codec needs a message store")
    parts = CodecParts(direction, store_view, options or QuantOptions(), check, torch.device(device), first_sight)
    codec = codec_class(parsed.kind).from_spec(parsed, parts)
    codec.device = parts.device
    return codec


def codec_class(kind: str) -> type[LinkCodec]:
    """The class implementing codec `kind` (imported on first use)."""
    module, _, name = CODEC_KINDS[kind].implementation.partition(":")
    return getattr(importlib.import_module(module), name)


def message_bytes(spec: str, direction: str, shape: tuple[int, ...], dtype: torch.dtype, options: QuantOptions,
                  first_sight: str = "fp32", first_sights: bool = False) -> int:
    """Payload bytes of one compressed message of `shape` with a --fw/--bw spec (see `LinkCodec.message_bytes`)."""
    parsed = parse_spec(spec, direction)
    return codec_class(parsed.kind).message_bytes(parsed, shape, dtype, options, first_sight, first_sights)
