"""What a run leaves behind: the per-step metrics record (every rank's numbers combined on rank 0), progress and
evaluation lines, the final stage weights, the merged HF export, summary.json and the loss plot."""

from __future__ import annotations

import io
import math
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from aqpipe.config import ResolvedConfig
from aqpipe.config.rates import MIN_RATE_BITS
from aqpipe.data.dataset import export_tokenizer
from aqpipe.disk import DiskFullError, save_atomic, writing
from aqpipe.metrics import MetricsLog, kept_records, plot_loss, summarize, write_json
from aqpipe.pipeline import comm, present
from aqpipe.pipeline.grid import Grid, collective_device, gather_rows
from aqpipe.pipeline.step_stats import COMBINED, INTEGER_FIELDS, STAT_FIELDS, StepStats
from aqpipe.runtime.checkpoints.restart import restarts
from aqpipe.runtime.checkpoints.store import restored_records
from aqpipe.runtime.events import progress
from aqpipe.runtime.plan import RunPlan
from aqpipe.stages.export import export_adapter, export_hf
from aqpipe.stages.lora import adapter_state, merged_state
from aqpipe.stages.models import tokenizer_directory
from aqpipe.storage.base import stage_holding


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


def step_record(stats: StepStats, grid: Grid, cfg: ResolvedConfig, step: int, steps_per_epoch: int, lr: float,
                 step_seconds: float, device: torch.device) -> dict:
    """Collect every rank's numbers of this step on rank 0 and combine them into one metrics record."""
    mine = torch.tensor([float(getattr(stats, f)) for f in STAT_FIELDS] + [step_seconds], dtype=torch.float64)
    rows = gather_rows(mine, grid, device)
    if rows is None:
        return {}
    col = {name: rows[:, i] for i, name in enumerate(STAT_FIELDS + ("step_seconds",))}
    last_stage = [grid.rank_of(cfg.pp - 1, r) for r in range(cfg.dp)]
    loss = float(col["loss_sum"][last_stage].sum()) / (cfg.micro_batches * cfg.dp)
    slowest = float(col["step_seconds"].max())

    def per_link(name: str, side: str) -> list[float]:
        """Summed over replicas, for each link, of the number kept by the stage on `side` of it (activations go
        from the send side to the recv side; gradients the other way)."""
        return [float(sum(col[name][grid.rank_of(stage_holding(k, side), r)] for r in range(cfg.dp)))
                for k in range(cfg.pp - 1)]

    def rates(direction: str, receiver: str) -> list[float]:
        """Achieved bytes/s of each link in one direction while a message body was on the wire."""
        moved = per_link(f"{direction}_recv_bytes", receiver)
        seconds = per_link(f"{direction}_recv_seconds", receiver)
        return [b / s if s > 0 else 0.0 for b, s in zip(moved, seconds)]

    def relative(name: str) -> list[float | None]:
        """Each link's √(Σ name / Σ ‖a‖²) over the AQ-SGD deltas its sender sent this step (None: it sent none)."""
        return [math.sqrt(part / whole) if whole > 0 else None
                for part, whole in zip(per_link(name, "send"), per_link("aqsgd_signal", "send"))]

    fwd_elements, bwd_elements = int(col["fwd_elements"].sum()), int(col["bwd_elements"].sum())
    aqsgd = {"link_aqsgd_change": relative("aqsgd_change"), "link_aqsgd_error": relative("aqsgd_error")}
    return {
        "step": step + 1,
        "epoch": step // steps_per_epoch,
        "loss": loss,
        "lr": lr,
        "samples_per_second": cfg.samples_per_step * cfg.dp / slowest,
        "step_seconds": slowest,
        **combined(col, grid),
        # this record's own gather (every rank but 0 sends its row) is control traffic of this step too
        "control_bytes": int(col["control_bytes"].sum()) + (grid.world_size - 1) * mine.numel() * mine.element_size(),
        "link_fwd_bytes": [int(b) for b in per_link("fwd_bytes", "send")],
        "link_bwd_bytes": [int(b) for b in per_link("bwd_bytes", "recv")],
        "link_fwd_wire_seconds": per_link("fwd_recv_seconds", "recv"),
        "link_bwd_wire_seconds": per_link("bwd_recv_seconds", "send"),
        "link_fwd_bytes_per_second": rates("fwd", "recv"),
        "link_bwd_bytes_per_second": rates("bwd", "send"),
        "fwd_bytes_per_element": int(col["fwd_bytes"].sum()) / fwd_elements if fwd_elements else 0.0,
        "bwd_bytes_per_element": int(col["bwd_bytes"].sum()) / bwd_elements if bwd_elements else 0.0,
        "skipped": bool(col["overflow"].max() > 0),  # fp16: a gradient overflowed and no rank updated
        **(aqsgd if any(v is not None for v in aqsgd["link_aqsgd_change"]) else {}),
    }


def combined(col: dict[str, torch.Tensor], grid: Grid) -> dict:
    """The record fields of every StepStats field that declares how the ranks' values combine (`combine`)."""
    record: dict = {}
    for name, how in COMBINED.items():
        cast = int if name in INTEGER_FIELDS else float
        values = col[name]
        for kind in how:
            if kind == "sum":
                record[name] = cast(values.sum())
            elif kind == "max":
                record[name] = cast(values.max())
            elif kind == "first":
                record[name] = cast(values[0])
            elif kind == "per_stage":
                record[f"stage_{name}"] = [cast(values[grid.rank_of(s, 0)]) for s in range(grid.pp)]
            else:  # stage_sum
                record[f"stage_{name}"] = [cast(sum(values[grid.rank_of(s, r)] for r in range(grid.dp)))
                                           for s in range(grid.pp)]
    return record


def print_progress(record: dict, total: int) -> None:
    """A plain progress line every so often when no launcher draws a progress bar (torchrun, DeepSpeed)."""
    if os.environ.get("AQPIPE_EVENTS") == "1":
        return
    every = max(1, total // 20)
    if record["step"] % every == 0 or record["step"] == total:
        print(f"step {record['step']}/{total}  loss {record['loss']:.4f}  {record['samples_per_second']:.1f} samples/s",
              file=sys.stderr, flush=True)


def print_eval(step: int, result: dict) -> None:
    parts = [f"eval after step {step}: loss {result['loss']:.4f}"]
    if "accuracy" in result:
        parts.append(f"accuracy {result['accuracy']:.4f}, MCC {result['mcc']:.4f}")
    if "perplexity" in result:
        parts.append(f"perplexity {result['perplexity']:.2f}")
    print(", ".join(parts), file=sys.stderr, flush=True)


def eval_summary(records: list[dict]) -> dict:
    """The last evaluation's numbers as summary fields (eval_loss, eval_accuracy, …), with the step it ran at."""
    evaluated = [r for r in records if "eval_loss" in r]
    if not evaluated:
        return {}
    final = evaluated[-1]
    return {**{k: v for k, v in final.items() if k.startswith("eval_")}, "eval_step": final["step"]}


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


def export_model(plan: RunPlan, final: FinalWeights | None) -> str | None:
    """Merge the final stage weights into an HF checkpoint directory `<out>/export` (None for custom models)."""
    architecture = plan.spec.extras.get("architecture")
    if architecture is None or final is None:  # a custom model (no export), or not rank 0
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would interleave with the launcher's output
    out = Path(plan.cfg.out)
    states = final.states
    tokenizer = export_tokenizer(plan.cfg.task, plan.cfg.data, tokenizer_directory(plan.cfg.model), plan.cfg.vocab_size)
    try:
        with writing(out / "export", sum(t.numel() * t.element_size() for s in states for t in s.values())):
            path = export_hf(states, plan.bounds, architecture, plan.spec.extras["hf_config"], out / "export",
                             tokenizer, plan.dataset.label_names)
    except DiskFullError:
        shutil.rmtree(out / "export", ignore_errors=True)  # a partial export must not look like a model
        raise
    return str(path)


SAMPLE_TOKENS = 48


def held_out_answer(export_dir: str, valid) -> dict:
    """The exported model's greedy answer to the first held-out conversation, beside the reference answer."""
    from aqpipe.generate import Sampling, complete, load_model

    model, tokenizer = load_model(Path(export_dir))
    answer = complete(model, tokenizer, valid.prompts[0], Sampling(max_new_tokens=SAMPLE_TOKENS))
    return {"question": valid.questions[0], "answer": answer, "reference": valid.answers[0]}


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


def export_adapter_dir(plan: RunPlan, final: FinalWeights) -> str:
    """Write the LoRA adapters of every stage as a peft adapter directory `<out>/export-adapter`."""
    out = Path(plan.cfg.out)
    states = present(final.adapters, "the stages' LoRA adapters")
    try:
        with writing(out / "export-adapter", sum(t.numel() * t.element_size() for s in states for t in s.values())):
            path = export_adapter(states, plan.bounds, plan.spec.extras["architecture"], plan.lora,
                                  plan.spec.extras["base_model"], out / "export-adapter")
    except DiskFullError:
        shutil.rmtree(out / "export-adapter", ignore_errors=True)
        raise
    return str(path)


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
    """Everything summary.json holds, writing the export on the way."""
    cfg = plan.cfg
    summary = summarize(log.records, used_steps=cfg.steps is not None, warmup_epochs=cfg.warmup_epochs,
                        wall_seconds=wall_seconds)
    last = log.records[-1]
    summary["store"] = {"hits": last["store_hits"], "misses": last["store_misses"], "reseeded": last["store_reseeded"],
                        "overflow": last.get("store_overflow", 0)}
    summary["skipped_steps"] = sum(1 for r in log.records if r.get("skipped"))
    summary["restarts"] = restarts(cfg.out)
    summary.update(eval_summary(log.records))
    summary["export"] = export_model(plan, final)
    summary["final_weights_bytes"] = final.bytes_received if final is not None else 0
    traffic = summary["traffic"]
    traffic["final_weights"] = summary["final_weights_bytes"]
    traffic["setup"] = unrecorded.get(comm.SETUP, 0)
    traffic["control"] += unrecorded.get(comm.CONTROL, 0)
    traffic["checkpoint"] += unrecorded.get(comm.CHECKPOINT, 0)
    traffic["total"] = sum(v for k, v in traffic.items() if k != "total")
    if cfg.export_adapter and final is not None:
        summary["export_adapter"] = export_adapter_dir(plan, final)
    if plan.dataset.info:
        summary["data"] = plan.dataset.info
    if summary["export"] and getattr(plan.dataset.valid, "prompts", None):
        summary["sample"] = held_out_answer(summary["export"], plan.dataset.valid)
    return summary
