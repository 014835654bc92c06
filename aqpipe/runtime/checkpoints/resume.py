"""What one rank puts in a checkpoint and how it takes it back: model, optimizer, LR schedule, RNG, codecs,
grad-sync (error feedback) and, for an in-memory store, m(ξ) itself; and resuming a rank from the last checkpoint."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from aqpipe.config import ResolvedConfig
from aqpipe.pipeline.execution.worker import StageWorker
from aqpipe.pipeline.numerics.optim import continue_schedule
from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import host_leader
from aqpipe.runtime.checkpoints.copies import fetch_missing
from aqpipe.runtime.checkpoints.parts import (
    STORE,
    CheckpointError,
    check_model_state,
    check_rank,
    drop_steps_after,
    latest_step,
    load_rank,
    rank_file,
    set_aside_steps_after,
    step_dir,
)
from aqpipe.runtime.checkpoints.reconcile import reconcile
from aqpipe.runtime.checkpoints.restart import (
    Holding,
    choose_start,
    clear_run_state,
    going_back,
    holders,
    holding,
    record_restart,
)
from aqpipe.runtime.events import emit
from aqpipe.stages.lora import checkpointed_names, training_state
from aqpipe.storage.memory import in_memory
from aqpipe.storage.prefetch import PrefetchingStore


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
        state[STORE] = store.entries()
    if worker.scaler is not None:
        state["loss_scaler"] = worker.scaler.state_dict()
    if worker.links.tied_rows is not None:
        state["tied_rows"] = worker.links.tied_rows.state_dict()
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
    if worker.links.tied_rows is not None and "tied_rows" in state:
        worker.links.tied_rows.load_state_dict(state["tied_rows"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and worker.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], worker.device)
    if in_memory(store) and STORE in state:  # (else re-seeded: see `resume_rank`)
        store.load(state[STORE])
    for name, value in state["store_stats"].items():
        setattr(store.stats, name, int(value))


def resume_rank(cfg: ResolvedConfig, worker: StageWorker, store, step: int, state: dict) -> int:
    """Apply this rank's `state` of the checkpoint of `step` (`load_agreed`'s) and make every link's two m(ξ) copies
    agree; returns the step to continue from. Every rank calls it (reconciliation is collective). An in-memory store
    the state lacks (its host lost it: the part came from a copy, or its file was damaged) starts empty, and the
    reconciliation re-seeds its samples on both sides of each link. An on-disk store is rewound to the checkpoint
    first (it outlived the crash holding values written after it); one that cannot be (no journal reaches back that
    far) keeps its newer values, on both sides of a link alike where both wrote them, and the rest are re-seeded."""
    assert cfg.resume is not None, "a resumed run names its run directory"
    apply_state(state, worker, store, describe(cfg.resume, step, worker.grid.rank))
    rewound = store.rewind(step) if isinstance(store, PrefetchingStore) else None
    reseeded = reconcile(store, worker.grid, worker.groups.pipeline)
    store.stats.reseeded += reseeded
    emit({"event": "resumed", "step": step, "rank": worker.grid.rank, "reseeded": reseeded, "rewound": rewound})
    return step


def starting_point(cfg: ResolvedConfig, rank: int, launcher_checked: bool) -> tuple[int, dict] | None:
    """The checkpoint this rank continues from and its state in it, or None to start from the first step. A rank
    `aqpipe launch` started takes what its launcher decided; otherwise (torchrun, DeepSpeed: every rank together)
    the ranks agree from what each host's run directory holds, so that a restart — torchrun's elastic agent, or the
    same command typed again — continues the run instead of training over it (`restart`)."""
    if launcher_checked:
        return load_agreed(cfg.resume, rank, cfg.fixed_settings(), launcher_checked=True) if cfg.resume else None
    resumed = load_agreed(cfg.resume or cfg.out, rank, cfg.fixed_settings(), explicit=cfg.resume is not None)
    if resumed is not None:
        cfg.resume = cfg.out
    return resumed


def load_agreed(run: str | Path, rank: int, settings: dict, launcher_checked: bool = False, explicit: bool = True
                ) -> tuple[int, dict] | None:
    """This rank's state in the checkpoint every rank continues from, and its step; None when the run starts from its
    first step (every rank calls this together). With `launcher_checked` (`aqpipe launch` checked every rank's file of
    the newest checkpoint before it started the ranks, holding the run directory since) that one, read once as it
    loads; else the ranks agree (`agreed_step`; `explicit`: `--resume` was given, see `choose_start`)."""
    step = latest_step(run) if launcher_checked else agreed_step(run, rank, settings, explicit)
    if step is None:
        if launcher_checked:
            raise CheckpointError(f"--resume {run}: no complete checkpoint")
        return None
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
    store = rank_file(step_dir(run, step), rank, STORE)
    if store.is_file():  # an in-memory m(ξ), kept on this rank's host (not where its part came from a copy)
        try:
            state[STORE] = load_rank(run, step, rank, settings, kind=STORE)[STORE]
        except (CheckpointError, KeyError) as e:
            print(f"aqpipe: rank {rank}: {e}; its m(xi) is re-seeded", file=sys.stderr, flush=True)
    return step, state


def agreed_step(run: str | Path, rank: int, settings: dict, explicit: bool = True) -> int | None:
    """The checkpoint every rank continues from, each reading its own host's disk (every rank calls this together),
    or None to start from the first step: each rank tells what its run directory holds, all choose alike
    (`choose_start`), then the candidates are checked newest first until one is sound everywhere — a rank's state
    may be gigabytes (an in-memory m(ξ) store), and the older checkpoints are seldom needed. Where this run's state
    holds no complete checkpoint, it is removed first. CheckpointError when there is none to take (naming the hosts
    and what each holds), or the state there is another run's."""
    world = dist.get_world_size()
    everyone: list = [None] * world
    mine = (holding(run, rank, settings).to_json(), explicit, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    comm.all_gather_object(everyone, mine, comm.SETUP)
    holdings = [Holding.from_json(h) for h, _, _ in everyone]
    # (every rank decides alike: --resume is a host's own setting, and one host may have been given it alone)
    explicit = all(given for _, given, _ in everyone)
    restarted = not explicit or any(count != "0" for _, _, count in everyone)
    start = choose_start(holdings, run, explicit, local=False)
    if start.note and rank == 0:
        print(f"aqpipe: {start.note}", file=sys.stderr, flush=True)
    if start.fresh:
        if start.clear:
            if host_leader():
                clear_run_state(run)
            comm.barrier(comm.SETUP)
            if rank == 0 and restarted:
                record_restart(run, None)
        return None
    damaged: list[int] = []
    for step in start.candidates[:1] if start.strict else start.candidates:
        needs = [step not in h.files for h in holdings]
        if any(needs):  # a host lost its part (a wiped disk, a new machine): from a copy on another host
            fetch_missing(run, step, rank, needs, [holders(holdings, step, h.rank) for h in holdings])
        problem = None
        try:
            check_rank(run, step, rank, settings)
        except CheckpointError as e:
            print(f"aqpipe: rank {rank}: {e}", file=sys.stderr, flush=True)
            damaged.append(step)
            problem = f"rank {rank} on {socket.gethostname()}: {e}"
        verdicts: list = [None] * world
        comm.all_gather_object(verdicts, problem, comm.SETUP)
        if not any(verdicts):
            if rank == 0 and restarted:
                record_restart(run, step)
            newest = start.candidates[0]
            if rank == 0 and newest > step:
                print(f"aqpipe: {going_back(step, newest, 'is not complete and sound on every host')}", file=sys.stderr,
                      flush=True)
            if host_leader():  # the steps after it are trained again: what is left of them goes (never mixed with);
                # a complete checkpoint passed over (--resume) is set aside, as a local launch does
                (set_aside_steps_after if newest > step else drop_steps_after)(run, step)
            comm.barrier(comm.SETUP)
            return step
        if start.strict:
            raise start.damaged(step, next(v for v in verdicts if v), run)
    found: list = [None] * world
    comm.all_gather_object(found, damaged, comm.SETUP)
    holdings_text = "; ".join(
        f"rank {h.rank} on {h.host}: {', '.join(f'{s} (damaged)' if s in bad else str(s) for s in h.files) or 'none'}"
        for h, bad in zip(holdings, found))
    raise CheckpointError(f"--resume {run}: no checkpoint is complete and sound on every host (steps held: "
                          f"{holdings_text})")


def describe(out: str | Path, step: int, rank: int) -> str:
    """The file a rank's checkpoint lives in, for messages."""
    return str(rank_file(step_dir(out, step), rank))
