"""Framed point-to-point messages between stages: a fixed, validated header, then sample ids and the payload.

A message on a link's stream (`aqpipe.pipeline.links.streams`) is the 128-byte header, then a body of `n_ids` int64 sample
ids, `payload_len` payload bytes, and `side_len` bytes of lossless side information (last, so the payload stays
aligned for its dtype). The header's `side_kind` says what the side information is: an activation's attention
mask (one row per sample), or a gradient's re-seed request (int64 sample ids); a receiver accepts only the kinds
its message kind can carry. The receiver validates the header before it allocates the body,
and checks the body's CRC32 before it hands the message on. A background thread per inbound link receives
ahead of the compute thread, so a stage computes micro-batch i while i+1 is on the wire.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aqpipe.compress.gpu.copies import to_host
from aqpipe.pipeline.links.streams import queued_bytes, read_exactly

if TYPE_CHECKING:
    from aqpipe.compress.gpu.copies import Landing
    from aqpipe.compress.link.base import Encoded

MAGIC = b"AQP1"
HEADER_SIZE = 128
MAX_DIMS = 8
# magic, kind, dtype, ndim, codec, step, micro_batch, n_ids, payload_len, checksum, codec_check, flags, side_len,
# shape[8], side_kind
_LAYOUT = struct.Struct("<4sBBBBqiiqIIIi8qB")
assert _LAYOUT.size <= HEADER_SIZE

KIND_ACTIVATION = 1
KIND_GRADIENT = 2
KIND_EVAL = 3  # an evaluation activation: fp32, never through a compressing codec or the store
KIND_TIED_ROWS = 4  # rows of a tied table, from the stage that owns it to the one that looks them up
KIND_TIED_GRADS = 5  # the gradient's rows of a tied table, the other way
KIND_NAMES = {KIND_ACTIVATION: "activation", KIND_GRADIENT: "gradient", KIND_EVAL: "evaluation activation",
              KIND_TIED_ROWS: "tied table rows", KIND_TIED_GRADS: "tied table gradient rows"}

SIDE_NONE = 0
SIDE_MASK = 1  # an activation's attention mask: one row of bytes per sample
SIDE_RESEED = 2  # a receiver's re-seed request: int64 ids of samples whose m(ξ) it lacks, riding on a gradient
SIDE_NAMES = {SIDE_NONE: "none", SIDE_MASK: "attention mask", SIDE_RESEED: "re-seed request"}

DTYPES: dict[int, torch.dtype] = {
    1: torch.float32, 2: torch.float16, 3: torch.bfloat16, 4: torch.uint8, 5: torch.int64, 6: torch.int32,
}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
# No single message may exceed this many bytes, whatever a header claims (a corrupt length must not allocate).
DEFAULT_MAX_MESSAGE_BYTES = 2 << 30
# An outbox writes at most this much per socket call, so its timeout bounds a stall, not a message's length.
SEND_CHUNK = 1 << 20
# Messages an outbox holds before `send` waits: receivers post a whole step (or evaluation pass) of receives up
# front, so waiting here cannot deadlock; it bounds the host memory queued sends pin.
SEND_QUEUE = 4


class TransportError(RuntimeError):
    """A message that is malformed, damaged, unexpected, or never arrives; the text names the peer."""


@dataclass
class Header:
    """The fixed part of a message."""

    kind: int
    step: int
    micro_batch: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    n_ids: int
    payload_len: int
    codec: int = 0
    checksum: int = 0
    codec_check: int = 0
    flags: int = 0
    side_len: int = 0
    side_kind: int = SIDE_NONE

    @classmethod
    def for_encoded(cls, encoded: Encoded, codec: int, kind: int = 0, step: int = 0, micro_batch: int = 0,
                    n_ids: int = 0, side_kind: int = SIDE_NONE) -> Header:
        """The header of a message carrying `encoded` (made by the codec whose code is `codec`)."""
        return cls(kind, step, micro_batch, encoded.shape, encoded.wire_dtype, n_ids, encoded.payload_len,
                   codec=codec, codec_check=encoded.codec_check, flags=encoded.flags, side_kind=side_kind)

    def pack(self) -> bytes:
        """The 128 bytes on the wire."""
        if len(self.shape) > MAX_DIMS:
            raise ValueError(f"tensors of more than {MAX_DIMS} dimensions cannot be sent, got {len(self.shape)}")
        shape = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        raw = _LAYOUT.pack(
            MAGIC, self.kind, DTYPE_CODES[self.dtype], len(self.shape), self.codec, self.step, self.micro_batch,
            self.n_ids, self.payload_len, self.checksum, self.codec_check, self.flags, self.side_len, *shape,
            self.side_kind,
        )
        return raw.ljust(HEADER_SIZE, b"\0")


@dataclass
class Expect:
    """What the receiver knows the next message must be."""

    kind: int
    step: int
    micro_batch: int
    n_ids: int
    max_payload: int = DEFAULT_MAX_MESSAGE_BYTES
    # The link codec's own check of a header (why it cannot decode it, or None), run before allocating.
    check: Callable[[Header], str | None] | None = None
    side_kinds: tuple[int, ...] = ()  # the kinds of side information this message may carry (none is always fine)


def parse_header(raw: bytes, peer: str, expect: Expect) -> Header:
    """Decode and validate a header; raise TransportError naming `peer` on anything malformed or unexpected."""
    if len(raw) != HEADER_SIZE:
        raise TransportError(f"malformed header from {peer}: {len(raw)} bytes, expected {HEADER_SIZE}")
    fields = _LAYOUT.unpack_from(raw)
    magic, kind, dtype_code, ndim, codec, step, mb, n_ids, payload_len, checksum, codec_check, flags, side_len = fields[:13]
    dims, side_kind = fields[13:21], fields[21]
    if magic != MAGIC:
        raise TransportError(f"malformed header from {peer}: bad magic {magic!r} (not an aqpipe peer, or a stream out of step)")
    if kind != expect.kind:
        raise TransportError(f"unexpected message from {peer}: kind {KIND_NAMES.get(kind, kind)}, "
                             f"expected {KIND_NAMES[expect.kind]}")
    if (step, mb) != (expect.step, expect.micro_batch):
        raise TransportError(
            f"out-of-order message from {peer}: step {step} micro-batch {mb}, expected step {expect.step} "
            f"micro-batch {expect.micro_batch}"
        )
    if dtype_code not in DTYPES:
        raise TransportError(f"malformed header from {peer}: unknown dtype code {dtype_code}")
    if not 0 <= ndim <= MAX_DIMS:
        raise TransportError(f"malformed header from {peer}: {ndim} dimensions (at most {MAX_DIMS})")
    shape = tuple(dims[:ndim])
    if any(d < 0 for d in shape) or any(d != 0 for d in dims[ndim:]):
        raise TransportError(f"malformed header from {peer}: absurd shape {tuple(dims)}")
    numel = 1
    for d in shape:
        numel *= d
    # A codec shrinks a tensor at most 32x (1 bit per fp32 element); a claim beyond that is corrupt.
    if numel * DTYPES[dtype_code].itemsize > expect.max_payload * 64:
        raise TransportError(f"malformed header from {peer}: absurd shape {shape} for a {expect.max_payload}-byte limit")
    if n_ids != expect.n_ids:
        raise TransportError(f"malformed header from {peer}: {n_ids} sample ids, expected {expect.n_ids}")
    if not 0 <= payload_len <= expect.max_payload:
        raise TransportError(f"malformed header from {peer}: absurd payload length {payload_len} (limit {expect.max_payload})")
    if not 0 <= side_len <= expect.max_payload:
        raise TransportError(f"malformed header from {peer}: absurd side information length {side_len}")
    _check_side(side_kind, side_len, peer, expect)
    header = Header(kind, step, mb, shape, DTYPES[dtype_code], n_ids, payload_len, codec, checksum, codec_check, flags,
                    side_len, side_kind)
    problem = expect.check(header) if expect.check is not None else None
    if problem:
        raise TransportError(f"malformed header from {peer}: {problem}")
    return header


def _check_side(side_kind: int, side_len: int, peer: str, expect: Expect) -> None:
    """Side information must be of a kind this message may carry, present exactly when a kind is named."""
    if side_kind != SIDE_NONE and side_kind not in expect.side_kinds:
        raise TransportError(f"malformed header from {peer}: a {KIND_NAMES[expect.kind]} cannot carry side information "
                             f"of kind {SIDE_NAMES.get(side_kind, side_kind)}")
    if (side_kind == SIDE_NONE) != (side_len == 0):
        raise TransportError(f"malformed header from {peer}: {side_len} bytes of side information of kind "
                             f"{SIDE_NAMES.get(side_kind, side_kind)}")
    if side_kind == SIDE_RESEED and side_len % 8:
        raise TransportError(f"malformed header from {peer}: a re-seed request of {side_len} bytes is not a list of "
                             "int64 sample ids")


def body_checksum(ids: torch.Tensor, payload: torch.Tensor | list[torch.Tensor], side: torch.Tensor | None = None
                  ) -> int:
    """CRC32 of the sample ids, the payload bytes (of each of its parts in turn), then the side information."""
    crc = zlib.crc32(ids.numpy().tobytes())
    for part in payload if isinstance(payload, list) else [payload]:
        crc = zlib.crc32(part.numpy().data, crc)
    if side is not None and side.numel():
        crc = zlib.crc32(side.numpy().tobytes(), crc)
    return crc & 0xFFFFFFFF


@dataclass
class Message:
    """A received, validated message."""

    header: Header
    ids: torch.Tensor
    payload: torch.Tensor
    wire_bytes: int
    side: torch.Tensor | None = None  # side information (flat uint8), or None; header.side_kind says what it is
    # From the header's arrival to the body's, and the body bytes that arrived in that time (not those already in the
    # kernel's buffer: a busy receiver finds some or all of a body there, read in microseconds): their ratio is the
    # link's achieved rate, whether or not the receiver kept up
    transfer_seconds: float = 0.0
    arrived_bytes: int = 0


def achieved_rate(body_bytes: float, arrived_bytes: float, seconds: float) -> float:
    """A link's achieved bytes/s from what its receiver timed (`Message`): the body bytes that arrived while timed over
    that time; where none did (each body came in one burst with its header: small messages), the bodies over the
    time to read them, which reads high (a burst is read at memory speed)."""
    if seconds <= 0:
        return 0.0
    return (arrived_bytes if arrived_bytes > 0 else body_bytes) / seconds


class Outbox:
    """Sends messages to one peer over a stream (`aqpipe.pipeline.links.streams`) from a writer thread: `send` returns at
    once unless `queue_size` (SEND_QUEUE) messages already wait (backpressure), `flush` waits until everything
    queued has been handed to the kernel."""

    def __init__(self, stream: socket.socket, peer_name: str, timeout: float, queue_size: int = SEND_QUEUE) -> None:
        self.stream, self.peer_name = stream, peer_name
        # each send() call of at most SEND_CHUNK bytes must make progress within this long, or the peer is stalled
        stream.settimeout(timeout)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: TransportError | None = None
        self._thread = threading.Thread(target=self._run, name=f"outbox-{peer_name}", daemon=True)
        self._thread.start()

    def send(self, header: Header, ids: torch.Tensor, payload: torch.Tensor | list[torch.Tensor],
             side: torch.Tensor | None = None, ready: Landing | None | list[Landing | None] = None) -> None:
        """Queue one message (header.checksum is filled by the writer thread); `side` is lossless extra data sent as
        raw bytes, of the kind header.side_kind names. With `ready`, the payload is host memory a device copy is still
        filling: the writer thread waits on the event before it reads the bytes, so the caller never waits. A payload
        given as parts (each with its own `ready`) goes as their concatenation, never joined in memory."""
        self._raise_error()
        # the writer thread reads the bytes later: the small parts are copied now (the caller may reuse its tensors);
        # the payload is a codec's own bytes (a codec never hands over a tensor it will change)
        ids = ids.to(torch.int64).cpu().clone()
        parts = list(payload) if isinstance(payload, list) else [payload]
        landings = list(ready) if isinstance(ready, list) else [ready] * len(parts)
        for i, part in enumerate(parts):
            parts[i] = part.contiguous().view(torch.uint8).reshape(-1)
            if parts[i].device.type != "cpu":
                parts[i], landings[i] = to_host(parts[i])
        side = torch.empty(0, dtype=torch.uint8) if side is None else side.cpu().clone().view(torch.uint8).reshape(-1)
        header.n_ids, header.payload_len, header.side_len = ids.numel(), sum(p.numel() for p in parts), side.numel()
        if (header.side_kind == SIDE_NONE) != (side.numel() == 0):
            raise ValueError(f"side information of {side.numel()} bytes with side_kind {header.side_kind}")
        self._queue.put((header, ids, parts, side, landings))

    def flush(self) -> None:
        """Block until every queued message has been handed to the kernel (or raise why it could not be)."""
        self._queue.join()
        self._raise_error()

    def close(self, abort: bool = False) -> None:
        """Send what is queued (raising why it could not be), then close the stream; with `abort` (unwinding an
        error), drop what is queued and close at once, so the peer sees the end of the stream now."""
        if abort:
            _shutdown(self.stream)
        self._queue.put(None)
        self._thread.join()
        self.stream.close()
        if not abort:
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _write(self, data: memoryview) -> None:
        for start in range(0, len(data), SEND_CHUNK):
            self.stream.sendall(data[start : start + SEND_CHUNK])

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    header, ids, payload, side, landings = item
                    for ready in landings:
                        if ready is not None:
                            ready.synchronize()  # the payload's device-to-host copy has landed
                    header.checksum = body_checksum(ids, payload, side)
                    # the parts go as they are (no joined copy): the header, then the body the checksum covers
                    for part in (header.pack(), *(_bytes(t) for t in (ids, *payload, side) if t.numel())):
                        self._write(memoryview(part))
            except BaseException as e:  # noqa: BLE001 - the stream is broken: later sends and flushes raise this
                what = "stopped reading" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {_first_line(e)}"
                self._error = TransportError(f"sending to {self.peer_name} failed: {what}")
            finally:
                item = None  # let go of the sent buffer now, not when the next message arrives
                self._queue.task_done()


def _bytes(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes, without a copy."""
    return t.numpy().data.cast("B")


def _shutdown(stream: socket.socket) -> None:
    """End both directions of a stream, waking a thread blocked on it; an already broken stream is fine."""
    try:
        stream.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Inbox:
    """Receives messages from one peer over a stream in a background thread, in the order they are expected.
    `device`: where the receiver decodes; a GPU's messages are received into page-locked memory (`receive_buffer`)."""

    def __init__(self, stream: socket.socket, peer_name: str, timeout: float, device: torch.device | None = None
                 ) -> None:
        self.stream, self.peer_name, self.timeout = stream, peer_name, timeout
        self.pin_for = device if device is not None and device.type == "cuda" else None  # the GPU bodies go to
        self._expected: queue.Queue = queue.Queue()
        self._received: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"inbox-{peer_name}", daemon=True)
        self._thread.start()

    def expect(self, expectation: Expect) -> None:
        """Announce the next message; the thread starts receiving it at once."""
        self._expected.put(expectation)

    def close(self) -> None:
        """Stop the thread once it has nothing more to receive, and close the stream."""
        self._expected.put(None)
        self._thread.join(timeout=1.0)
        if self._thread.is_alive():  # blocked reading a message that will not come: wake it with end-of-stream
            _shutdown(self.stream)
            self._thread.join()
        self.stream.close()

    def get(self) -> Message:
        """The next message, waiting up to the timeout; re-raises the thread's error with the peer named."""
        try:
            item = self._received.get(timeout=self.timeout)
        except queue.Empty:
            raise TransportError(f"no message from {self.peer_name} within {self.timeout:.0f} s (peer dead or stalled)") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _run(self) -> None:
        while True:
            expectation = self._expected.get()
            if expectation is None:
                return
            try:
                self._received.put(self._receive(expectation))
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread
                if not isinstance(e, TransportError):
                    e = TransportError(f"receiving from {self.peer_name} failed: {type(e).__name__}: {_first_line(e)}")
                self._received.put(e)
                return

    def _read_into(self, buffer: memoryview) -> None:
        try:
            read_exactly(self.stream, buffer)
        except EOFError:
            raise TransportError(f"{self.peer_name} closed the link (peer dead or finished early)") from None

    def _receive(self, expect: Expect) -> Message:
        head = bytearray(HEADER_SIZE)
        self._read_into(memoryview(head))
        header = parse_header(bytes(head), self.peer_name, expect)
        body_len = 8 * header.n_ids + header.side_len + header.payload_len
        body = receive_buffer(body_len, self.pin_for)
        start = time.perf_counter()
        waiting = min(queued_bytes(self.stream), body_len) if body_len else 0
        if body.numel():
            self._read_into(body.numpy().data)
        transfer_seconds = time.perf_counter() - start
        ids = body[: 8 * header.n_ids].view(torch.int64)
        payload = body[8 * header.n_ids : 8 * header.n_ids + header.payload_len]
        side = body[8 * header.n_ids + header.payload_len :]
        if body_checksum(ids, payload, side) != header.checksum:
            raise TransportError(
                f"damaged message from {self.peer_name}: step {header.step} micro-batch {header.micro_batch} fails its checksum"
            )
        # the side information starts wherever the payload ends, often at an odd offset: a copy of its own lets it be
        # read as any type (a re-seed request is a list of int64 sample ids). The ids get one too: a stage keeps them
        # to the step's end, and a view would keep the whole body (pinned, for a GPU) alive with them
        return Message(header, ids.clone(), payload, HEADER_SIZE + body.numel(),
                       side.clone() if header.side_len else None, transfer_seconds, body_len - waiting)


def receive_buffer(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    """A flat uint8 host tensor to receive a message body into. For a GPU (`device`) it is page-locked, from torch's
    cache of pinned blocks: the payload's copy to the GPU is then a DMA the host neither waits for nor stages through
    a driver buffer (from pageable memory the copy holds the host until the driver has copied every byte), and the
    block is not reused before that copy is done (torch records it)."""
    if device is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    with torch.cuda.device(device):  # the inbox thread's allocation: in the decoding GPU's context, not GPU 0's
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""

