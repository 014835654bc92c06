"""One rank's whole run: join the process group, assemble the stage, train, and (rank 0) write the run directory."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from aqpipe.config import ConfigError, ResolvedConfig
from aqpipe.pipeline.links.rendezvous import (
    HOST_LOCAL_SETTINGS,
    HostDisagreement,
    RendezvousConflict,
    agree,
    begin_training,
    collective_backend,
    gpu_identity,
    pin_socket_interface,
    rendezvous_store,
    replica_gpu_facts,
    startup_timeout,
)
from aqpipe.pipeline.links.tied_rows import LOOKUP, OWNER
from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import Grid, host_leader, local_rank, local_world_size, rank_device
from aqpipe.runtime.checkpoints.resume import resume_rank, starting_point
from aqpipe.runtime.checkpoints.store import RUN_LOG, Checkpoints
from aqpipe.runtime.events import emit, start_heartbeat
from aqpipe.runtime.outputs.final_weights import FinalWeights, gather_final_weights, save_stage_weights
from aqpipe.runtime.outputs.run_dir import finish_outputs, open_outputs, unrecorded_traffic, write_config
from aqpipe.runtime.plan import RunPlan, make_plan, resolve_bounds
from aqpipe.runtime.rank.assemble import RankStage, assemble_stage
from aqpipe.runtime.rank.loop import train_steps
from aqpipe.runtime.rank.replicas import check_replicas
from aqpipe.storage.health import drop_if_damaged
from aqpipe.storage.lmdb_store import store_path
from aqpipe.storage.memory import in_memory


def run_worker(cfg: ResolvedConfig, rank: int, world_size: int, spec_factory=None, launcher_checked: bool = False
               ) -> dict | None:
    """Train this rank's stage for the whole run; returns the summary on rank 0 (None elsewhere). `launcher_checked`:
    `aqpipe launch` started this rank after checking the run's LMDB stores and every rank's file of its newest
    checkpoint; without it (torchrun, DeepSpeed) each rank checks its own, on its own host."""
    if world_size != cfg.world_size:
        raise ConfigError(f"the launcher started {world_size} processes but --pp {cfg.pp} x --dp {cfg.dp} needs "
                          f"{cfg.world_size}")
    grid = Grid(cfg.pp, cfg.dp, rank)
    start_heartbeat()
    local_world = local_world_size(world_size)
    device = rank_device(cfg.device, local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(rank_threads(os.environ.get("OMP_NUM_THREADS", ""), os.cpu_count() or 1, local_world))
    torch.manual_seed(cfg.seed)

    timeout = startup_timeout(cfg.stall_timeout)
    try:
        store = rendezvous_store(rank, world_size, timeout)
    except RendezvousConflict as e:
        raise ConfigError(str(e)) from None
    backend = collective_backend(store, rank, world_size, gpu_identity(device))
    pin_socket_interface(backend)
    try:
        agree(store, rank, world_size, {
            "device": device.type, "backend": backend, "world": [cfg.pp, cfg.dp, world_size],
            "config": {k: v for k, v in cfg.to_dict().items() if k not in HOST_LOCAL_SETTINGS},
            **replica_gpu_facts(cfg.grad_spec, cfg.dp, device)})
    except HostDisagreement as e:
        raise ConfigError(str(e)) from None
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
    try:
        plan = make_plan(cfg, spec_factory, profile=False)
        if not plan.bounds:  # a time partition nobody resolved yet: rank 0 profiles, everyone takes its answer
            box = [resolve_bounds(cfg, plan.spec, plan.dataset) if rank == 0 else None]
            comm.broadcast_object_list(box, comm.SETUP, src=0)
            bounds = box[0]
            assert bounds is not None, "rank 0 resolves the time partition"
            plan.bounds = bounds
        # what config.json records and checkpoints are checked against, as in a run `aqpipe launch` starts (under
        # torchrun nothing set it before)
        cfg.stage_bounds = plan.bounds
        summary = _train(plan, grid, device, backend, launcher_checked, store)
    except BaseException:
        comm.leave_process_groups(failed=True)
        raise
    finally:
        gc.unfreeze()  # (what `_train` froze: a process that goes on, the Python API's script, collects it again)
    comm.leave_process_groups(failed=False)
    return summary


def rank_threads(omp_num_threads: str, cores: int, local_world: int) -> int:
    """A rank's torch threads: OMP_NUM_THREADS where it is set to a positive count (torchrun sets 1 with several
    processes per node), as torch reads it; else the host's cores shared among its ranks, at least one."""
    if omp_num_threads.isdigit() and int(omp_num_threads) > 0:
        return int(omp_num_threads)
    return max(1, cores // local_world)


def _train(plan: RunPlan, grid: Grid, device: torch.device, backend: str, launcher_checked: bool, store
           ) -> dict | None:
    """Assemble, resume and train this rank's stage, then finish the run's outputs; `store`: the rendezvous store."""
    cfg = plan.cfg
    # (first: where copies go to other hosts, their process starts while the stage loads)
    checkpoints = Checkpoints(cfg, grid)
    resumed = starting_point(cfg, grid.rank, launcher_checked)
    if resumed is not None and cfg.store == "lmdb" and not launcher_checked:
        drop_if_damaged(store_path(cfg.out, grid.rank), grid.rank)
    stage = assemble_stage(plan, grid, device, backend)
    stage.checkpoints = checkpoints
    try:
        first_step = resume_rank(cfg, stage.worker, stage.store, *resumed) if resumed is not None else 0
        if first_step:
            checkpoints.resumed(first_step)
        log = (open_outputs(cfg, plan, first_step, resumed[1].get(RUN_LOG) if resumed is not None else None)
               if grid.rank == 0 else None)
        if log is None and host_leader():  # another host's copy, for a resume there
            write_config(cfg, plan)
        # What is loaded by now (modules, the stage, its optimizer and links) lasts the run: no collection walks it
        # until the run ends (run_worker unfreezes it). What planning and loading left as cycles goes first.
        gc.collect()
        gc.freeze()
        begin_training(store, stage.groups, cfg.stall_timeout)
        emit({"event": "start", "total_steps": plan.total_steps, "rank": grid.rank, "first_step": first_step})
        wall_start = time.perf_counter() - (log.records[-1]["elapsed_seconds"] if log is not None and log.records else 0.0)
        unrecorded_since = train_steps(stage, first_step, log, wall_start)
    except BaseException:
        stage.worker.links.close(abort=True)
        raise
    stage.worker.links.close()
    if first_step >= stage.plan.total_steps:  # no step ran, so no checkpoint compared the replicas
        check_replicas(stage.worker.module, grid, stage.plan.total_steps, stage.device, stage.worker.row_cache_names)
    # before the final weights travel: over a slow link rank 0 may take longer than the time-out to receive them,
    # and no rank may wait for it in a collective meanwhile (a rank that sends none leaves at once)
    checkpoints.finish()  # (the last checkpoint's copies kept: the run may end)
    unrecorded = unrecorded_traffic(unrecorded_since, grid, device)
    final = _finish_rank(stage)
    comm.finish_queued(device)
    if log is None:
        return None
    summary = finish_outputs(plan, log, time.perf_counter() - wall_start, final, unrecorded)
    emit({"event": "done", "summary": summary})
    return summary


def _finish_rank(stage: RankStage) -> FinalWeights | None:
    """Every rank at the end: final weights written (replica 0) on this rank's host and gathered on rank 0 for the
    export, the store closed or dumped; returns what rank 0 gathered (None elsewhere)."""
    cfg, grid = stage.plan.cfg, stage.grid
    rows = stage.worker.links.tied_rows
    # hosts need not share a disk; and the first stage's tied table is whole once it has the head's
    final = gather_final_weights(stage.worker.module, grid, stage.plan, stage.device,
                                 tied_head=rows.name if rows is not None and rows.role == OWNER else None,
                                 row_cache=rows.table if rows is not None and rows.role == LOOKUP else None)
    if grid.replica == 0:
        save_stage_weights(stage.worker.module, Path(cfg.out), grid.stage, adapters=cfg.export_adapter)
    if cfg.store == "lmdb":
        stage.store.close()
    elif cfg.store_dump == "on" and in_memory(stage.store):
        (Path(cfg.out) / "store").mkdir(parents=True, exist_ok=True)
        stage.store.dump(Path(cfg.out) / "store" / f"rank-{grid.rank}.pt")
    return final
