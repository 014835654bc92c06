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
