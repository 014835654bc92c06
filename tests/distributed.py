"""Run a function on several gloo ranks, for multi-process tests: processes forked from a server that has imported
torch (multiprocessing's forkserver, started once per test process), so a test pays no import per rank."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from pathlib import Path

import torch.multiprocessing as mp

# What the ranks of these tests import, the models' transformers code and peft included (5-9 s of CPU each on these
# machines); the forkserver imports it once, and each rank is a fork of it.
PRELOAD = ["torch", "torch.distributed", "aqpipe.pipeline.execution.worker", "aqpipe.compress.grad.methods",
           "aqpipe.runtime.rank.assemble", "aqpipe.runtime.plan", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.llama.modeling_llama", "transformers.models.bert.modeling_bert", "peft",
           "tests.distributed"]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def _entry(rank: int, world: int, port: int, fn, args, results: str) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout)  # the test process's (`run_ranks`)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    if result[0] == "ok":
        _settle()
    (Path(results) / f"rank-{rank}.pkl").write_bytes(pickle.dumps(result))
    # No teardown: the last collectives' callbacks (torch's PowerSGD hook chains them) end on gloo's own threads,
    # and a group whose last reference dies there is destroyed there — a thread joining itself, which aborted a rank
    # once in a full run ("Resource deadlock avoided", SIGABRT). The process ends here, its sockets with it.
    os._exit(0)


def _settle() -> None:
    """Meet the other ranks, so that none ends while another still talks to it."""
    import datetime

    import torch.distributed as dist

    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    except RuntimeError:  # another rank failed: the test reports it
        pass


def run_ranks(fn, world: int, *args):
    """Call fn(rank, world, *args) on `world` gloo ranks; returns each rank's ("ok", value) or ("error", text)
    (None for a rank that ended without a result)."""
    import datetime

    import torch.distributed as dist

    # The rendezvous store is served from this process on a port the kernel picks as it binds: a port probed free
    # and bound later by rank 0 was taken in between by another test process once (EADDRINUSE failed a CI run).
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="aqpipe-ranks-") as results:
        mp.start_processes(_entry, args=(world, store.port, fn, args, results), nprocs=world, start_method="forkserver")
        files = [Path(results) / f"rank-{r}.pkl" for r in range(world)]
        return [pickle.loads(f.read_bytes()) if f.exists() else None for f in files]


def run_forked(target, args_per_process: list[tuple], timeout: float) -> None:
    """Call target(*args) in a process of its own for each args of `args_per_process`, each forked from the warm
    server `run_ranks` uses (no process group made for them), and wait for all; fails naming those still running
    after `timeout` seconds (killed)."""
    procs = [_CONTEXT.Process(target=target, args=args) for args in args_per_process]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout)
    hung = [proc.pid for proc in procs if proc.is_alive()]
    for proc in procs:
        proc.kill()
    assert not hung, f"processes {hung} still running after {timeout} s"


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

    def spying(name: str, original):
        def spy(*args, **kwargs):
            if not getattr(inside, "on", False):
                unbatched.append(name)
            return original(*args, **kwargs)
        return spy

    for name in ("send", "recv", "isend", "irecv"):
        spy = spying(name, getattr(c10d, name))
        setattr(c10d, name, spy)  # both names: P2POp checks its op against c10d's own isend/irecv
        setattr(dist, name, spy)
    dist.batch_isend_irecv = c10d.batch_isend_irecv = batched
    return unbatched


def worker_step(grid, module, method: str, lr: float = 1.0, clip: float = 0.0, tied=(), before_sync=None):
    """On a rank inside `run_ranks`: a StageWorker of `grid` with no links and the `method` grad sync (plain SGD at
    `lr`, no momentum) runs its grad reduction and optimizer step on the gradients already set on `module`.
    `before_sync(params)`, when given, sees what the sync is handed."""
    import torch

    from aqpipe.compress.grad import DPGroup, build_grad_sync
    from aqpipe.pipeline.execution.worker import StageWorker, StepStats
    from aqpipe.pipeline.links.link_ends import StageLinks
    from aqpipe.pipeline.numerics.optim import build_optimizer
    from aqpipe.pipeline.world.grid import create_groups

    groups = create_groups(grid)
    sync = build_grad_sync(method, DPGroup(groups.data_parallel, tuple(grid.dp_ranks(grid.stage)), grid.rank), seed=3)
    if before_sync is not None:
        synchronize = sync.synchronize
        sync.synchronize = lambda params: (before_sync(params), synchronize(params))
    optimizer, schedule = build_optimizer(module.parameters(), "sgd", lr, 0.0, 0, 10, momentum=0.0)
    worker = StageWorker(grid=grid, groups=groups, module=module, loss_fn=None, samples=None, links=StageLinks(),
                         grad_sync=sync, optimizer=optimizer, lr_schedule=schedule, clip=clip,
                         device=torch.device("cpu"), schedule="gpipe", tied=list(tied))
    stats = StepStats()
    worker.optimizer_phase.run(0, stats)
    return stats
