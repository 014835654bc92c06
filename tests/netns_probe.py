"""Run by test_netns inside two namespaces: rank 0 sends messages through aqpipe's transport to rank 1 (in
`duplex` mode both ranks send and receive at once), and rank 1 prints one JSON line: body bytes it received, those
that arrived while the transport timed them, that time on the wire, and the wall time."""

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from aqpipe.pipeline.links.streams import open_streams
from aqpipe.pipeline.links.transport import HEADER_SIZE, KIND_ACTIVATION, Expect, Header, Inbox, Outbox


def send(box: Outbox, message_bytes: int, count: int) -> None:
    payload, ids = torch.zeros(message_bytes, dtype=torch.uint8), torch.arange(1)
    for i in range(count):
        box.send(Header(KIND_ACTIVATION, 0, i, (message_bytes,), torch.uint8, 1, message_bytes), ids, payload)
    box.flush()


def receive(inbox: Inbox, count: int) -> tuple[int, int, float]:
    moved = arrived = 0
    wire = 0.0
    for i in range(count):
        inbox.expect(Expect(KIND_ACTIVATION, 0, i, 1))
        msg = inbox.get()
        moved, arrived, wire = moved + msg.wire_bytes - HEADER_SIZE, arrived + msg.arrived_bytes, wire + msg.transfer_seconds
    return moved, arrived, wire


def main(message_bytes: int, count: int, duplex: bool) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    inbound = ["0 to 1"] if rank == 1 else (["1 to 0"] if duplex else [])
    outbound = ["0 to 1"] if rank == 0 else (["1 to 0"] if duplex else [])
    streams = open_streams(inbound, outbound, None, 60)
    box = Outbox(streams[outbound[0]], "peer", timeout=120) if outbound else None
    inbox = Inbox(streams[inbound[0]], "peer", timeout=120) if inbound else None
    dist.barrier()
    start = time.perf_counter()
    sender = threading.Thread(target=send, args=(box, message_bytes, count)) if box else None
    if sender:
        sender.start()
    if inbox:
        moved, arrived, wire = receive(inbox, count)
    if sender:
        sender.join()
    if rank == 1:
        print(json.dumps({"bytes": moved, "arrived_bytes": arrived, "wire_seconds": wire,
                          "wall_seconds": time.perf_counter() - start}))
    dist.barrier()
    for end in (box, inbox):
        if end is not None:
            end.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "duplex")
