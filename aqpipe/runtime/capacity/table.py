"""The capacity plan as `--dry-run` prints it: per stage, per link, the grad sync and the tied tables."""

from __future__ import annotations

from aqpipe.compress.grad.wire import FIRST_STEPS, PERIODIC
from aqpipe.config import ResolvedConfig
from aqpipe.runtime.capacity.eval_passes import EvalNeeds
from aqpipe.runtime.capacity.links import WARM_UP
from aqpipe.runtime.capacity.plan import CapacityPlan, TiedNeeds, dense_tied_bytes, human_bytes


def format_plan(capacity: CapacityPlan) -> str:
    """The plan as the table `--dry-run` prints."""
    cfg = capacity.cfg
    lines = [f"capacity plan: {cfg.model}, --pp {cfg.pp} --dp {cfg.dp}, {cfg.micro_batches} micro-batches of "
             f"{cfg.micro_batch_size} x {cfg.seq_len} tokens, --schedule {cfg.schedule}, --precision {cfg.precision}"
             f"{', --recompute' if cfg.recompute else ''}{f', --lora {cfg.lora}' if cfg.lora else ''}, "
             f"--optimizer {cfg.optimizer}, --fw {cfg.fw} --bw {cfg.bw}", "",
             "stage  layers  parameters  trained     weights   grads     optimizer  activations (held)     m(xi) store"]
    for s in capacity.stages:
        held = (f"{human_bytes(s.activation_bytes)} ({s.micro_batches_held} x "
                f"{human_bytes(s.activation_bytes_per_micro_batch)})")
        state = "".join(f"{human_bytes(n):>9} " for n in (s.weight_bytes, s.grad_bytes, s.optimizer_bytes))
        lines.append(f"{s.stage:<6} {s.layers[0]:>2}-{s.layers[1]:<4} {s.parameters:>11,} {s.trainable:>11,}  "
                     f"{state} {held:<22} {human_bytes(s.store_bytes) + ' ' + s.store_where if s.store_bytes else '-'}")
    if capacity.links:
        warm = cfg.warmup_epochs > 0  # (a warm-up column only for a run that has one)
        lines += ["", "link   micro-batch         fwd per step   bwd per step   "
                  + ("warm-up fwd/bwd     " if warm else "") + "m(xi) per side"]
        for link in capacity.links:
            warmup = f"{human_bytes(link.warmup_fwd_bytes):>8}/{human_bytes(link.warmup_bwd_bytes):<9} " if warm else ""
            lines.append(f"{link.link}->{link.link + 1}   {'x'.join(map(str, link.activation_shape)):<12} "
                         f"{link.activation_dtype:<6} {human_bytes(link.fwd_bytes):>12} {human_bytes(link.bwd_bytes):>14}   "
                         f"{warmup}{human_bytes(link.store_side_bytes) if link.store_side_bytes else '-':>14}")
        if cfg.warmup_epochs == 0 and cfg.keeps_messages:
            lines.append(f"first epoch (every sample a first sight, --first-sight {cfg.first_sight}): "
                         + ", ".join(f"{link.link}->{link.link + 1} {human_bytes(link.first_fwd_bytes)} fwd per step"
                                     for link in capacity.links))
        sent, fp32 = capacity.run_link_bytes()
        if sent:
            padded = capacity.fixed_shape_bytes()
            every = (f"; only real tokens cross them: {padded / sent:.2f}x fewer than lossless links sending every "
                     f"padded position, {human_bytes(padded)}") if padded else ""
            lines.append(f"over the run ({capacity.steps} steps): {human_bytes(sent)} on the links of a replica, "
                         f"{fp32 / sent:.2f}x fewer than lossless links ({human_bytes(fp32)}){every}")
        if capacity.tied is not None:
            lines.append(format_tied(capacity.tied, cfg))
        if capacity.evaluation is not None:
            lines.append(format_evaluation(capacity.evaluation, cfg))
        step = capacity.link_bound_step_seconds()
        if step is not None:
            warmup = (f" ({capacity.link_bound_step_seconds(WARM_UP):.2f} s during the fp32 warm-up)"
                      if cfg.warmup_epochs else "")
            lines.append(f"at --bandwidth {cfg.bandwidth}: the links alone need at least {step:.2f} s per step{warmup}")
    if any(s.sync_peak_bytes for s in capacity.stages):
        where = {"RAM": "on each rank's GPU the flat gradient and its result, the rest in host RAM (gloo)",
                 "device": "on the host" if cfg.device == "cpu" else "on each rank's GPU (NCCL)"}
        lines.append(f"grad sync (--grad-sync {cfg.grad_sync}, --dp {cfg.dp}), "
                     f"{where[capacity.stages[0].sync_where]}: kept / at its peak after the backward passes "
                     + ", ".join(f"stage {s.stage} {human_bytes(s.sync_kept_bytes)} / {human_bytes(s.sync_peak_bytes)}"
                                 for s in capacity.stages))
    if any(s.sync.costliest for s in capacity.stages):
        lines.append(format_sync_wire(capacity))
    if any(s.codec_bytes for s in capacity.stages):
        lines.append("codec CUDA graphs (held for the run, in each rank's GPU memory): "
                     + ", ".join(f"stage {s.stage} {human_bytes(s.codec_bytes)}" for s in capacity.stages))
    total = sum(s.memory_bytes for s in capacity.stages) * cfg.dp
    ram_stores = sum(s.store_bytes for s in capacity.stages if s.store_where == "RAM") * cfg.dp
    lines += ["", f"in memory: {human_bytes(total)} on the {'host' if cfg.device == 'cpu' else 'GPUs'} over {cfg.world_size} "
              f"ranks{f', plus m(xi) stores {human_bytes(ram_stores)} in RAM' if ram_stores else ''}; available: "
              + ", ".join(f"{k} {human_bytes(v)}" for k, v in capacity.available.items())]
    lines += [f"does not fit: {p}" for p in capacity.problems] or ["fits"]
    return "\n".join(lines)


# How the plan says when a grad sync's costliest step comes (wire.SyncBytes.costliest_when)
_COSTLIEST_WHEN = {FIRST_STEPS: "in its first steps (fp32)", PERIODIC: "in its full-precision steps"}


def format_sync_wire(capacity: CapacityPlan) -> str:
    """The plan's line about what the replicas' grad sync sends, and how long that takes at --bandwidth."""
    stages = capacity.stages
    text = "grad sync on the wire (per replica and step): " + ", ".join(
        f"stage {s.stage} {human_bytes(s.sync.steady)}"
        + (f" ({human_bytes(s.sync.costliest)} {_COSTLIEST_WHEN[s.sync.costliest_when]})" if s.sync.costliest_when in
           _COSTLIEST_WHEN else "") for s in stages)
    steady, costliest = capacity.sync_seconds(), capacity.sync_seconds(costliest=True)
    step = capacity.step_wire_seconds()
    if steady is not None and costliest is not None and step is not None:
        text += (f"; at --bandwidth {capacity.cfg.bandwidth} {steady:.2f} s after each step's backward passes"
                 + (f", {costliest:.2f} s in its costliest steps" if costliest > steady else "")
                 + f": the links and the grad sync alone need at least {step:.2f} s per step"
                 + (f" ({capacity.step_wire_seconds(costliest_sync=True):.2f} s in those)" if costliest > steady else ""))
    return text


def format_evaluation(evaluation: EvalNeeds, cfg: ResolvedConfig) -> str:
    """The plan's line about the held-out passes."""
    e = evaluation
    return (f"evaluation (--eval-codec {cfg.eval_codec}, {e.samples:,} held-out samples): {human_bytes(e.pass_bytes)} "
            f"per pass on the links, {e.lossless_pass_bytes / e.pass_bytes:.2f}x fewer than lossless; {e.passes} "
            f"pass{'es' if e.passes > 1 else ''} over the run: {human_bytes(e.run_bytes)}")


def format_tied(tied: TiedNeeds, cfg: ResolvedConfig) -> str:
    """The plan's line about tied tables."""
    if tied.how == "rows":
        return (f"tied embedding/LM head: {human_bytes(tied.step_bytes)} per step between stage 0 and stage {cfg.pp - 1} "
                f"(the rows of ~{tied.distinct_tokens:,.0f} distinct tokens and their gradient; the table is "
                f"{human_bytes(tied.table_bytes)}; --tied-exchange dense would send "
                f"{human_bytes(dense_tied_bytes(tied.table_bytes, cfg.pp, cfg.dp))})")
    again = ", and again after the grad sync" if cfg.dp > 1 else ""
    return (f"tied tables: {human_bytes(tied.step_bytes)} per step (an all-reduce of {human_bytes(tied.table_bytes)} over "
            f"the pipeline{again})")
