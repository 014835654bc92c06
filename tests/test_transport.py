"""Framed messages: header round trip, validation before allocation, checksums, and real gloo peers."""

import struct

import pytest
import torch

from aqpipe.pipeline.links import transport as t
from tests.distributed import run_ranks

PEER = "rank 1 (stage 1, replica 0)"


def header(**kw):
    base = dict(kind=t.KIND_ACTIVATION, step=3, micro_batch=1, shape=(2, 8, 16), dtype=torch.float32, n_ids=2,
                payload_len=2 * 8 * 16 * 4)
    base.update(kw)
    return t.Header(**base)


def expect(**kw):
    base = dict(kind=t.KIND_ACTIVATION, step=3, micro_batch=1, n_ids=2, max_payload=1 << 20)
    base.update(kw)
    return t.Expect(**base)


def test_header_round_trip():
    h = header(checksum=123, codec_check=456, flags=7, codec=2)
    raw = h.pack()
    assert len(raw) == t.HEADER_SIZE
    assert t.parse_header(raw, PEER, expect()) == h


@pytest.mark.parametrize("side_kind,side_len,allowed,needle", [
    (t.SIDE_RESEED, 16, (t.SIDE_MASK,), "cannot carry side information of kind re-seed request"),
    (t.SIDE_MASK, 10, (t.SIDE_RESEED,), "cannot carry side information of kind attention mask"),
    (t.SIDE_MASK, 0, (t.SIDE_MASK,), "0 bytes of side information of kind attention mask"),
    (t.SIDE_NONE, 10, (t.SIDE_MASK,), "10 bytes of side information of kind none"),
    (t.SIDE_RESEED, 12, (t.SIDE_RESEED,), "not a list of int64 sample ids"),
    (9, 8, (t.SIDE_MASK,), "of kind 9"),
])
def test_side_information_must_be_of_a_kind_the_message_may_carry(side_kind, side_len, allowed, needle):
    """The re-seed request is its own typed field: an activation cannot smuggle one, nor a gradient a mask."""
    raw = header(side_kind=side_kind, side_len=side_len).pack()
    with pytest.raises(t.TransportError, match=needle):
        t.parse_header(raw, PEER, expect(side_kinds=allowed))


def test_a_typed_side_round_trips():
    h = header(side_kind=t.SIDE_RESEED, side_len=24)
    assert t.parse_header(h.pack(), PEER, expect(side_kinds=(t.SIDE_RESEED,))) == h


def corrupt(raw: bytes, fmt: str, offset: int, value) -> bytes:
    raw = bytearray(raw)
    struct.pack_into(fmt, raw, offset, value)
    return bytes(raw)


# offsets in the packed layout: magic 0, kind 4, dtype 5, ndim 6, codec 7, step 8, mb 16, n_ids 20, payload_len 24,
# checksum 32, codec_check 36, flags 40, side_len 44, shape 48..
@pytest.mark.parametrize("mutate,needle", [
    (lambda r: r[:100], "100 bytes"),
    (lambda r: r + b"x", "129 bytes"),
    (lambda r: b"JUNK" + r[4:], "bad magic"),
    (lambda r: corrupt(r, "<B", 4, 2), "kind gradient"),
    (lambda r: corrupt(r, "<q", 8, 9), "out-of-order"),
    (lambda r: corrupt(r, "<B", 5, 99), "dtype code"),
    (lambda r: corrupt(r, "<B", 6, 40), "dimensions"),
    (lambda r: corrupt(r, "<q", 48, -5), "absurd shape"),
    (lambda r: corrupt(r, "<q", 48, 1 << 40), "absurd shape"),
    (lambda r: corrupt(r, "<i", 44, -1), "side information length"),
    (lambda r: corrupt(r, "<i", 44, 1 << 30), "side information length"),
    (lambda r: corrupt(r, "<i", 20, 1 << 30), "sample ids"),
    (lambda r: corrupt(r, "<q", 24, 1 << 50), "absurd payload length"),
    (lambda r: corrupt(r, "<q", 24, -1), "absurd payload length"),
])
def test_malformed_headers_are_rejected_naming_the_peer(mutate, needle):
    with pytest.raises(t.TransportError) as err:
        t.parse_header(mutate(header().pack()), PEER, expect())
    assert PEER in str(err.value) and needle in str(err.value)


def test_the_link_codec_checks_the_header_before_allocation():
    from aqpipe.compress.link.factory import build_codec

    codec = build_codec("fp32")
    checked = expect(check=codec.check_header)
    good = header(codec=codec.code, flags=codec.flags())
    assert t.parse_header(good.pack(), PEER, checked).payload_len == 1024
    with pytest.raises(t.TransportError, match="does not match shape"):
        t.parse_header(header(codec=codec.code, flags=codec.flags(), payload_len=1000).pack(), PEER, checked)
    with pytest.raises(t.TransportError, match="this side decodes fp32"):
        t.parse_header(header(codec=5, flags=2 << 8).pack(), PEER, checked)


def _stream_from_rank_1(rank):
    """A stream from rank 1 (the sender) to rank 0 (the receiver), opened as the links open theirs."""
    from aqpipe.pipeline.links.streams import open_streams

    name = "test stream"
    return open_streams([name] if rank == 0 else [], [name] if rank == 1 else [], None, 20)[name]


def _send_then_receive(rank, world, mode):
    """Rank 1 sends (a good or a bad message); rank 0 receives through an Inbox and reports what it got."""
    inbox_peer = "rank 1 (stage 1, replica 0)"
    ids = torch.tensor([5, 9])
    payload = torch.arange(64, dtype=torch.float32).view(torch.uint8)
    stream = _stream_from_rank_1(rank)
    if rank == 1:
        h = t.Header(t.KIND_ACTIVATION, 0, 0, (8, 8), torch.float32, 2, payload.numel(),
                     side_kind=t.SIDE_MASK if "side" in mode else t.SIDE_NONE)
        if mode in ("good", "side"):
            box = t.Outbox(stream, "rank 0", timeout=20)
            box.send(h, ids, payload, SIDE if mode == "side" else None)
            box.close()
        elif mode == "damaged side":
            h.side_len = SIDE.numel()
            h.checksum = t.body_checksum(ids, payload, SIDE)
            bad = SIDE.clone()
            bad[1, 2] ^= 1  # one flipped mask bit: the attention pattern would change silently
            stream.sendall(h.pack() + bytes(torch.cat([ids.view(torch.uint8), payload, bad.reshape(-1)]).numpy()))
        elif mode == "short":
            stream.sendall(bytes(100))  # then the sender is gone: the receiver must say so, not hang
        elif mode == "huge":
            h.payload_len = 1 << 45
            stream.sendall(h.pack())
        elif mode == "damaged":
            h.checksum = t.body_checksum(ids, payload) ^ 1
            stream.sendall(h.pack() + bytes(torch.cat([ids.view(torch.uint8), payload]).numpy()))
        stream.close()
        return None
    inbox = t.Inbox(stream, inbox_peer, timeout=20)
    inbox.expect(t.Expect(t.KIND_ACTIVATION, 0, 0, 2, max_payload=1 << 20, side_kinds=(t.SIDE_MASK,)))
    try:
        msg = inbox.get()
    except t.TransportError as e:
        return ("error", str(e))
    finally:
        inbox.close()
    side = None if msg.side is None else msg.side.tolist()
    return ("ok", msg.ids.tolist(), msg.payload.view(torch.float32).tolist(), msg.header.shape, side)


SIDE = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.uint8)  # a padded batch's attention mask


def test_a_message_crosses_gloo_intact():
    (_, got), _ = run_ranks(_send_then_receive, 2, "good")
    assert got == ("ok", [5, 9], [float(i) for i in range(64)], (8, 8), None)


def test_side_information_crosses_gloo_losslessly():
    (_, got), _ = run_ranks(_send_then_receive, 2, "side")
    assert got == ("ok", [5, 9], [float(i) for i in range(64)], (8, 8), SIDE.reshape(-1).tolist())


def _reseed_list_behind_an_odd_payload(rank, world, payload_len):
    """Rank 1 sends a gradient whose payload has an odd length, with a list of sample ids as side information (the
    receiver's re-seed request); rank 0 reads the list the way the worker does."""
    ids = torch.tensor([5, 9])
    payload = torch.arange(payload_len, dtype=torch.int64).to(torch.uint8)
    request = torch.tensor([3, 11, 1 << 40], dtype=torch.int64)
    stream = _stream_from_rank_1(rank)
    if rank == 1:
        box = t.Outbox(stream, "rank 0", timeout=20)
        box.send(t.Header(t.KIND_GRADIENT, 0, 0, (payload_len,), torch.uint8, 2, payload_len,
                          side_kind=t.SIDE_RESEED), ids, payload, request.view(torch.uint8))
        box.close()
        return None
    inbox = t.Inbox(stream, "rank 1 (stage 1, replica 0)", timeout=20)
    inbox.expect(t.Expect(t.KIND_GRADIENT, 0, 0, 2, max_payload=1 << 20, side_kinds=(t.SIDE_RESEED,)))
    try:
        msg = inbox.get()
    finally:
        inbox.close()
    return msg.side.view(torch.int64).tolist(), msg.payload.tolist() == payload.tolist()


@pytest.mark.parametrize("payload_len", [7, 532_482])
def test_side_information_behind_an_odd_payload_reads_as_int64(payload_len):
    """`--bw topk:0.2:8` on a 1x1024x1600 gradient is 532,482 bytes: the id list after it sat at an unaligned offset."""
    results = run_ranks(_reseed_list_behind_an_odd_payload, 2, payload_len)
    assert results[0] == ("ok", ([3, 11, 1 << 40], True)), results


def test_an_activations_side_information_is_one_row_per_sample_or_an_error():
    from aqpipe.pipeline.links.link_ends import per_sample

    assert torch.equal(per_sample(SIDE.reshape(-1), torch.tensor([5, 9])), SIDE)
    assert per_sample(None, torch.tensor([5, 9])) is None
    with pytest.raises(t.TransportError, match="does not split over 3 samples"):
        per_sample(SIDE.reshape(-1), torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("mode,needle", [("short", "rank 1"), ("huge", "absurd payload length"),
                                         ("damaged", "fails its checksum"), ("damaged side", "fails its checksum")])
def test_bad_messages_from_a_gloo_peer_are_rejected_naming_it(mode, needle):
    (status, got), _ = run_ranks(_send_then_receive, 2, mode)
    assert status == "ok", got
    assert got[0] == "error"
    assert "rank 1 (stage 1, replica 0)" in got[1] and needle in got[1]


def _async_send(rank, world):
    """Rank 1 sends while rank 0 is still busy for 2 s: send() must return at once, flush() waits until the message
    is out (64 MiB: more than the kernel's socket buffers hold, so most of it waits for the receiver)."""
    import time

    stream = _stream_from_rank_1(rank)
    if rank == 0:
        time.sleep(2.0)
        inbox = t.Inbox(stream, "rank 1", timeout=30)
        inbox.expect(t.Expect(t.KIND_ACTIVATION, 0, 0, 1))
        msg = inbox.get()
        inbox.close()
        return msg.payload.numel()
    box = t.Outbox(stream, "rank 0", timeout=30)
    payload = torch.zeros(64 << 20, dtype=torch.uint8)
    start = time.perf_counter()
    box.send(t.Header(t.KIND_ACTIVATION, 0, 0, (payload.numel(),), torch.uint8, 1, payload.numel()),
             torch.tensor([0]), payload)
    queued = time.perf_counter() - start
    box.flush()
    delivered = time.perf_counter() - start
    box.close()
    return queued, delivered


def test_sends_are_asynchronous():
    (s0, received), (s1, (queued, delivered)) = run_ranks(_async_send, 2)
    assert s0 == s1 == "ok"
    assert received == 64 << 20
    assert queued < 1.0 < delivered  # the sender was free to compute while the message waited for its receiver


class _LandsWhenWaited:
    """Stands in for the CUDA event of a payload's queued copy to the host: the bytes land only when it is waited on
    (so a writer that read them before waiting would send zeros, under a checksum of zeros)."""

    def __init__(self, payload: torch.Tensor, value: int) -> None:
        self.payload, self.value, self.waited = payload, value, False

    def synchronize(self) -> None:
        self.payload.fill_(self.value)
        self.waited = True


def test_the_writer_waits_for_a_queued_copy_before_it_checksums_and_sends_the_bytes():
    import socket

    sender, receiver = socket.socketpair()
    box, inbox = t.Outbox(sender, "rank 1", timeout=10), t.Inbox(receiver, "rank 0", timeout=10)
    payload = torch.zeros(4096, dtype=torch.uint8)
    ready = _LandsWhenWaited(payload, 7)
    inbox.expect(t.Expect(t.KIND_ACTIVATION, 0, 0, 2))
    box.send(t.Header(t.KIND_ACTIVATION, 0, 0, (payload.numel(),), torch.uint8, 2, payload.numel()),
             torch.tensor([5, 9]), payload, ready=ready)
    box.flush()
    msg = inbox.get()  # raises if the header's checksum was of other bytes than the body's
    assert ready.waited
    assert torch.equal(msg.payload, torch.full((4096,), 7, dtype=torch.uint8)) and msg.ids.tolist() == [5, 9]
    box.close()
    inbox.close()


def test_an_encoded_messages_payload_is_read_only_after_its_copy_lands():
    from aqpipe.compress.link.base import Encoded

    host = torch.zeros(8, dtype=torch.uint8)
    encoded = Encoded(host, (8,), torch.uint8, ready=_LandsWhenWaited(host, 3))
    assert encoded.payload_len == 8 and not encoded.ready.waited  # the length is known before the bytes
    assert encoded.payload.tolist() == [3] * 8


def _socket_pair(pin_for: torch.device | None = None):
    import socket

    sender, receiver = socket.socketpair()
    return t.Outbox(sender, "rank 1", timeout=10), t.Inbox(receiver, "rank 0", 10, pin_for)


def test_a_host_receivers_message_lands_in_ordinary_memory_and_arrives_intact():
    # a receiver that decodes on the host never pins (its device is not a GPU's)
    box, inbox = _socket_pair(torch.device("cpu"))
    assert inbox.pin_for is None
    payload = torch.arange(4099, dtype=torch.int64).to(torch.uint8)  # an odd length: the side starts unaligned
    inbox.expect(t.Expect(t.KIND_GRADIENT, 0, 0, 2, side_kinds=(t.SIDE_RESEED,)))
    side = torch.tensor([11, 13], dtype=torch.int64).view(torch.uint8)
    box.send(t.Header(t.KIND_GRADIENT, 0, 0, (payload.numel(),), torch.uint8, 2, payload.numel(),
                      side_len=side.numel(), side_kind=t.SIDE_RESEED), torch.tensor([5, 9]), payload, side)
    box.flush()
    msg = inbox.get()
    assert torch.equal(msg.payload, payload) and msg.ids.tolist() == [5, 9]
    assert msg.side is not None and msg.side.view(torch.int64).tolist() == [11, 13]
    assert not msg.payload.is_pinned()
    box.close()
    inbox.close()


def test_a_gpu_receivers_body_is_page_locked_in_its_gpus_context_and_its_ids_do_not_hold_it(monkeypatch):
    """A GPU rank's inbox receives each body into a pinned block (allocated in the decoding GPU's context, not the
    thread's default GPU 0), and the sample ids it hands on are a copy: a stage keeps them to the step's end, and a
    view would keep the whole pinned body alive with them. (On the host: pinning and the GPU's context are recorded
    stand-ins.)"""
    import contextlib

    pinned, contexts = [], []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        out = real_empty(*args, **kwargs)
        if pin_memory:
            pinned.append(out)
        return out

    @contextlib.contextmanager
    def in_context(device):
        contexts.append(device)
        yield

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "device", in_context)
    box, inbox = _socket_pair(torch.device("cuda", 3))
    payload = torch.arange(64, dtype=torch.uint8)
    inbox.expect(t.Expect(t.KIND_ACTIVATION, 0, 0, 2))
    box.send(t.Header(t.KIND_ACTIVATION, 0, 0, (64,), torch.uint8, 2, 64), torch.tensor([5, 9]), payload)
    box.flush()
    msg = inbox.get()
    assert len(pinned) == 1 and contexts == [torch.device("cuda", 3)]
    body = pinned[0].untyped_storage().data_ptr()
    assert msg.payload.untyped_storage().data_ptr() == body and torch.equal(msg.payload, payload)
    assert msg.ids.untyped_storage().data_ptr() != body and msg.ids.tolist() == [5, 9]
    box.close()
    inbox.close()


def test_a_message_with_an_empty_body_arrives_without_a_read():
    box, inbox = _socket_pair()
    inbox.expect(t.Expect(t.KIND_GRADIENT, 0, 0, 0))
    box.send(t.Header(t.KIND_GRADIENT, 0, 0, (0,), torch.uint8, 0, 0), torch.zeros(0, dtype=torch.int64),
             torch.zeros(0, dtype=torch.uint8))
    box.flush()
    msg = inbox.get()
    assert msg.payload.numel() == 0 and msg.ids.numel() == 0 and msg.side is None
    box.close()
    inbox.close()


def _framed_message(body_bytes: int) -> bytes:
    """One activation message as it crosses the wire: its header, then its body (2 sample ids and the payload)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    def read_all() -> bytearray:
        data = bytearray()
        while len(data) < t.HEADER_SIZE + body_bytes:
            data += capture.recv(1 << 20)
        return data

    sender, capture = socket.socketpair()
    box = t.Outbox(sender, "rank 1", timeout=10)
    payload = torch.arange(body_bytes - 16, dtype=torch.int64).to(torch.uint8)
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(read_all)
        box.send(t.Header(t.KIND_ACTIVATION, 0, 0, (payload.numel(),), torch.uint8, 2, payload.numel()),
                 torch.tensor([5, 9]), payload)
        box.flush()
        data = reading.result(timeout=10)
    box.close()
    capture.close()
    return bytes(data)


def test_a_body_that_waited_in_the_kernel_before_its_receiver_came_claims_no_time_on_the_wire():
    """A busy receiver finds the whole message already in the kernel's buffer: reading it takes microseconds, which
    say nothing of the link (its bytes over that time would read as a link many times faster than it is)."""
    import socket

    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sender.sendall(_framed_message(64 << 10))  # all of it queued before the receiver looks
    inbox = t.Inbox(receiver, "rank 0", timeout=10)
    inbox.expect(t.Expect(t.KIND_ACTIVATION, 0, 0, 2))
    msg = inbox.get()
    assert msg.wire_bytes == t.HEADER_SIZE + (64 << 10) and msg.arrived_bytes == 0
    inbox.close()
    sender.close()


def test_a_receiver_that_comes_late_measures_the_rate_at_which_the_rest_of_the_body_arrives():
    """Three quarters of the body wait in the kernel when the receiver starts; the last quarter comes at a paced
    rate. The link rate the message gives (bytes that arrived while it was timed, over that time) is the paced one,
    not the body over the time to read it (four times the pace here)."""
    import socket
    import time

    from aqpipe.pipeline.links.streams import queued_bytes

    sender, receiver = socket.socketpair()
    for end, option in ((sender, socket.SO_SNDBUF), (receiver, socket.SO_RCVBUF)):
        end.setsockopt(socket.SOL_SOCKET, option, 1 << 20)
    framed = _framed_message(256 << 10)
    early = t.HEADER_SIZE + (192 << 10)
    sender.sendall(framed[:early])
    inbox = t.Inbox(receiver, "rank 0", timeout=10)
    inbox.expect(t.Expect(t.KIND_ACTIVATION, 0, 0, 2))
    deadline = time.monotonic() + 10
    while queued_bytes(receiver) > early - t.HEADER_SIZE:  # until the receiver has read the header
        assert time.monotonic() < deadline
        time.sleep(0.001)
    start = time.perf_counter()
    time.sleep(0.175)
    for i in range(early, len(framed), 8 << 10):
        time.sleep(0.025)
        sender.sendall(framed[i:i + (8 << 10)])
    paced = (len(framed) - early) / (time.perf_counter() - start)
    msg = inbox.get()
    measured = msg.arrived_bytes / msg.transfer_seconds
    assert 0.5 * paced <= measured <= 2.0 * paced, (measured / paced, msg.arrived_bytes, msg.transfer_seconds)
    inbox.close()
    sender.close()


def test_a_links_rate_counts_what_arrived_while_timed_or_where_nothing_did_the_bodies():
    assert t.achieved_rate(body_bytes=1000, arrived_bytes=400, seconds=2.0) == 200.0
    assert t.achieved_rate(body_bytes=1000, arrived_bytes=0, seconds=2.0) == 500.0  # (small messages: one burst each)
    assert t.achieved_rate(body_bytes=0, arrived_bytes=0, seconds=0.0) == 0.0
