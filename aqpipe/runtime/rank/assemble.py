"""Assembling one rank's stage: its layers, m(ξ) store, link ends, grad sync, optimizer and worker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from aqpipe.compress.grad import DPGroup, build_grad_sync
from aqpipe.compress.grad.qadam import freeze_step
from aqpipe.compress.link.base import LinkCodec
from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CodecSpec
from aqpipe.config import ResolvedConfig
from aqpipe.pipeline.execution.worker import StageWorker
from aqpipe.pipeline.links.link_ends import ActivationIn, ActivationOut, GradientIn, GradientOut, StageLinks
from aqpipe.pipeline.links.rendezvous import startup_timeout
from aqpipe.pipeline.links.streams import open_streams
from aqpipe.pipeline.links.tied_deltas import RowDeltas
from aqpipe.pipeline.links.tied_rows import LOOKUP, OWNER, RowExchange, table_parameter
from aqpipe.pipeline.links.transport import KIND_ACTIVATION, KIND_GRADIENT, SIDE_MASK, SIDE_RESEED, Inbox, Outbox
from aqpipe.pipeline.numerics.mixed_precision import LossScaler, needs_loss_scaling
from aqpipe.pipeline.numerics.optim import build_optimizer, momenta
from aqpipe.pipeline.numerics.tied import row_tables, tied_groups
from aqpipe.pipeline.world.grid import Grid, ProcessGroups, collective_device, create_groups
from aqpipe.runtime.checkpoints.store import Checkpoints
from aqpipe.runtime.plan import RunPlan, store_bytes_per_rank
from aqpipe.storage import MemoryStore, SlabStore, StoreView, memory_store
from aqpipe.storage.encoding import value_dtype
from aqpipe.storage.lmdb_store import LMDBStore, store_path
from aqpipe.storage.prefetch import PrefetchingStore


@dataclass
class RankStage:
    """Everything one rank trains with."""

    plan: RunPlan
    grid: Grid
    groups: ProcessGroups
    device: torch.device
    store: MemoryStore | SlabStore | PrefetchingStore
    worker: StageWorker
    checkpoints: Checkpoints | None = None  # its checkpoints: written here, copied to other hosts


def open_store(cfg: ResolvedConfig, rank: int, estimate: int | None = None, device: torch.device | None = None,
               samples: int | None = None) -> MemoryStore | SlabStore | PrefetchingStore:
    """This rank's m(ξ) store: in memory (on the host, or on the stage's GPU with --store-device cuda, as slabs
    sized for the `samples` its replica sees), or an LMDB environment under the run directory, its map sized from
    the estimate when there is one (it grows on demand either way)."""
    if cfg.store == "lmdb":
        cap = int(cfg.store_max_gb * 1e9) if cfg.store_max_gb is not None else None
        initial = min(estimate or (64 << 20), cap or (1 << 62))
        return PrefetchingStore(LMDBStore(store_path(cfg.out, rank), cfg.store_dtype, max_bytes=cap,
                                          initial_map_bytes=max(initial, 1 << 20)))
    on_gpu = device is not None and device.type == "cuda" and cfg.store_device == "cuda"
    return memory_store(value_dtype(cfg.store_dtype), device if on_gpu and device is not None else "cpu", samples)


def stream_name(replica: int, link: int, direction: str) -> str:
    """The name of one direction's stream: unique in the world, checked when the sender connects."""
    return f"replica {replica} link {link} {direction}"


def open_links(cfg: ResolvedConfig, grid: Grid, groups: ProcessGroups, store, device: torch.device,
               module: nn.Module | None = None, row_names: list[str] | None = None) -> StageLinks:
    """This rank's link ends, one per direction of each adjacent link, each on a stream of its own (every rank of
    the pipeline calls this together); the forward ones of an AQ-SGD link hold the side of m(ξ)
    `grid.owned_sides()` gives this rank. With `row_names` (a tied table exchanged by rows), the first and the
    last stage also open a stream each way between them and hold their end of the exchange (`links.tied_rows`)."""
    options = QuantOptions.of(cfg, grid.rank)
    check = cfg.store_check == "on"
    views = {side: StoreView(store, link, side) for link, side in grid.owned_sides()}
    before, after = grid.link_in, grid.link_out  # the links this rank's stage sits between (None at an end)
    names = {(link, d): stream_name(grid.replica, link, d) for link in (before, after) if link is not None
             for d in ("activation", "gradient")}
    inbound = ([names[(before, "activation")]] if before is not None else []) + \
              ([names[(after, "gradient")]] if after is not None else [])
    outbound = ([names[(before, "gradient")]] if before is not None else []) + \
               ([names[(after, "activation")]] if after is not None else [])
    tied_names = {d: f"replica {grid.replica} tied {d}" for d in ("rows", "grads")}
    exchanges = bool(row_names) and (grid.is_first_stage or grid.is_last_stage)
    if exchanges:  # rows go from the last stage (the owner) to the first (the lookup side), gradient rows back
        (inbound if grid.is_first_stage else outbound).append(tied_names["rows"])
        (outbound if grid.is_first_stage else inbound).append(tied_names["grads"])
    streams = open_streams(inbound, outbound, groups.pipeline, cfg.stall_timeout)
    links = StageLinks()
    if exchanges:
        assert module is not None and row_names, "a row exchange needs the stage module and its table's name"
        if len(row_names) > 1:
            raise ValueError(f"one tied table can be exchanged by rows, the model declares {len(row_names)}: {row_names}")
        first = grid.is_first_stage
        peer = grid.describe(grid.rank_of(grid.pp - 1 if first else 0, grid.replica))
        name, table = table_parameter(module, row_names[0])
        bits = cfg.tied_spec.delta_bits
        links.tied_rows = RowExchange(
            LOOKUP if first else OWNER, name, table,
            # a step's messages all queue at once (one per micro-batch), so neither end waits on the link to go on
            outbox=Outbox(streams[tied_names["grads" if first else "rows"]], peer, cfg.stall_timeout,
                          queue_size=cfg.micro_batches + 1),
            inbox=Inbox(streams[tied_names["rows" if first else "grads"]], peer, cfg.stall_timeout, device),
            wire_dtype=getattr(torch, cfg.tied_spec.wire_dtype),
            deltas=RowDeltas(bits, table.shape[1]) if bits else None)
    if before is not None:  # link stage - 1: activations in, gradients out
        peer = grid.describe(grid.prev_rank)
        links.act_in = ActivationIn(before, KIND_ACTIVATION,
                                    build_codec(cfg.fw_spec, "fw", views["recv"], options, check, device,
                                                cfg.first_sight_spec),
                                    Inbox(streams[names[(before, "activation")]], peer, cfg.stall_timeout, device), device,
                                    cfg.micro_batch_size, (SIDE_MASK,),
                                    eval_codec=evaluation_codec(cfg.eval_spec, options, device))
        links.grad_out = GradientOut(before, KIND_GRADIENT, build_codec(cfg.bw_spec, "bw", options=options, device=device),
                                     Outbox(streams[names[(before, "gradient")]], peer, cfg.stall_timeout),
                                     real_rows=cfg.link_rows == "real")
    if after is not None:  # link stage: activations out, gradients in
        peer = grid.describe(grid.next_rank)
        links.act_out = ActivationOut(after, KIND_ACTIVATION,
                                      build_codec(cfg.fw_spec, "fw", views["send"], options, check, device,
                                                  cfg.first_sight_spec),
                                      Outbox(streams[names[(after, "activation")]], peer, cfg.stall_timeout),
                                      real_rows=cfg.link_rows == "real",
                                      eval_codec=evaluation_codec(cfg.eval_spec, options, device))
        links.grad_in = GradientIn(after, KIND_GRADIENT, build_codec(cfg.bw_spec, "bw", options=options, device=device),
                                   Inbox(streams[names[(after, "gradient")]], peer, cfg.stall_timeout, device), device,
                                   cfg.micro_batch_size, (SIDE_RESEED,))
    return links


def evaluation_codec(spec: CodecSpec, options: QuantOptions, device: torch.device) -> LinkCodec:
    """The codec of one end of a link's held-out activations: `spec` rounding to nearest, so an evaluation's numbers
    depend on the weights alone (never on random draws a checkpoint does not keep)."""
    return build_codec(spec, "fw", options=dataclasses.replace(options, stochastic=False), device=device)


def assemble_stage(plan: RunPlan, grid: Grid, device: torch.device, backend: str) -> RankStage:
    """Build this rank's stage from the run plan (every rank of the world calls it: it creates process groups)."""
    cfg = plan.cfg
    groups = create_groups(grid, backend, startup_timeout(cfg.stall_timeout))
    samples = len(plan.dataset.train)
    # (over real rows a padded sample's m(ξ) is its own length, each length a slab of its own: none is sized for
    # every sample up front, each grows with the samples it holds)
    padded = cfg.link_rows == "padded" or plan.dataset.train.mask(torch.arange(min(1, samples))) is None
    store = open_store(cfg, grid.rank, store_bytes_per_rank(cfg, plan.spec, samples), device,
                       samples // cfg.dp if padded else None)
    module = plan.build_stage(grid.stage).to(device)
    dp_group = DPGroup(groups.data_parallel, tuple(grid.dp_ranks(grid.stage)), grid.replica, collective_device(device))
    optimizer_momentum, vote_momentum = momenta(cfg.momentum, cfg.grad_spec.sign_based)
    grad_sync = build_grad_sync(cfg.grad_spec, dp_group, cfg.seed, freeze_step(plan.total_steps, cfg.warmup_steps),
                                momentum=vote_momentum)
    row_names = [] if plan.lora is not None else row_tables(plan.spec.extras, cfg.pp, cfg.tied_spec)
    links = open_links(cfg, grid, groups, store, device, module, row_names)
    rows = links.tied_rows
    cache = rows.table if rows is not None and rows.role == LOOKUP else None  # the owner's optimizer updates it
    optimizer, lr_schedule = build_optimizer(
        [p for p in module.parameters() if p.requires_grad and p is not cache], cfg.optimizer, cfg.lr, cfg.weight_decay,
        cfg.warmup_steps, plan.total_steps, grad_sync=grad_sync, momentum=optimizer_momentum,
    )
    ends = grid.is_first_stage or grid.is_last_stage
    worker = StageWorker(
        grid=grid, groups=groups, module=module, loss_fn=plan.spec.loss,
        samples=plan.dataset.train if ends else None, links=links,
        grad_sync=grad_sync, optimizer=optimizer, lr_schedule=lr_schedule, clip=cfg.clip, device=device,
        schedule=cfg.schedule, precision=cfg.precision,
        # LoRA freezes every tied table
        tied=[] if plan.lora is not None else [g for g in tied_groups(plan.spec.extras) if g.name not in row_names],
        scaler=LossScaler() if needs_loss_scaling(cfg.precision) else None,
    )
    return RankStage(plan, grid, groups, device, store, worker)
