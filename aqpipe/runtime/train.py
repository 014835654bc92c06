"""One rank's whole run: join the process group, build the stage, train, and (rank 0) write the run directory."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from aqpipe.compress.codecs import QuantOptions, build_codec
from aqpipe.compress.grad import DPGroup, build_grad_sync
from aqpipe.compress.grad.registry import parse_grad_spec
from aqpipe.compress.grad.qadam import freeze_step
from aqpipe.config import RunConfig
from aqpipe.data.dataset import export_tokenizer
from aqpipe.disk import DiskFullError, save_atomic, writing
from aqpipe.launch.env import loopback_rendezvous
from aqpipe.metrics import MetricsLog, plot_loss, summarize, write_json
from aqpipe.runtime.checkpoint import CheckpointError, latest_step, load_rank, mark_complete, save_rank
from aqpipe.runtime.evaluate import eval_batches, evaluate_stage, gather_eval
from aqpipe.runtime.grid import Grid, create_groups, gather_rows
from aqpipe.runtime.optim import build_optimizer, momenta
from aqpipe.runtime.plan import RunPlan, make_plan, resolve_bounds, store_bytes_per_rank
from aqpipe.runtime.reconcile import reconcile
from aqpipe.runtime.replicas import check_replicas
from aqpipe.runtime.tied import tied_groups
from aqpipe.runtime.resume import apply_state, collect_state, describe, kept_records
from aqpipe.runtime.transport import KIND_ACTIVATION, KIND_GRADIENT, Inbox, Outbox
from aqpipe.runtime.worker import Codecs, Links, StageWorker, StepStats
from aqpipe.stages.export import export_hf
from aqpipe.stages.models import tokenizer_directory
from aqpipe.storage import STORE_DTYPES, MemoryStore, StoreView
from aqpipe.storage.lmdb_store import LMDBStore, store_path
from aqpipe.storage.prefetch import PrefetchingStore

EVENT_PREFIX = "@@aqpipe "
HEARTBEAT_SECONDS = 1.0
_EMIT_LOCK = threading.Lock()
_STAT_FIELDS = ("loss_sum", "fwd_bytes", "bwd_bytes", "fwd_elements", "bwd_elements", "grad_sync_bytes",
                "compute_seconds", "comm_wait_seconds", "grad_norm", "store_hits", "store_misses", "store_reseeded",
                "store_overflow",
                "fwd_recv_bytes", "fwd_recv_seconds", "bwd_recv_bytes", "bwd_recv_seconds", "forward_seconds",
                "backward_seconds")


def emit(event: dict) -> None:
    """Tell the local launcher about progress (a machine-readable stdout line); no-op outside it."""
    if os.environ.get("AQPIPE_EVENTS") == "1":
        with _EMIT_LOCK:  # the heartbeat thread emits too; one write per line keeps lines whole
            sys.stdout.write(EVENT_PREFIX + json.dumps(event) + "\n")
            sys.stdout.flush()


def start_heartbeat() -> None:
    """Tell the local launcher every second that this process is alive (a stopped or hung rank falls silent)."""
    if os.environ.get("AQPIPE_EVENTS") != "1":
        return

    def beat() -> None:
        while True:
            emit({"event": "alive"})
            time.sleep(HEARTBEAT_SECONDS)

    threading.Thread(target=beat, name="aqpipe-heartbeat", daemon=True).start()


def run_worker(cfg: RunConfig, rank: int, world_size: int, spec_factory=None) -> dict | None:
    """Train this rank's stage for the whole run; returns the summary on rank 0 (None elsewhere)."""
    if world_size != cfg.world_size:
        raise RuntimeError(f"the launcher started {world_size} processes but --pp {cfg.pp} x --dp {cfg.dp} needs {cfg.world_size}")
    grid = Grid(cfg.pp, cfg.dp, rank)
    start_heartbeat()
    device = torch.device(cfg.device if cfg.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    torch.manual_seed(cfg.seed)

    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.stall_timeout)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            store=loopback_rendezvous(rank, world_size, timeout))
    try:
        plan = make_plan(cfg, spec_factory, profile=False)
        if not plan.bounds:  # a time partition nobody resolved yet: rank 0 profiles, everyone takes its answer
            box = [resolve_bounds(cfg, plan.spec, plan.dataset) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            plan.bounds = box[0]
        return _train(plan, grid, device, backend)
    finally:
        dist.destroy_process_group()


def _links(grid: Grid, device: torch.device, timeout: float) -> Links:
    links = Links()
    if grid.prev_rank is not None:
        peer = grid.describe(grid.prev_rank)
        links.act_in = Inbox(grid.prev_rank, peer, KIND_ACTIVATION, device, timeout)
        links.grad_out = Outbox(grid.prev_rank, KIND_GRADIENT, device)
    if grid.next_rank is not None:
        peer = grid.describe(grid.next_rank)
        links.grad_in = Inbox(grid.next_rank, peer, KIND_GRADIENT, device, timeout)
        links.act_out = Outbox(grid.next_rank, KIND_ACTIVATION, device)
    return links


def open_store(cfg: RunConfig, rank: int, estimate: int | None = None):
    """This rank's m(ξ) store: in memory, or an LMDB environment under the run directory, its map sized from the
    estimate when there is one (it grows on demand either way)."""
    if cfg.store == "lmdb":
        cap = int(cfg.store_max_gb * 1e9) if cfg.store_max_gb is not None else None
        initial = min(estimate or (64 << 20), cap or (1 << 62))
        return PrefetchingStore(LMDBStore(store_path(cfg.out, rank), cfg.store_dtype, max_bytes=cap,
                                          initial_map_bytes=max(initial, 1 << 20)))
    return MemoryStore(STORE_DTYPES[cfg.store_dtype])


def build_codecs(cfg: RunConfig, grid: Grid, store) -> Codecs:
    """This rank's codecs; the AQ-SGD ones hold the sender side of the outgoing link and the receiver side of the
    incoming one (link k joins stage k to stage k+1)."""
    options = QuantOptions(per=cfg.quant_scales, stochastic=cfg.quant_rounding == "stochastic",
                           seed=cfg.seed + grid.rank, grid=cfg.quant_grid)
    check = cfg.store_check == "on"
    codecs = Codecs()
    if not grid.is_last_stage:
        codecs.fw_send = build_codec(cfg.fw, "fw", StoreView(store, grid.stage, "send"), options, check)
        codecs.bw_recv = build_codec(cfg.bw, "bw", options=options)
    if not grid.is_first_stage:
        codecs.fw_recv = build_codec(cfg.fw, "fw", StoreView(store, grid.stage - 1, "recv"), options, check)
        codecs.bw_send = build_codec(cfg.bw, "bw", options=options)
    return codecs


def _train(plan: RunPlan, grid: Grid, device: torch.device, backend: str) -> dict | None:
    cfg = plan.cfg
    groups = create_groups(grid, backend)
    store = open_store(cfg, grid.rank, store_bytes_per_rank(cfg, plan.spec, len(plan.dataset.train)))
    start, end = plan.bounds[grid.stage], plan.bounds[grid.stage + 1]
    module = plan.spec.build_stage(start, end, cfg.seed).to(device)
    dp_group = DPGroup(groups.data_parallel, tuple(grid.dp_ranks(grid.stage)), grid.replica)
    optimizer_momentum, vote_momentum = momenta(cfg.momentum, parse_grad_spec(cfg.grad_sync).sign_based)
    grad_sync = build_grad_sync(cfg.grad_sync, dp_group, cfg.seed, freeze_step(plan.total_steps, cfg.warmup_steps),
                                momentum=vote_momentum)
    optimizer, lr_schedule = build_optimizer(
        [p for p in module.parameters() if p.requires_grad], cfg.optimizer, cfg.lr, cfg.weight_decay,
        cfg.warmup_steps, plan.total_steps, grad_sync=grad_sync, momentum=optimizer_momentum,
    )
    codecs = build_codecs(cfg, grid, store)
    ends = grid.is_first_stage or grid.is_last_stage
    worker = StageWorker(
        grid=grid, groups=groups, module=module, loss_fn=plan.spec.loss,
        samples=plan.dataset.train if ends else None,
        links=_links(grid, device, cfg.stall_timeout), codecs=codecs,
        grad_sync=grad_sync, optimizer=optimizer,
        lr_schedule=lr_schedule, clip=cfg.clip, device=device, micro_batch_size=cfg.micro_batch_size,
        tied=tied_groups(plan.spec.extras),
    )
    first_step = _resume(cfg, worker, codecs, store, groups) if cfg.resume else 0
    epochs = plan.epoch_plan(grid.replica)
    log = _open_outputs(cfg, plan, first_step) if grid.rank == 0 else None
    emit({"event": "start", "total_steps": plan.total_steps, "rank": grid.rank, "first_step": first_step})
    wall_start = time.perf_counter() - (log.records[-1]["elapsed_seconds"] if log is not None and log.records else 0.0)

    def evaluate(step: int) -> dict:
        """One pass over the held-out split (all ranks); on rank 0 its numbers as `eval_*` record fields."""
        batches = eval_batches(len(plan.dataset.valid), grid.replica, cfg.dp, cfg.micro_batch_size)
        totals = evaluate_stage(worker, step, batches, plan.dataset.valid if ends else None, plan.dataset.num_labels)
        result = gather_eval(totals, grid, plan.dataset.num_labels, device)
        if result is None:
            return {}
        emit({"event": "eval", "step": step, "loss": result["loss"], "accuracy": result.get("accuracy")})
        _print_eval(step, result)
        return {f"eval_{k}": v for k, v in result.items()}

    def checkpoint(step: int) -> None:
        """Every rank writes its state after `step` steps (once the replicas of its stage agree on their parameters);
        rank 0 marks the checkpoint complete."""
        check_replicas(module, grid, groups.data_parallel, step, device)
        save_rank(cfg.out, step, grid.rank, collect_state(worker, codecs, store), cfg.fixed_settings())
        dist.barrier()
        if grid.rank == 0:
            mark_complete(cfg.out, step, grid.world_size, cfg.fixed_settings())

    evaluating = len(plan.dataset.valid) > 0 and cfg.eval_every != 0
    try:
        for step in range(first_step, plan.total_steps):
            step_start = time.perf_counter()
            lr = lr_schedule.get_last_lr()[0]
            epoch = step // plan.steps_per_epoch
            store.step = step
            if isinstance(store, PrefetchingStore):  # this step's m(ξ) (first step only) and the next step's
                for ahead in ([step, step + 1] if step == first_step else [step + 1]):
                    if ahead < plan.total_steps:
                        _prefetch(store, grid, torch.cat(epochs.micro_batches_of(ahead)).tolist())
            done = step + 1  # also the index of the next step
            next_ids = (torch.cat(epochs.micro_batches_of(done)).tolist()
                        if done < plan.total_steps and done // plan.steps_per_epoch >= cfg.warmup_epochs else None)
            stats = worker.run_step(step, epochs.micro_batches_of(step), compress=epoch >= cfg.warmup_epochs,
                                    next_ids=next_ids)
            stats.store_hits, stats.store_misses, stats.store_reseeded, stats.store_overflow = (
                store.stats.hits, store.stats.misses, store.stats.reseeded, store.stats.overflow)
            step_seconds = time.perf_counter() - step_start
            record = _gather_step(stats, grid, cfg, step, plan.steps_per_epoch, lr, step_seconds, device)
            if evaluating and (done == plan.total_steps or (cfg.eval_every and done % cfg.eval_every == 0)):
                record.update(evaluate(done))
            if log is not None:
                record["elapsed_seconds"] = time.perf_counter() - wall_start
                log.log(record)
                emit({"event": "step", "step": done, "total_steps": plan.total_steps, "loss": record["loss"],
                      "samples_per_second": record["samples_per_second"]})
                _print_progress(record, plan.total_steps)
            if done == plan.total_steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                if isinstance(store, PrefetchingStore):
                    store.flush()
                checkpoint(done)
    finally:
        worker.links.close()
    if first_step >= plan.total_steps:  # no step ran, so no checkpoint compared the replicas
        check_replicas(module, grid, groups.data_parallel, plan.total_steps, device)
    if grid.replica == 0:
        save_stage_weights(module, Path(cfg.out), grid.stage)
    dist.barrier()  # every stage's final weights are on disk before rank 0 merges them
    if cfg.store == "lmdb":
        store.close()
    elif cfg.store_dump == "on":
        (Path(cfg.out) / "store").mkdir(parents=True, exist_ok=True)
        store.dump(Path(cfg.out) / "store" / f"rank-{grid.rank}.pt")
    if log is None:
        return None
    log.close()
    summary = summarize(log.records, used_steps=cfg.steps is not None, warmup_epochs=cfg.warmup_epochs,
                        wall_seconds=time.perf_counter() - wall_start)
    last = log.records[-1]
    summary["store"] = {"hits": last["store_hits"], "misses": last["store_misses"], "reseeded": last["store_reseeded"],
                        "overflow": last.get("store_overflow", 0)}
    summary.update(eval_summary(log.records))
    summary["export"] = _export(plan)
    out = Path(cfg.out)
    write_json(out / "summary.json", summary)
    plot_loss(log.records, out / "loss.png", title=f"{cfg.model}  pp={cfg.pp} dp={cfg.dp}  fw={cfg.fw} bw={cfg.bw}")
    emit({"event": "done", "summary": summary})
    return summary


def _resume(cfg: RunConfig, worker: StageWorker, codecs: Codecs, store, groups) -> int:
    """Load this rank's part of the run's last checkpoint and make every link's two m(ξ) copies agree; returns
    the step to continue from."""
    step = latest_step(cfg.resume)
    if step is None:
        raise CheckpointError(f"--resume {cfg.resume}: no complete checkpoint under {cfg.resume}/checkpoints")
    apply_state(load_rank(cfg.resume, step, worker.grid.rank, cfg.fixed_settings()), worker, codecs, store,
                describe(cfg.resume, step, worker.grid.rank))
    reseeded = reconcile(store, worker.grid, groups.pipeline)
    store.stats.reseeded += reseeded
    emit({"event": "resumed", "step": step, "rank": worker.grid.rank, "reseeded": reseeded})
    return step


def eval_summary(records: list[dict]) -> dict:
    """The last evaluation's numbers as summary fields (eval_loss, eval_accuracy, …), with the step it ran at."""
    evaluated = [r for r in records if "eval_loss" in r]
    if not evaluated:
        return {}
    final = evaluated[-1]
    return {**{k: v for k, v in final.items() if k.startswith("eval_")}, "eval_step": final["step"]}


def _export(plan: RunPlan) -> str | None:
    """Merge the final stage weights into an HF checkpoint directory `<out>/export` (None for custom models)."""
    architecture = plan.spec.extras.get("architecture")
    if architecture is None:
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would interleave with the launcher's output
    out = Path(plan.cfg.out)
    states = [torch.load(out / "checkpoints" / "final" / f"stage-{k}.pt", weights_only=True) for k in range(plan.cfg.pp)]
    tokenizer = export_tokenizer(plan.cfg.task, plan.cfg.data, tokenizer_directory(plan.cfg.model), plan.cfg.vocab_size)
    try:
        with writing(out / "export", sum(t.numel() * t.element_size() for s in states for t in s.values())):
            path = export_hf(states, plan.bounds, architecture, plan.spec.extras["hf_config"], out / "export",
                             tokenizer, plan.dataset.label_names)
    except DiskFullError:
        shutil.rmtree(out / "export", ignore_errors=True)  # a partial export must not look like a model
        raise
    return str(path)


def _print_eval(step: int, result: dict) -> None:
    parts = [f"eval after step {step}: loss {result['loss']:.4f}"]
    if "accuracy" in result:
        parts.append(f"accuracy {result['accuracy']:.4f}, MCC {result['mcc']:.4f}")
    if "perplexity" in result:
        parts.append(f"perplexity {result['perplexity']:.2f}")
    print(", ".join(parts), file=sys.stderr, flush=True)


def save_stage_weights(module: torch.nn.Module, out: Path, stage: int) -> Path:
    """Write one stage's final weights to checkpoints/final/stage-<k>.pt (load with weights_only=True)."""
    directory = out / "checkpoints" / "final"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"stage-{stage}.pt"
    save_atomic(path, lambda f: torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, f))
    return path


def _prefetch(store: PrefetchingStore, grid: Grid, ids: list[int]) -> None:
    """Read ahead the m(ξ) this rank will need for `ids`: its outgoing link's sender side, incoming link's receiver side."""
    if not grid.is_last_stage:
        store.prefetch(grid.stage, "send", ids)
    if not grid.is_first_stage:
        store.prefetch(grid.stage - 1, "recv", ids)


def _open_outputs(cfg: RunConfig, plan: RunPlan, first_step: int) -> MetricsLog:
    """config.json, and the metrics log (a resumed run keeps the records up to its checkpoint)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resolved = cfg.to_dict()
    resolved["stage_bounds"] = plan.bounds
    write_json(out / "config.json", resolved)
    return MetricsLog(out, kept_records(out, first_step) if first_step else [])


def _gather_step(stats: StepStats, grid: Grid, cfg: RunConfig, step: int, steps_per_epoch: int, lr: float,
                 step_seconds: float, device: torch.device) -> dict:
    """Collect every rank's numbers of this step on rank 0 and combine them into one metrics record."""
    mine = torch.tensor([float(getattr(stats, f)) for f in _STAT_FIELDS] + [step_seconds], dtype=torch.float64)
    rows = gather_rows(mine, grid, device)
    if rows is None:
        return {}
    col = {name: rows[:, i] for i, name in enumerate(_STAT_FIELDS + ("step_seconds",))}
    last_stage = [grid.rank_of(cfg.pp - 1, r) for r in range(cfg.dp)]
    loss = float(col["loss_sum"][last_stage].sum()) / (cfg.micro_batches * cfg.dp)
    slowest = float(col["step_seconds"].max())

    def per_link(name: str, offset: int) -> list[float]:
        """Summed over replicas, for link k (stage k → k+1), of the number kept by stage k + offset (activations
        are sent by stage k and received by k+1; gradients the other way)."""
        return [float(sum(col[name][grid.rank_of(k + offset, r)] for r in range(cfg.dp))) for k in range(cfg.pp - 1)]

    def rates(direction: str, receiver_offset: int) -> list[float]:
        """Achieved bytes/s of each link in one direction while a message body was on the wire."""
        moved, seconds = per_link(f"{direction}_recv_bytes", receiver_offset), per_link(f"{direction}_recv_seconds", receiver_offset)
        return [b / s if s > 0 else 0.0 for b, s in zip(moved, seconds)]

    fwd_elements, bwd_elements = int(col["fwd_elements"].sum()), int(col["bwd_elements"].sum())
    return {
        "step": step + 1,
        "epoch": step // steps_per_epoch,
        "loss": loss,
        "lr": lr,
        "grad_norm": float(col["grad_norm"][0]),
        "samples_per_second": cfg.samples_per_step * cfg.dp / slowest,
        "step_seconds": slowest,
        "fwd_bytes": int(col["fwd_bytes"].sum()),
        "bwd_bytes": int(col["bwd_bytes"].sum()),
        "grad_sync_bytes": int(col["grad_sync_bytes"].sum()),
        "link_fwd_bytes": [int(b) for b in per_link("fwd_bytes", 0)],
        "link_bwd_bytes": [int(b) for b in per_link("bwd_bytes", 1)],
        "link_fwd_wire_seconds": per_link("fwd_recv_seconds", 1),
        "link_bwd_wire_seconds": per_link("bwd_recv_seconds", 0),
        "link_fwd_bytes_per_second": rates("fwd", 1),
        "link_bwd_bytes_per_second": rates("bwd", 0),
        "fwd_bytes_per_element": int(col["fwd_bytes"].sum()) / fwd_elements if fwd_elements else 0.0,
        "bwd_bytes_per_element": int(col["bwd_bytes"].sum()) / bwd_elements if bwd_elements else 0.0,
        "store_hits": int(col["store_hits"].sum()),
        "store_misses": int(col["store_misses"].sum()),
        "store_reseeded": int(col["store_reseeded"].sum()),
        "store_overflow": int(col["store_overflow"].sum()),
        "compute_seconds": float(col["compute_seconds"].max()),
        "comm_wait_seconds": float(col["comm_wait_seconds"].max()),
        "stage_compute_seconds": [float(col["compute_seconds"][grid.rank_of(s, 0)]) for s in range(cfg.pp)],
        "stage_comm_wait_seconds": [float(col["comm_wait_seconds"][grid.rank_of(s, 0)]) for s in range(cfg.pp)],
        "stage_forward_seconds": [float(col["forward_seconds"][grid.rank_of(s, 0)]) for s in range(cfg.pp)],
        "stage_backward_seconds": [float(col["backward_seconds"][grid.rank_of(s, 0)]) for s in range(cfg.pp)],
    }


def _print_progress(record: dict, total: int) -> None:
    """A plain progress line every so often when no launcher draws a progress bar (torchrun, DeepSpeed)."""
    if os.environ.get("AQPIPE_EVENTS") == "1":
        return
    every = max(1, total // 20)
    if record["step"] % every == 0 or record["step"] == total:
        print(f"step {record['step']}/{total}  loss {record['loss']:.4f}  {record['samples_per_second']:.1f} samples/s",
              file=sys.stderr, flush=True)
