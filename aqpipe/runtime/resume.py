"""What one rank puts in a checkpoint and how it takes it back: model, optimizer, LR schedule, RNG, codecs,
grad-sync (error feedback) and, for an in-memory store, m(ξ) itself."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from aqpipe.runtime.optim import continue_schedule
from aqpipe.runtime.checkpoint import CheckpointError, check_model_state, rank_file, step_dir
from aqpipe.runtime.worker import Codecs, StageWorker
from aqpipe.storage import MemoryStore

CODEC_SLOTS = ("fw_send", "fw_recv", "bw_send", "bw_recv")


def collect_state(worker: StageWorker, codecs: Codecs, store) -> dict:
    """Everything this rank needs to continue exactly from the end of the current step."""
    state = {
        "model": {k: v.detach().cpu() for k, v in worker.module.state_dict().items()},
        "optimizer": worker.optimizer.state_dict(),
        "lr_schedule": worker.lr_schedule.state_dict(),
        "grad_sync": worker.grad_sync.state_dict(),
        "codecs": {slot: getattr(codecs, slot).state_dict() for slot in CODEC_SLOTS if getattr(codecs, slot) is not None},
        "rng": {"torch": torch.get_rng_state()},
        "store_stats": store.stats.as_dict(),
    }
    if torch.cuda.is_available() and worker.device.type == "cuda":
        state["rng"]["cuda"] = torch.cuda.get_rng_state(worker.device)
    if isinstance(store, MemoryStore):
        state["store"] = store.entries()
    return state


def apply_state(state: dict, worker: StageWorker, codecs: Codecs, store, where: str) -> None:
    """Restore `collect_state`'s output; checks the model part fully before changing anything."""
    for key in ("model", "optimizer", "lr_schedule", "grad_sync", "codecs", "rng", "store_stats"):
        if key not in state:
            raise CheckpointError(f"checkpoint {where} lacks its {key!r} part")
    check_model_state(where, worker.module, state["model"])
    if isinstance(store, MemoryStore) and "store" not in state:
        raise CheckpointError(f"checkpoint {where} has no m(xi) store, but this run keeps it in memory")
    worker.module.load_state_dict(state["model"])
    try:
        worker.optimizer.load_state_dict(state["optimizer"])
        worker.lr_schedule.load_state_dict(state["lr_schedule"])
        continue_schedule(worker.lr_schedule, worker.optimizer)
        worker.grad_sync.load_state_dict(state["grad_sync"])
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"checkpoint {where} does not fit this run's optimizer or grad sync: {e}") from None
    for slot, codec_state in state["codecs"].items():
        codec = getattr(codecs, slot, None)
        if codec is not None:
            codec.load_state_dict(codec_state)
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and worker.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], worker.device)
    if isinstance(store, MemoryStore):
        store.load(state["store"])
    for name, value in state["store_stats"].items():
        setattr(store.stats, name, int(value))


def describe(out: str | Path, step: int, rank: int) -> str:
    """The file a rank's checkpoint lives in, for messages."""
    return str(rank_file(step_dir(out, step), rank))


def kept_records(out: str | Path, step: int) -> list[dict]:
    """The metrics records a resumed run keeps: those of steps up to and including `step`."""
    path = Path(out) / "metrics.jsonl"
    records: list[dict] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short when the run was killed
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                records.append(record)
    return records
