"""Link streams: the rendezvous checks who connects, fails clearly when nobody does, and a sender whose peer stops
reading fails instead of hanging."""

import socket
import threading

import pytest
import torch

from aqpipe.pipeline.links import streams as s
from aqpipe.pipeline.links import transport as t


def test_a_stray_connection_is_turned_away_and_the_right_sender_accepted():
    listener = s.Listener("127.0.0.1")
    stray = socket.create_connection(listener.endpoint)
    stray.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(80))
    accepted = {}
    thread = threading.Thread(target=lambda: accepted.update(sock=listener.accept("replica 0 link 1 gradient", 10)))
    thread.start()
    with pytest.raises(s.StreamError, match="did not accept stream replica 0 link 0 gradient"):
        s.confirm(s.connect(listener.endpoint, "replica 0 link 0 gradient", 10), "replica 0 link 0 gradient", 10)
    right = s.connect(listener.endpoint, "replica 0 link 1 gradient", 10)
    thread.join()
    right = s.confirm(right, "replica 0 link 1 gradient", 10)
    right.sendall(b"x")
    assert accepted["sock"].recv(1) == b"x"
    for sock in (stray, right, accepted["sock"]):
        sock.close()


def test_nobody_connecting_fails_naming_the_stream():
    listener = s.Listener("127.0.0.1")
    with pytest.raises(s.StreamError, match="no sender connected to stream replica 0 link 0 activation within"):
        listener.accept("replica 0 link 0 activation", 0.3)


def test_connecting_to_nobody_fails_naming_the_address():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(s.StreamError, match=f"cannot connect stream x to 127.0.0.1:{port}"):
            s.connect(("127.0.0.1", port), "x", 0.3)


def test_a_long_stream_name_is_refused():
    with pytest.raises(ValueError, match="longer than 64 bytes"):
        s.connect(("127.0.0.1", 1), "n" * 65, 0.1)


def test_a_peer_that_stops_reading_fails_the_sender_after_the_timeout():
    listener = s.Listener("127.0.0.1")
    sender = s.connect(listener.endpoint, "stalled", 10)
    receiver = listener.accept("stalled", 10)
    sender = s.confirm(sender, "stalled", 10)  # accepted, never read
    box = t.Outbox(sender, "rank 1 (stage 1, replica 0)", timeout=0.5)
    payload = torch.zeros(64 << 20, dtype=torch.uint8)  # far more than the kernel's socket buffers hold
    box.send(t.Header(t.KIND_ACTIVATION, 0, 0, (payload.numel(),), torch.uint8, 1, payload.numel()),
             torch.tensor([0]), payload)
    with pytest.raises(t.TransportError, match=r"sending to rank 1 \(stage 1, replica 0\) failed: stopped reading"):
        box.flush()
    receiver.close()
    sender.close()


def test_aborting_an_outbox_to_a_stalled_peer_returns_at_once():
    """Unwinding an error must not wait out the stall timeout on every queued message."""
    import time

    listener = s.Listener("127.0.0.1")
    sender = s.connect(listener.endpoint, "stalled", 10)
    receiver = listener.accept("stalled", 10)
    sender = s.confirm(sender, "stalled", 10)
    box = t.Outbox(sender, "rank 1", timeout=60)
    payload = torch.zeros(64 << 20, dtype=torch.uint8)
    box.send(t.Header(t.KIND_ACTIVATION, 0, 0, (payload.numel(),), torch.uint8, 1, payload.numel()),
             torch.tensor([0]), payload)
    start = time.perf_counter()
    box.close(abort=True)
    assert time.perf_counter() - start < 5
    receiver.close()


def test_the_local_address_follows_the_route_to_the_master_or_the_override(monkeypatch):
    monkeypatch.delenv("AQPIPE_LINK_ADDR", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert s.local_address() == "127.0.0.1"
    monkeypatch.setenv("AQPIPE_LINK_ADDR", "10.1.2.3")
    assert s.local_address() == "10.1.2.3"
