"""Run a function on several gloo ranks in fresh processes, for multi-process tests."""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, results) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        results[rank] = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results[rank] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args):
    """Call fn(rank, world, *args) on `world` gloo ranks; returns each rank's ("ok", value) or ("error", text)."""
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_entry, args=(world, _free_port(), fn, args, results), nprocs=world, start_method="spawn")
    return [results.get(r) for r in range(world)]


def record_unbatched_point_to_point() -> list[str]:
    """From now on in this process, note every send/recv/isend/irecv made outside `dist.batch_isend_irecv`; returns
    the (live) list of their names. NCCL deadlocks on such unpaired calls where gloo does not, so a gloo test can
    only catch them this way."""
    import threading

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    unbatched: list[str] = []
    inside = threading.local()
    batch = c10d.batch_isend_irecv

    def batched(ops):
        inside.on = True
        try:
            return batch(ops)
        finally:
            inside.on = False

    for name in ("send", "recv", "isend", "irecv"):
        def spy(*args, _original=getattr(c10d, name), _name=name, **kwargs):
            if not getattr(inside, "on", False):
                unbatched.append(_name)
            return _original(*args, **kwargs)

        # both names: P2POp checks its op against c10d's own isend/irecv
        setattr(c10d, name, spy)
        setattr(dist, name, spy)
    dist.batch_isend_irecv = c10d.batch_isend_irecv = batched
    return unbatched
