"""What a run leaves behind in its run directory: config.json, the metrics log (resumed runs keep their history),
and at the end summary.json (`aqpipe.metrics.summarize`, with the exports' paths), the exports and the loss plot."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from aqpipe.config import ResolvedConfig
from aqpipe.metrics import MetricsLog, RunTotals, kept_records, plot_loss, summarize, write_json
from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import Grid, gather_rows
from aqpipe.runtime.checkpoints.restart import restarts
from aqpipe.runtime.checkpoints.store import restored_records
from aqpipe.runtime.outputs.export import export_adapter_dir, export_model, held_out_answer
from aqpipe.runtime.outputs.final_weights import FinalWeights
from aqpipe.runtime.plan import RunPlan


def write_config(cfg: ResolvedConfig, plan: RunPlan) -> None:
    """config.json, as resolved (the first rank of every host writes it: a resume on any host reads it)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resolved = cfg.to_dict()
    resolved["stage_bounds"] = plan.bounds
    write_json(out / "config.json", resolved)


def open_outputs(cfg: ResolvedConfig, plan: RunPlan, first_step: int, saved_log: dict | None = None) -> MetricsLog:
    """config.json, and the metrics log (a resumed run keeps the records up to its checkpoint: this host's, or those
    rank 0's part saved in `saved_log` where this host lost them)."""
    write_config(cfg, plan)
    out = Path(cfg.out)
    return MetricsLog(out, restored_records(out, saved_log, first_step, kept_records(out, first_step))
                      if first_step else [])


def unrecorded_traffic(mark: dict[str, int], grid: Grid, device: torch.device) -> dict[str, int] | None:
    """What the ranks sent outside every step record, summed on rank 0 (None elsewhere; every rank calls this): the
    start-up's (stream endpoints, the partition, a resume's agreement and m(ξ) reconciliation) as `setup`, and since
    the last record (`mark`: the traffic counts then) `control` (its checkpoint's barrier and digests, plus this
    gather's own bytes) and `checkpoint` (the copies of the last checkpoint)."""
    sent = comm.TRAFFIC.sent
    mine = torch.tensor([float(sent[comm.SETUP]), float(sent[comm.CONTROL] - mark[comm.CONTROL]),
                         float(sent[comm.CHECKPOINT] - mark[comm.CHECKPOINT])], dtype=torch.float64)
    rows = gather_rows(mine, grid, device)
    if rows is None:
        return None
    total = rows.sum(dim=0)
    return {comm.SETUP: int(total[0]), comm.CONTROL: int(total[1]) + (grid.world_size - 1) * mine.numel() * 8,
            comm.CHECKPOINT: int(total[2])}


def finish_outputs(plan: RunPlan, log: MetricsLog, wall_seconds: float, final: FinalWeights | None = None,
                   unrecorded: dict[str, int] | None = None) -> dict:
    """Rank 0, after every stage's final weights are on disk: summary.json, the export and loss.png; returns the
    summary."""
    cfg = plan.cfg
    log.close()
    out = Path(cfg.out)
    # The plot (importing matplotlib is most of its second) is drawn on a thread while the export below reads and
    # writes the weights, which mostly runs outside the interpreter lock.
    with ThreadPoolExecutor(1, thread_name_prefix="aqpipe-plot") as pool:
        plot = pool.submit(plot_loss, log.records, out / "loss.png",
                           title=f"{cfg.model}  pp={cfg.pp} dp={cfg.dp}  fw={cfg.fw} bw={cfg.bw}")
        summary = _summary(plan, log, wall_seconds, final, unrecorded or {})
        write_json(out / "summary.json", summary)
        plot.result()  # its error, if any, is the run's
    return summary


def _summary(plan: RunPlan, log: MetricsLog, wall_seconds: float, final: FinalWeights | None,
             unrecorded: dict[str, int]) -> dict:
    """Everything summary.json holds: the run's numbers (`summarize`) and what it wrote (the exports, on the way)."""
    cfg = plan.cfg
    totals = RunTotals(restarts(cfg.out), unrecorded, final.bytes_received if final is not None else 0)
    summary = summarize(log.records, used_steps=cfg.steps is not None, warmup_epochs=cfg.warmup_epochs,
                        wall_seconds=wall_seconds, totals=totals)
    summary["export"] = export_model(plan, final)
    if cfg.export_adapter and final is not None:
        summary["export_adapter"] = export_adapter_dir(plan, final)
    if plan.dataset.info:
        summary["data"] = plan.dataset.info
    if summary["export"] and getattr(plan.dataset.valid, "prompts", None):
        summary["sample"] = held_out_answer(summary["export"], plan.dataset.valid)
    return summary
