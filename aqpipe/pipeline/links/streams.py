"""TCP byte streams for the pipeline links: one connection per direction of each link, opened at assembly.

Why not torch.distributed's point-to-point sends: gloo hands a message over only once the receiver has posted a
buffer of its exact size, and a message's body size is known only after its header arrived, so every message
waits for a notice travelling back from the receiver. Under 1F1B that reverse path carries the other direction's
bulk data, and the notice queues behind it: 8 messages of 256 KiB each way between two namespaces shaped to
30 Mbit/s took 0.80-0.89 s with both directions busy against 0.59 s one way (and over a WAN every message would
also pay the network's round trip). On a stream the sender writes and the kernel sends; nothing waits for the
receiver but TCP's own window. Each stream carries one direction, so its socket is written by one thread on the
sender (the outbox's) and read by one thread on the receiver (the inbox's).

Rendezvous: every receiving end listens on an ephemeral port of the address this rank reaches the master from;
the pipeline group gathers the endpoints; every sending end connects and introduces itself with the stream's
name, which the receiver checks and acknowledges.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import termios
import time

HELLO = struct.Struct("<4s64s")
HELLO_MAGIC = b"AQS1"
ACK = b"\x01"  # the receiver's answer to the right hello: the sender knows it reached its stream
HELLO_TIMEOUT = 10.0


class StreamError(RuntimeError):
    """A stream could not be opened, or its peer is not who it should be."""


def local_address() -> str:
    """The address peers reach this rank at: the source address of the route to MASTER_ADDR (127.0.0.1 without
    one), overridden by AQPIPE_LINK_ADDR."""
    if os.environ.get("AQPIPE_LINK_ADDR"):
        return os.environ["AQPIPE_LINK_ADDR"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # UDP: no packet is sent
            return probe.getsockname()[0]
        except OSError as e:
            if master in ("127.0.0.1", "localhost"):
                return "127.0.0.1"
            raise StreamError(f"no route to MASTER_ADDR {master} to advertise the link streams on ({e}); set "
                              "AQPIPE_LINK_ADDR to this host's address") from None


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a header must not wait for the next message
    return sock


def _hello(name: str) -> bytes:
    encoded = name.encode()
    if len(encoded) > 64:
        raise ValueError(f"stream name {name!r} is longer than 64 bytes")
    return HELLO.pack(HELLO_MAGIC, encoded)


def read_exactly(sock: socket.socket, buffer: memoryview) -> None:
    """Fill `buffer` from the stream; EOFError if the peer closes it first."""
    got = 0
    while got < len(buffer):
        n = sock.recv_into(buffer[got:])
        if n == 0:
            raise EOFError
        got += n


def queued_bytes(sock: socket.socket) -> int:
    """Bytes the kernel has received on the stream and holds for the next read (0 where it cannot say)."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):
        return 0


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    try:
        read_exactly(sock, memoryview(data))
    except EOFError:
        raise StreamError("the peer closed the connection during the handshake") from None
    return bytes(data)


class Listener:
    """The receiving end of a stream before its sender connects."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((address, 0))
        self.sock.listen(4)
        self.endpoint: tuple[str, int] = self.sock.getsockname()

    def accept(self, name: str, timeout: float) -> socket.socket:
        """The connection of the sender that introduces itself as `name`; others are turned away."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, peer = self.sock.accept()
                except TimeoutError:
                    raise StreamError(f"no sender connected to stream {name} within {timeout:.0f} s") from None
                # a stray connection that says nothing must not hold the real sender in the backlog for long
                conn.settimeout(min(HELLO_TIMEOUT, max(0.01, deadline - time.monotonic())))
                try:
                    magic, raw = HELLO.unpack(_read_exact(conn, HELLO.size))
                except (OSError, StreamError):
                    conn.close()
                    continue
                if magic == HELLO_MAGIC and raw.rstrip(b"\0").decode(errors="replace") == name:
                    conn.sendall(ACK)
                    conn.settimeout(None)
                    return _tune(conn)
                conn.close()  # a stray or mistaken connection: not this stream's sender
        finally:
            self.sock.close()


def connect(endpoint: tuple[str, int], name: str, timeout: float) -> socket.socket:
    """Connect to the receiving end of stream `name` and introduce ourselves; `confirm` then waits for the answer
    (after this rank has accepted its own inbound streams: two ranks may be connecting to each other)."""
    hello = _hello(name)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(endpoint, timeout=max(0.01, deadline - time.monotonic()))
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise StreamError(f"cannot connect stream {name} to {endpoint[0]}:{endpoint[1]}: {e}") from None
            time.sleep(0.05)
    sock.sendall(hello)  # 68 bytes: the kernel takes them whether or not the peer accepts yet
    return sock


def confirm(sock: socket.socket, name: str, timeout: float) -> socket.socket:
    """Wait for the receiver to acknowledge our hello: only then do we know we reached stream `name`."""
    endpoint = sock.getpeername()
    try:
        sock.settimeout(timeout)
        if _read_exact(sock, len(ACK)) != ACK:
            raise StreamError("answered with something else")
    except (OSError, StreamError) as e:  # a listener of another stream, or not aqpipe at all
        sock.close()
        raise StreamError(f"{endpoint[0]}:{endpoint[1]} did not accept stream {name}: {e}") from None
    sock.settimeout(None)
    return _tune(sock)


def open_streams(inbound: list[str], outbound: list[str], group, timeout: float) -> dict[str, socket.socket]:
    """Open this rank's streams: listen for each name in `inbound`, connect each name in `outbound`. Every rank of
    `group` must call this together (the endpoints are gathered over it); each name must be inbound on exactly one
    rank of the group and outbound on exactly one. A rank that cannot listen fails every rank alike."""
    import torch.distributed as dist

    from aqpipe.pipeline.world import comm

    listeners: dict[str, Listener] = {}
    streams: dict[str, socket.socket] = {}
    try:
        # (a rank that cannot listen still takes part in the gather, so that the group's collectives stay in step)
        try:
            address = local_address()
            for name in inbound:
                listeners[name] = Listener(address)
            mine: tuple[str, dict] = ("", {name: listener.endpoint for name, listener in listeners.items()})
        except (OSError, StreamError) as e:
            mine = (f"rank {dist.get_rank()} cannot listen for its streams: {e}", {})
        everyone: list[tuple[str, dict] | None] = [None] * dist.get_world_size(group)
        comm.all_gather_object(everyone, mine, comm.SETUP, group=group)
        failed = [why for why, _ in filter(None, everyone) if why]
        if failed:
            raise StreamError(failed[0])
        endpoints = {name: endpoint for _, table in filter(None, everyone) for name, endpoint in table.items()}
        for name in outbound:  # the peer's listen backlog holds our connection until it accepts
            if name not in endpoints:
                raise StreamError(f"no rank listens for stream {name}")
            streams[name] = connect(tuple(endpoints[name]), name, timeout)
        for name, listener in listeners.items():
            streams[name] = listener.accept(name, timeout)
        for name in outbound:
            streams[name] = confirm(streams[name], name, timeout)
        return streams
    except BaseException:
        for stream in streams.values():
            stream.close()
        raise
    finally:
        for listener in listeners.values():
            listener.sock.close()
