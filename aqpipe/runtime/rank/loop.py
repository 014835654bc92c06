"""The step loop of one rank: prefetch m(ξ), run the worker's step, record, evaluate and checkpoint."""

from __future__ import annotations

import time

import torch

from aqpipe.metrics import MetricsLog
from aqpipe.pipeline.execution.evaluate import eval_batches, evaluate_stage, gather_eval, held_out_samples
from aqpipe.pipeline.world import comm
from aqpipe.runtime.checkpoints.parts import complete_steps
from aqpipe.runtime.checkpoints.resume import collect_state
from aqpipe.runtime.checkpoints.store import RUN_LOG, run_log
from aqpipe.runtime.events import emit, progress
from aqpipe.runtime.outputs.console import print_eval, print_progress
from aqpipe.runtime.outputs.step_record import step_record
from aqpipe.runtime.rank.assemble import RankStage
from aqpipe.runtime.rank.replicas import check_replicas
from aqpipe.storage.prefetch import PrefetchingStore


def evaluate(stage: RankStage, step: int) -> dict:
    """One pass over the held-out split (all ranks); on rank 0 its numbers as `eval_*` record fields."""
    plan, grid = stage.plan, stage.grid
    cfg, ends = plan.cfg, grid.is_first_stage or grid.is_last_stage
    batches = eval_batches(held_out_samples(len(plan.dataset.valid), cfg.eval_samples), grid.replica, cfg.dp,
                           cfg.micro_batch_size)
    # the pass's progress as its last stage sees it (replica 0's: one report among the replicas)
    reporting = grid.is_last_stage and grid.replica == 0
    totals = evaluate_stage(stage.worker, step, batches, plan.dataset.valid if ends else None, plan.dataset.num_labels,
                            (lambda done, total: progress("held-out pass", done, total, "batches")) if reporting else None)
    result = gather_eval(totals, grid, plan.dataset.num_labels, stage.device)
    if result is None:
        return {}
    emit({"event": "eval", "step": step, "loss": result["loss"], "accuracy": result.get("accuracy")})
    print_eval(step, result)
    return {f"eval_{k}": v for k, v in result.items()}


def checkpoint(stage: RankStage, step: int, log: MetricsLog | None) -> None:
    """Every rank writes its state after `step` steps, once the replicas of its stage agree on their parameters (rank
    0's with the run's log); the checkpoints' store marks it complete and copies it to other hosts."""
    if isinstance(stage.store, PrefetchingStore):  # (on disk: from here on it keeps what this checkpoint holds)
        stage.store.checkpointed(step, {step, *complete_steps(stage.plan.cfg.out)})
    check_replicas(stage.worker.module, stage.grid, step, stage.device, stage.worker.row_cache_names)

    def state() -> dict:
        state = collect_state(stage.worker, stage.store)
        if log is not None:
            state[RUN_LOG] = run_log(stage.plan.cfg.out, log.records)
        return state

    assert stage.checkpoints is not None, "a rank that trains has its checkpoints' store"
    stage.checkpoints.save(step, state, last=step == stage.plan.total_steps)


def prefetch(stage: RankStage, step: int, first_step: int) -> None:
    """Read ahead the m(ξ) this rank will need: this step's (on the first step only) and the next step's, on each
    side of m(ξ) this rank owns."""
    store, plan = stage.store, stage.plan
    if not isinstance(store, PrefetchingStore):
        return
    epochs = plan.epoch_plan(stage.grid.replica)
    for ahead in ([step, step + 1] if step == first_step else [step + 1]):
        if ahead < plan.total_steps:
            ids = torch.cat(epochs.micro_batches_of(ahead)).tolist()
            for link, side in stage.grid.owned_sides():
                store.prefetch(link, side, ids)


def train_steps(stage: RankStage, first_step: int, log: MetricsLog | None, wall_start: float) -> dict[str, int]:
    """Run steps `first_step`… to the plan's end on this rank; rank 0 (the one with `log`) records them. Returns the
    traffic counts at the last record: what this rank sends after it (the last checkpoint's control bytes and
    copies) no record holds."""
    plan, grid, worker, store = stage.plan, stage.grid, stage.worker, stage.store
    cfg = plan.cfg
    epochs = plan.epoch_plan(grid.replica)
    evaluating = len(plan.dataset.valid) > 0 and cfg.eval_every != 0
    mark = comm.TRAFFIC.snapshot()  # control traffic since the last record (checkpoints', metrics' gathers…)
    for step in range(first_step, plan.total_steps):
        step_start = time.perf_counter()
        lr = float(worker.lr_schedule.get_last_lr()[0])
        store.step = step
        prefetch(stage, step, first_step)
        done = step + 1  # also the index of the next step
        next_ids = (torch.cat(epochs.micro_batches_of(done)).tolist()
                    if done < plan.total_steps and plan.compresses(done) else None)
        stats = worker.run_step(step, epochs.micro_batches_of(step), compress=plan.compresses(step),
                                next_ids=next_ids)
        stats.control_bytes += comm.TRAFFIC.sent[comm.CONTROL] - mark[comm.CONTROL]
        copied = comm.TRAFFIC.sent[comm.CHECKPOINT]  # (sent in the background: what this record holds, and no more)
        stats.checkpoint_bytes = copied - mark[comm.CHECKPOINT]
        if stage.checkpoints is not None:
            stage.checkpoints.observe(stats)
        counts = store.stats
        stats.store_hits, stats.store_misses, stats.store_reseeded, stats.store_overflow = (
            counts.hits, counts.misses, counts.reseeded, counts.overflow)
        record = step_record(stats, grid, cfg, step, plan.steps_per_epoch, lr, time.perf_counter() - step_start,
                             stage.device)
        mark = {**comm.TRAFFIC.snapshot(), comm.CHECKPOINT: copied}  # the record counts its own gather
        if evaluating and (done == plan.total_steps or (cfg.eval_every and done % cfg.eval_every == 0)):
            record.update(evaluate(stage, done))
        if log is not None:
            record["elapsed_seconds"] = time.perf_counter() - wall_start
            log.log(record)
            emit({"event": "step", "step": done, "total_steps": plan.total_steps, "loss": record["loss"],
                  "samples_per_second": record["samples_per_second"]})
            print_progress(record, plan.total_steps)
        if done == plan.total_steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
            checkpoint(stage, done, log)
    return mark
