"""The run's final weights: every stage's gathered on rank 0 over the network (hosts need not share a disk), and
each stage's written to its host's run directory."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch

from aqpipe.config.rates import MIN_RATE_BITS
from aqpipe.disk import save_atomic
from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import Grid, collective_device
from aqpipe.runtime.events import progress
from aqpipe.runtime.plan import RunPlan
from aqpipe.stages.lora import adapter_state, merged_state


@dataclass
class FinalWeights:
    """Every stage's final weights (and LoRA adapters with --export-adapter) on rank 0, gathered over the network
    from replica 0's ranks, and the bytes that took."""

    states: list[dict[str, torch.Tensor]]
    adapters: list[dict[str, torch.Tensor]] | None
    bytes_received: int


# The sizes the final weights' pieces keep to: the smallest is a round trip of its own, the largest bounded.
MIN_PIECE, MAX_PIECE = 64 << 10, 64 << 20


def piece_bytes(stall_timeout: float, senders: int) -> int:
    """The size of the pieces `senders` ranks send rank 0 their final weights in, all at once: a round, one piece
    from each, crosses the slowest link aqpipe plans for (`MIN_RATE_BITS`, into rank 0) within a third of
    `stall_timeout`, the time-out each piece's send and receive wait under (a send may wait for the rest of one round
    and its share of the next); `MIN_PIECE` to `MAX_PIECE`."""
    fits = int(stall_timeout / 3 * MIN_RATE_BITS / 8 / max(1, senders))
    return max(MIN_PIECE, min(MAX_PIECE, fits))


def gather_final_weights(module: torch.nn.Module, grid: Grid, plan: RunPlan, device: torch.device,
                         tied_head: str | None = None, row_cache: torch.nn.Parameter | None = None
                         ) -> FinalWeights | None:
    """Send replica 0's final stage weights to rank 0 (point to point, every stage at once, a piece at a time: hosts
    need not share a disk, and over a slow link no stage's wait may outlast the time-out), which writes the export.
    With a tied table exchanged by rows, rank 0 (the first stage, holding the `row_cache`) takes the whole table
    from the last stage's head (`tied_head`: its name there) before its own weights are saved; for a model aqpipe
    does not export only that table travels, and nothing at all without one. Every rank calls this; returns what
    rank 0 received (None elsewhere, and when nothing travelled)."""
    exporting = plan.spec.extras.get("architecture") is not None
    if not (exporting or tied_head is not None or row_cache is not None) or grid.replica != 0:
        return None
    where = collective_device(device)
    senders = list(range(1, plan.cfg.pp)) if exporting else [plan.cfg.pp - 1]
    piece = piece_bytes(plan.cfg.stall_timeout, len(senders))
    if grid.rank != 0 and grid.stage in senders:
        model = merged_state(module)
        if not exporting:  # only the head's table is wanted
            model = {tied_head: model[tied_head]} if tied_head is not None else {}
        parts: dict = {"model": model, "tied_head": tied_head}
        if plan.cfg.export_adapter:
            parts["adapter"] = adapter_state(module)
        buffer = io.BytesIO()
        torch.save(parts, buffer)
        comm.send_bytes(buffer.getvalue(), 0, comm.FINAL_WEIGHTS, where, piece)
    if grid.rank != 0:
        return None
    received = comm.receive_bytes_from_all([grid.rank_of(stage, 0) for stage in senders], where, piece,
                                           lambda done, total: progress("final weights", done, total, "bytes"))
    parts_of = [torch.load(io.BytesIO(data), weights_only=True) for data in received]
    head = parts_of[-1].get("tied_head") if parts_of else None
    if row_cache is not None and head is not None:
        with torch.no_grad():
            row_cache.copy_(parts_of[-1]["model"][head].to(row_cache.device, row_cache.dtype))
    if not exporting:  # the table alone travelled: counted, nothing to export
        return FinalWeights([], None, sum(8 + len(d) for d in received))
    own = {"model": merged_state(module), **({"adapter": adapter_state(module)} if plan.cfg.export_adapter else {})}
    parts_of = [own, *parts_of]
    return FinalWeights([p["model"] for p in parts_of],
                        [p["adapter"] for p in parts_of] if plan.cfg.export_adapter else None,
                        sum(8 + len(d) for d in received))


def save_stage_weights(module: torch.nn.Module, out: Path, stage: int, adapters: bool = False) -> Path:
    """Write one stage's final weights to checkpoints/final/stage-<k>.pt (load with weights_only=True), and with
    `adapters` its LoRA adapters alone to stage-<k>.adapter.pt."""
    directory = out / "checkpoints" / "final"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"stage-{stage}.pt"
    save_atomic(path, lambda f: torch.save(merged_state(module), f))  # LoRA: adapters merged into the base
    if adapters:
        save_atomic(directory / f"stage-{stage}.adapter.pt", lambda f: torch.save(adapter_state(module), f))
    return path
