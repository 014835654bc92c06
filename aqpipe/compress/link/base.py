"""The link codec's base class, and what every codec is made of: the encoded message (`Encoded`), AQ-SGD's fidelity
norms (`DeltaFidelity`), what a codec is built from (`CodecParts`) and the byte helpers the families share.

Every codec has `encode(tensor, ids, compress) -> Encoded`, `decode(header, payload, ids) -> tensor`, and
`check_header(header)`, which the transport calls before it allocates a payload. With `compress=False` (the
warm-up epochs) a codec sends fp32 and flags the message raw. `aqpipe.compress.link.specs` holds the one table of
codec names: each entry names the class that implements it, whose `from_spec` builds one
(`aqpipe.compress.link.factory.build_codec`) and whose `message_bytes` sizes a message, and says what the codec can
do.

Codecs compute on the tensor's device: on a GPU, quantizing, packing and AQ-SGD's m(ξ) arithmetic and checksum run
there, and only the packed payload crosses to the host (`aqpipe.compress.gpu.copies.to_host`: into pinned memory,
without waiting; the outbox thread waits for the copy's event); a received payload is decoded on the codec's
`device`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from aqpipe.compress.gpu.copies import HOST, Landing, to_device, to_host
from aqpipe.compress.gpu.graph_memory import GraphCall
from aqpipe.compress.link.codes import CODE_FP32, FLAG_RAW, LOSSLESS_DTYPES, lossless, lossless_dtype
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CODEC_KINDS, LOSSLESS, CodecError, CodecSpec


def owned(wire: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`wire`, or a copy of it where it is the caller's host tensor itself: the link's writer thread reads a message's
    bytes later, and the caller may change its tensor meanwhile (a GPU's bytes are copied to the host anyway)."""
    if wire.device.type == "cpu" and wire.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        return wire.clone()
    return wire


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
                      first_sight: CodecSpec = LOSSLESS, first_sights: bool = False) -> int:
        """Payload bytes of one compressed message of `shape` (a codec keeping m(ξ): every sample a known one, or
        with `first_sights` every sample a first sight coded by `first_sight`)."""
        codec = cls.from_spec(spec, CodecParts("fw" if "fw" in CODEC_KINDS[spec.kind].directions else "bw",
                                               None, options, True, HOST, first_sight))
        return codec.payload_bytes(SimpleNamespace(shape=shape, dtype=lossless_dtype(dtype)))

    def graph_calls(self, shape: tuple[int, ...], sending: bool, warmup: bool = False) -> list[GraphCall]:
        """The calls a message of `shape` may replay as CUDA graphs on a GPU at this codec's sending (or receiving)
        end in a run with (or without) `warmup` epochs, with stand-in inputs (`aqpipe.compress.gpu.graph_memory`, which
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
        if problem := self.identity_problem(header):
            return problem
        if header.flags & FLAG_RAW:
            if not self.raw_messages:
                return self._raw_refusal()
            if header.dtype not in LOSSLESS_DTYPES:
                return f"a raw message must be one of {LOSSLESS_DTYPES}, not {header.dtype}"
            return _length_problem(header, numel(header.shape) * header.dtype.itemsize)
        return self._payload_problem(header)

    def identity_problem(self, header) -> str | None:
        """Why a header names another codec, or another bit width, than this one (None: it names this one)."""
        if header.codec != self.code or (header.flags >> 8) != self.bits:
            return f"the peer sends codec {header.codec}/{header.flags >> 8} bits but this side decodes {self.name}"
        return None

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
        wire = owned(lossless(tensor.detach()).contiguous(), tensor)
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


@dataclass
class CodecParts:
    """What `build_codec` hands a codec's `from_spec`."""

    direction: str  # "fw" or "bw"
    store_view: Any  # one side of one link of the message store (a codec that keeps messages needs it)
    options: QuantOptions
    check: bool  # AQ-SGD: checksum m(ξ) in every message
    device: torch.device
    first_sight: CodecSpec  # AQ-SGD: the coder of a sample without m(ξ) (fp32: lossless)


def generator_on(device: torch.device, seed: int) -> torch.Generator:
    """A seeded random generator on `device` (stochastic rounding draws where it quantizes)."""
    return torch.Generator(device=device).manual_seed(seed)
