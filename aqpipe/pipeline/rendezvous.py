"""How the ranks of a run find each other: the rendezvous store of a single-machine launch."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

# Set by `aqpipe launch` when every rank runs on this machine's loopback: the rendezvous binds to 127.0.0.1 only.
LOOPBACK_ENV = "AQPIPE_LOOPBACK"


def loopback_rendezvous(rank: int, world_size: int, timeout: timedelta):
    """The rendezvous store of a single-machine launch, listening on 127.0.0.1 only (torch's own listens on every
    interface); None when this launch spans hosts or network namespaces (torch's env:// rendezvous then)."""
    if os.environ.get(LOOPBACK_ENV) != "1":
        return None
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout, master_listen_fd=listener.fileno())
    listener.detach()  # the store's server owns the socket now
    return store


def pin_gloo_interface() -> str | None:
    """Across hosts, make gloo listen on the interface that reaches MASTER_ADDR: by default gloo advertises the
    address this host's name resolves to, which on many machines (and in network namespaces) is 127.0.0.1, and the
    other hosts then cannot connect. Sets GLOO_SOCKET_IFNAME unless the user set it or the run is on loopback;
    returns the interface chosen (None: left alone)."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get(LOOPBACK_ENV) == "1":
        return None
    from aqpipe.pipeline.streams import StreamError, local_address

    try:
        address = local_address()
    except StreamError:
        return None
    if address.startswith("127."):
        return None
    name = interface_of(address)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 `address` (None: none does)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None
