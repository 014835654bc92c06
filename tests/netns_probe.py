"""Run by test_netns inside two namespaces: rank 0 sends messages through aqpipe's transport, rank 1 receives
them and prints one JSON line: body bytes, the transport's measured time on the wire, and the wall time."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from aqpipe.runtime.transport import KIND_ACTIVATION, Expect, Header, Inbox, Outbox


def main(message_bytes: int, count: int) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    payload = torch.zeros(message_bytes, dtype=torch.uint8)
    ids = torch.arange(1)
    dist.barrier()
    if rank == 0:
        box = Outbox(peer_rank=1, tag=7)
        for i in range(count):
            box.send(Header(KIND_ACTIVATION, 0, i, (message_bytes,), torch.uint8, 1, message_bytes), ids, payload)
        box.flush()
    else:
        inbox = Inbox(0, "rank 0", 7, torch.device("cpu"), timeout=120)
        start = time.perf_counter()
        moved, wire = 0, 0.0
        for i in range(count):
            inbox.expect(Expect(KIND_ACTIVATION, 0, i, 1))
            msg = inbox.get()
            moved, wire = moved + msg.wire_bytes, wire + msg.transfer_seconds
        print(json.dumps({"bytes": moved, "wire_seconds": wire, "wall_seconds": time.perf_counter() - start}))
        inbox.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
