"""Link codecs: how one link encodes a tensor for the wire and decodes it on the other side.

Every codec has `encode(tensor, ids, compress) -> Encoded`, `decode(header, payload, ids) -> tensor`, and
`check_header(header)`, which the transport calls before it allocates a payload. With `compress=False` (the
warm-up epochs) a codec sends fp32 and flags the message raw. `build_codec` turns a `--fw`/`--bw` spec into a
codec; `aqpipe.compress.link.specs` holds the table of codec names and validates a spec without building anything.

Codecs compute on the tensor's device: on a GPU, quantizing, packing and AQ-SGD's m(ξ) arithmetic and checksum run
there, and only the packed payload crosses to the host (`to_host`, through pinned memory); a received payload is
decoded on the codec's `device`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aqpipe.compress.link.specs import CodecError, CodecSpec, parse_spec
from aqpipe.compress.quantize import DEFAULT_GRID

FLAG_RAW = 1  # the payload is the tensor, lossless (LOSSLESS_DTYPES): warm-up, or a codec asked not to compress
FLAG_NO_CHECK = 2  # AQ-SGD: the sender did not checksum m(ξ)
CODE_FP32, CODE_FP16, CODE_BF16, CODE_DIRECTQ, CODE_AQSGD, CODE_TOPK, CODE_RTQ, CODE_TAHQ = 1, 2, 3, 4, 5, 6, 7, 8
# What a lossless message (fp32 codec, or any codec's raw message) carries: the tensor in its own float dtype, so a
# bf16/fp16 activation of a mixed-precision stage crosses at its own size, bit for bit; anything else as fp32.
LOSSLESS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HOST = torch.device("cpu")


def to_host(payload: torch.Tensor) -> torch.Tensor:
    """A message's encoded bytes on the host, where the socket reads them: the one device-to-host copy a message
    makes, into pinned memory (a DMA, not a staged copy); host bytes are returned as they are."""
    if payload.device.type == "cpu":
        return payload
    host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
    return host.copy_(payload)  # synchronous: the outbox thread reads the bytes next


@dataclass
class DeltaFidelity:
    """How far AQ-SGD's quantized deltas of one message were from the truth, as squared norms over the samples
    sent as deltas (0-d float64 tensors on the activation's device: summed over a step before anything is read,
    so a GPU is not made to wait per message)."""

    signal: torch.Tensor  # ‖a‖²: the activations themselves
    change: torch.Tensor  # ‖a − m_old‖²: what was quantized (small when activations change slowly)
    error: torch.Tensor  # ‖a − m_new‖²: what the receiver computes on, against the true activation

    def __add__(self, other: DeltaFidelity) -> DeltaFidelity:
        return DeltaFidelity(self.signal + other.signal, self.change + other.change, self.error + other.error)


@dataclass
class Encoded:
    """What a codec puts on the wire for one tensor."""

    payload: torch.Tensor  # flat uint8, on the host
    shape: tuple[int, ...]
    wire_dtype: torch.dtype
    codec_check: int = 0
    flags: int = 0
    fidelity: DeltaFidelity | None = None  # AQ-SGD messages with deltas in them


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

    def encode(self, tensor: torch.Tensor, ids: torch.Tensor, compress: bool = True) -> Encoded:
        """The wire form of `tensor` (a batch whose first dimension matches `ids`)."""
        if not compress:
            return self._raw(tensor)
        return self._encode(tensor.detach(), ids)

    def decode(self, header, payload: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The tensor a received message stands for: float32, or a raw message's own dtype."""
        payload = payload.to(self.device)
        if header.flags & FLAG_RAW:
            return bytes_as(payload.view(1, -1), header.dtype).view(header.shape)
        return self._decode(header, payload, ids)

    def check_header(self, header) -> str | None:
        """Why a header cannot belong to this codec (None if it can); called before the payload is allocated."""
        if header.codec != self.code or (header.flags >> 8) != self.bits:
            return f"the peer sends codec {header.codec}/{header.flags >> 8} bits but this side decodes {self.name}"
        if header.flags & FLAG_RAW:
            if header.dtype not in LOSSLESS_DTYPES:
                return f"a raw message must be one of {LOSSLESS_DTYPES}, not {header.dtype}"
            return _length_problem(header, numel(header.shape) * header.dtype.itemsize)
        return self._payload_problem(header)

    def _payload_problem(self, header) -> str | None:
        """Why a compressed payload's length cannot fit the header's shape (codecs of variable length override)."""
        return _length_problem(header, self.payload_bytes(header))

    def flags(self, raw: bool = False) -> int:
        """Header flags: the codec's bit width in bits 8-15, plus the raw flag."""
        return (self.bits << 8) | (FLAG_RAW if raw else 0)

    def _raw(self, tensor: torch.Tensor) -> Encoded:
        wire = lossless(tensor.detach()).contiguous()
        return Encoded(to_host(wire.view(torch.uint8).reshape(-1)), tuple(wire.shape), wire.dtype,
                       flags=self.flags(raw=True))

    def payload_bytes(self, header) -> int:
        """The exact payload length of a compressed message with this header."""
        return numel(header.shape) * 4

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
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
        wire = tensor.to(self._wire(tensor.dtype)).contiguous()
        return Encoded(to_host(wire.view(torch.uint8).reshape(-1)), tuple(wire.shape), wire.dtype, flags=self.flags())

    def _decode(self, header, payload: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
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


def generator_on(device: torch.device, seed: int) -> torch.Generator:
    """A seeded random generator on `device` (stochastic rounding draws where it quantizes)."""
    return torch.Generator(device=device).manual_seed(seed)


def build_codec(spec: str | CodecSpec, direction: str = "fw", store_view=None, options: QuantOptions | None = None,
                check: bool = True, device: torch.device | str = "cpu", first_sight: str = "fp32") -> LinkCodec:
    """The codec for a spec, decoding onto `device`; AQ-SGD needs `store_view` (one side of one link of the message
    store) and codes a sample without m(ξ) with `first_sight` (`fp32`: losslessly)."""
    codec = _build(spec, direction, store_view, options, check, torch.device(device), first_sight)
    codec.device = torch.device(device)
    return codec


def _build(spec: str | CodecSpec, direction: str, store_view, options: QuantOptions | None, check: bool,
           device: torch.device, first_sight: str) -> LinkCodec:
    from aqpipe.compress.link.aqsgd import AQSGDCodec
    from aqpipe.compress.link.sample_coders import CoderCodec, QuantCoder, RotatedCoder, sample_coder
    from aqpipe.compress.link.tahq import TAHQuantCodec
    from aqpipe.compress.link.topk import TopKCodec

    parsed = parse_spec(spec, direction) if isinstance(spec, str) else spec
    options = options or QuantOptions()
    if parsed.kind == "fp32":
        return FloatCodec("fp32", torch.float32, CODE_FP32)
    if parsed.kind == "fp16":
        return FloatCodec("fp16", torch.float16, CODE_FP16)
    if parsed.kind == "bf16":
        return FloatCodec("bf16", torch.bfloat16, CODE_BF16)
    if parsed.kind == "directq":
        return CoderCodec(CODE_DIRECTQ, QuantCoder(parsed.bits, options), options, device)
    if parsed.kind == "rtq":
        return CoderCodec(CODE_RTQ, RotatedCoder(parsed.bits, options), options, device)
    if parsed.kind == "tahq":
        return TAHQuantCodec(device)
    if parsed.kind == "topk":
        return TopKCodec(parsed.fraction, parsed.bits, options, device)
    if store_view is None:
        raise CodecError("the aqsgd codec needs a message store")
    first = None if first_sight == "fp32" else sample_coder(first_sight, options)
    return AQSGDCodec(parsed.bits, store_view, options, check, device, first_sight=first)
