"""The step loop's checkpoint (runtime/rank/loop.py): what every rank does around writing its part."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.distributed import run_ranks

STALL = 1.5  # seconds: the collectives' time-out once training has begun (--stall-timeout)
SLOW_WRITE = 5.0  # seconds rank 1 takes to write its part: far longer than a step may take


def _checkpoint_with_one_slow_writer(rank: int, world: int, out: str) -> str:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from aqpipe.config import RunConfig
    from aqpipe.pipeline.world.grid import Grid, create_groups
    from aqpipe.runtime.checkpoints import store
    from aqpipe.runtime.rank import loop

    groups = create_groups(Grid(world, 1, rank))
    for group in (distributed_c10d._get_default_group(), groups.pipeline, groups.data_parallel):
        distributed_c10d._set_pg_timeout(timedelta(seconds=STALL), group)  # as begin_training leaves them
    loop.check_replicas = lambda *args, **kwargs: None
    loop.collect_state = lambda worker, store: {"rank": rank}
    store.save_rank = lambda out, step, rank, state, settings, progress: time.sleep(SLOW_WRITE if rank == 1 else 0.0)
    store.mark_complete = lambda *args, **kwargs: None
    cfg = SimpleNamespace(out=out, stall_timeout=STALL, fixed_settings=lambda: {}, checkpoint_replicas=None,
                          checkpoint_share=RunConfig.checkpoint_share)
    grid = Grid(world, 1, rank)
    stage = SimpleNamespace(plan=SimpleNamespace(cfg=cfg, total_steps=8), grid=grid, groups=groups, store=None,
                            worker=SimpleNamespace(module=None, row_cache_names=frozenset()), device=torch.device("cpu"),
                            checkpoints=store.Checkpoints(cfg, grid))  # (one host: no copies)
    loop.checkpoint(stage, 4, None)
    # once everyone has written, a step's collectives time out after --stall-timeout again
    if rank == 1:
        time.sleep(SLOW_WRITE)
        return "waited"
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as e:
        return "timed out" if "Timed out" in str(e) else f"failed otherwise: {e}"
    return "joined"


def test_the_ranks_wait_for_one_writing_its_checkpoint_far_longer_than_a_step_may_take(tmp_path):
    """A rank whose state is large (an in-memory m(ξ) store, Adam's moments) on a slow disk writes its part for
    minutes: the others must wait for it at the barrier that follows, not fail after --stall-timeout (on NCCL its
    watchdog would abort them); once past it, --stall-timeout holds again."""
    results = run_ranks(_checkpoint_with_one_slow_writer, 2, str(tmp_path))
    assert results == [("ok", "timed out"), ("ok", "waited")], results
