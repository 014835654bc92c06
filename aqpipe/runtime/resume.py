"""What one rank puts in a checkpoint and how it takes it back: model, optimizer, LR schedule, RNG, codecs,
grad-sync (error feedback) and, for an in-memory store, m(ξ) itself; and resuming a rank from the last checkpoint."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from aqpipe.config import ResolvedConfig
from aqpipe.pipeline import comm
from aqpipe.pipeline.optim import continue_schedule
from aqpipe.pipeline.worker import StageWorker
from aqpipe.runtime.checkpoint import (
    CheckpointError,
    check_model_state,
    check_rank,
    complete_steps,
    latest_step,
    load_rank,
    rank_file,
    step_dir,
)
from aqpipe.runtime.events import emit
from aqpipe.runtime.reconcile import reconcile
from aqpipe.stages.lora import checkpointed_names, training_state
from aqpipe.storage.memory import in_memory


def collect_state(worker: StageWorker, store) -> dict:
    """Everything this rank needs to continue exactly from the end of the current step."""
    state = {
        "model": training_state(worker.module),
        "optimizer": worker.optimizer.state_dict(),
        "lr_schedule": worker.lr_schedule.state_dict(),
        "grad_sync": worker.grad_sync.state_dict(),
        "codecs": {slot: codec.state_dict() for slot, codec in worker.links.codecs().items()},
        "rng": {"torch": torch.get_rng_state()},
        "store_stats": store.stats.as_dict(),
    }
    if torch.cuda.is_available() and worker.device.type == "cuda":
        state["rng"]["cuda"] = torch.cuda.get_rng_state(worker.device)
    if in_memory(store):
        state["store"] = store.entries()
    if worker.scaler is not None:
        state["loss_scaler"] = worker.scaler.state_dict()
    return state


def to_device(tree, device: torch.device):
    """Every tensor of a nested dict/list moved to `device` (anything else as it is)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(v, device) for v in tree)
    return tree


def apply_state(state: dict, worker: StageWorker, store, where: str) -> None:
    """Restore `collect_state`'s output; checks the model part fully before changing anything."""
    for key in ("model", "optimizer", "lr_schedule", "grad_sync", "codecs", "rng", "store_stats"):
        if key not in state:
            raise CheckpointError(f"checkpoint {where} lacks its {key!r} part")
    check_model_state(where, worker.module, state["model"], checkpointed_names(worker.module))
    if in_memory(store) and "store" not in state:
        raise CheckpointError(f"checkpoint {where} has no m(xi) store, but this run keeps it in memory")
    worker.module.load_state_dict(state["model"], strict=checkpointed_names(worker.module) is None)
    try:
        worker.optimizer.load_state_dict(state["optimizer"])
        worker.lr_schedule.load_state_dict(state["lr_schedule"])
        continue_schedule(worker.lr_schedule, worker.optimizer)
        # error feedback, compensation and momentum live where the grad sync computes (its collectives' device);
        # the checkpoint was read onto the host
        worker.grad_sync.load_state_dict(to_device(state["grad_sync"], worker.grad_sync.dp.device))
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"checkpoint {where} does not fit this run's optimizer or grad sync: {e}") from None
    codecs = worker.links.codecs()
    for slot, codec_state in state["codecs"].items():
        if slot in codecs:
            codecs[slot].load_state_dict(codec_state)
    if worker.scaler is not None and "loss_scaler" in state:
        worker.scaler.load_state_dict(state["loss_scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and worker.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], worker.device)
    if in_memory(store):
        store.load(state["store"])
    for name, value in state["store_stats"].items():
        setattr(store.stats, name, int(value))


def resume_rank(cfg: ResolvedConfig, worker: StageWorker, store, launcher_checked: bool = False) -> int:
    """Load this rank's part of the run's last checkpoint and make every link's two m(ξ) copies agree; returns
    the step to continue from. Every rank calls it (reconciliation is collective). `launcher_checked`: as for
    `load_agreed`."""
    run = cfg.resume
    if run is None:
        raise CheckpointError("not a resumed run: there is no checkpoint to resume from")
    step, state = load_agreed(run, worker.grid.rank, cfg.fixed_settings(), launcher_checked)
    apply_state(state, worker, store, describe(run, step, worker.grid.rank))
    reseeded = reconcile(store, worker.grid, worker.groups.pipeline)
    store.stats.reseeded += reseeded
    emit({"event": "resumed", "step": step, "rank": worker.grid.rank, "reseeded": reseeded})
    return step


def load_agreed(run: str | Path, rank: int, settings: dict, launcher_checked: bool = False) -> tuple[int, dict]:
    """This rank's state in the newest checkpoint every rank can resume from (`agreed_step`), and its step; with
    `launcher_checked` (`aqpipe launch` checked every rank's file of the newest checkpoint before it started the
    ranks, holding the run directory since) that one, read once as it loads."""
    step = latest_step(run) if launcher_checked else agreed_step(run, rank, settings)
    if step is None:
        raise CheckpointError(f"--resume {run}: no complete checkpoint")
    state, problem = None, None
    try:
        state = load_rank(run, step, rank, settings, checked=True)  # (checked this very file, as said)
    except CheckpointError as e:
        problem = str(e)
    # every rank stops if one cannot load its part (rather than the others waiting in the resume's collectives)
    problems: list = [None] * dist.get_world_size()
    comm.all_gather_object(problems, problem, comm.SETUP)
    failed = [(r, text) for r, text in enumerate(problems) if text is not None]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} cannot resume from step {step}: {failed[0][1]}")
    assert state is not None
    return step, state


def agreed_step(run: str | Path, rank: int, settings: dict) -> int:
    """The newest checkpoint every rank can resume from, each reading its own host's disk (every rank calls this
    together): the newest step complete on every host with every rank's own file sound. Only the candidates are
    checked, newest first, until one is sound everywhere: a rank's state may be gigabytes (an in-memory m(ξ) store),
    and the older checkpoints are seldom needed. CheckpointError naming the hosts and what each holds when there is
    none."""
    held = [step for step in complete_steps(run) if rank_file(step_dir(run, step), rank).is_file()]
    everyone: list = [None] * dist.get_world_size()
    comm.all_gather_object(everyone, (socket.gethostname(), held), comm.SETUP)
    common = sorted(set(everyone[0][1]).intersection(*(set(steps) for _, steps in everyone[1:])), reverse=True)
    damaged: list[int] = []
    for step in common:
        try:
            check_rank(run, step, rank, settings)
            sound = True
        except CheckpointError as e:
            print(f"aqpipe: rank {rank}: {e}", file=sys.stderr, flush=True)
            damaged.append(step)
            sound = False
        verdicts: list = [None] * dist.get_world_size()
        comm.all_gather_object(verdicts, sound, comm.SETUP)
        if all(verdicts):
            newest = max(steps[0] for _, steps in everyone if steps)
            if rank == 0 and newest > step:
                print(f"aqpipe: resuming after step {step}: the checkpoint of step {newest} is not complete and sound "
                      "on every host", file=sys.stderr, flush=True)
            return step
    found: list = [None] * dist.get_world_size()
    comm.all_gather_object(found, damaged, comm.SETUP)
    holdings = "; ".join(
        f"rank {r} on {host}: {', '.join(f'{s} (damaged)' if s in bad else str(s) for s in steps) or 'none'}"
        for r, ((host, steps), bad) in enumerate(zip(everyone, found)))
    raise CheckpointError(f"--resume {run}: no checkpoint is complete and sound on every host (steps held: "
                          f"{holdings})")


def describe(out: str | Path, step: int, rank: int) -> str:
    """The file a rank's checkpoint lives in, for messages."""
    return str(rank_file(step_dir(out, step), rank))
