"""The capacity plan: what every stage of a run will hold and send, worked out before anything trains.

Per stage: parameters, gradients and optimizer state (fp32 master weights; only what trains has gradients and
optimizer state), the activations held for backward under the chosen schedule, precision and recompute, and the
m(ξ) store it keeps, and the bytes its replicas' grad sync sends per step; per link: the payload bytes per step each
way with the chosen codecs; and the time a link of `--bandwidth` needs for them. `aqpipe launch --dry-run` prints it
(`aqpipe.runtime.capacity.table`); a launch whose plan does not fit the device, or whose steps the wire alone keeps
longer than --stall-timeout, is refused with those numbers.

What a stage holds is traced, not guessed (`aqpipe.runtime.capacity.stage_trace`); what its codecs' CUDA graphs hold is
measured on the meta device (`aqpipe.runtime.capacity.codec_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aqpipe.compress.gpu import cuda_graphs
from aqpipe.compress.grad.qadam import freeze_step
from aqpipe.compress.grad.registry import gloo_gpu_copies, sync_copies, sync_step_bytes
from aqpipe.compress.grad.wire import FIRST_STEPS, PERIODIC, SyncBytes, ring_all_reduce_bytes
from aqpipe.compress.link.base import numel
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CodecError
from aqpipe.config import ConfigError, ResolvedConfig
from aqpipe.metrics import kept_records
from aqpipe.pipeline.links.tied_deltas import RowDeltas
from aqpipe.pipeline.links.tied_rows import step_rows
from aqpipe.pipeline.links.transport import HEADER_SIZE
from aqpipe.pipeline.numerics.tied import added_in_order, row_tables, tied_groups
from aqpipe.pipeline.vocab.tied_exchanges import TiedExchange
from aqpipe.pipeline.world.grid import Grid
from aqpipe.runtime import plan as run_plan
from aqpipe.runtime.capacity.codec_graphs import stage_graph_bytes
from aqpipe.runtime.capacity.eval_passes import EvalNeeds, eval_needs
from aqpipe.runtime.capacity.links import FIRST_EPOCH, STEADY, STEP_PHASES, WARM_UP, LinkNeeds, link_needs
from aqpipe.runtime.capacity.rows import row_shapes
from aqpipe.runtime.capacity.stage_trace import TraceError, micro_batches_held, state_copies, trace_stages
from aqpipe.runtime.capacity.step_wire import RankTraffic, least_step_seconds, links_seconds, rank_traffic
from aqpipe.runtime.checkpoints.parts import latest_step
from aqpipe.runtime.plan import RunPlan, store_headroom
from aqpipe.storage.dtypes import STORE_DTYPES


@dataclass
class StageNeeds:
    """What one rank of a stage holds."""

    stage: int
    layers: tuple[int, int]
    parameters: int
    trainable: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes_per_micro_batch: int
    micro_batches_held: int
    store_bytes: int = 0  # the m(ξ) sides this rank keeps (bytes of values; on disk under lmdb, with its headroom and journals)
    store_where: str = "RAM"  # RAM (--store memory), GPU (--store-device cuda) or disk (--store lmdb)
    codec_bytes: int = 0  # what its codecs' CUDA graphs hold on its GPU for the run (`aqpipe.runtime.capacity.codec_graphs`)
    # what the replicas' grad sync holds in the stage's device memory (`registry.sync_copies`): from step to step, and
    # at its peak while it runs after the step's backward passes (activations freed); under gloo on a GPU only the
    # flat gradient and its result, the rest staged in host RAM ("RAM")
    sync_kept_bytes: int = 0
    sync_peak_bytes: int = 0
    sync_where: str = "device"
    synced_shapes: list[tuple[int, ...]] = field(default_factory=list)  # what its replicas' grad sync exchanges
    sync: SyncBytes = SyncBytes(0, 0)  # what that sends per step (`aqpipe.compress.grad.wire`)

    @property
    def activation_bytes(self) -> int:
        """The most activation bytes held for backward at once in a step."""
        return self.activation_bytes_per_micro_batch * self.micro_batches_held

    @property
    def memory_bytes(self) -> int:
        """The most that lives at once in the memory of the device the stage computes on (a store in host RAM counts
        there only on the CPU): the activations held for backward with the grad sync's kept state, or the grad sync
        at its peak, whichever is more."""
        model = self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.codec_bytes
        held = max(self.activation_bytes + self.sync_kept_bytes, self.sync_peak_bytes)
        return model + held + (self.store_bytes if self.store_where == "GPU" else 0)


@dataclass
class TiedNeeds:
    """What keeping tied tables one tensor sends per optimizer step of one replica (both directions, all ranks)."""

    how: str  # "rows" (between the first and the last stage) or "dense" (an all-reduce over the pipeline)
    step_bytes: int
    table_bytes: int  # the tables' size, fp32
    distinct_tokens: float = 0.0  # rows: the mean distinct tokens per step over the first steps of the data order
    row_bytes: int = 0  # of `step_bytes`, the rows and gradient rows between the first and the last stage (the rest:
    # the all-reduces of copies kept whole, spread evenly over the pipeline's ranks)


@dataclass
class CapacityPlan:
    """The plan of one run, and whatever does not fit."""

    cfg: ResolvedConfig
    stages: list[StageNeeds]
    links: list[LinkNeeds]
    tied: TiedNeeds | None = None  # a tied table split over stages (None: none, or its copies share one stage)
    available: dict[str, int] = field(default_factory=dict)  # "RAM", "disk", "cuda:0", … -> free bytes
    problems: list[str] = field(default_factory=list)
    steps: int = 0  # the run's optimizer steps, and its epochs' length
    steps_per_epoch: int = 1
    evaluation: EvalNeeds | None = None  # the held-out passes' link bytes (None: the run never evaluates)

    @property
    def bandwidth_bits(self) -> int | None:
        """The rate every link runs at, --bandwidth (None: unshaped)."""
        return self.cfg.bandwidth_bits

    def run_link_bytes(self) -> tuple[int, int]:
        """Payload bytes over the whole run on every link of one replica: (sent, what lossless links would send —
        fp32, or the activations' own bf16/fp16 under mixed precision)."""
        sent = sum(sum(link.run_bytes(self.steps, self.steps_per_epoch, self.cfg.warmup_epochs)) for link in self.links)
        lossless = sum(self.steps * (link.warmup_fwd_bytes + link.warmup_bwd_bytes) for link in self.links)
        return sent, lossless

    def fixed_shape_bytes(self) -> int:
        """What lossless links sending every padded position (a fixed-shape pipeline's) would move over the run on
        the links of one replica; 0 where the links send every position anyway."""
        return self.steps * sum(link.padded_bytes for link in self.links)

    def link_seconds(self, link: LinkNeeds, phase: str = STEADY) -> tuple[float, float] | None:
        """Seconds on the wire per step (forward, backward) at --bandwidth in a phase of the run (STEP_PHASES); None
        without a bandwidth."""
        if self.bandwidth_bits is None:
            return None
        fwd, bwd = link.phase_bytes(phase)
        return 8 * fwd / self.bandwidth_bits, 8 * bwd / self.bandwidth_bits

    def link_bound_step_seconds(self, phase: str = STEADY) -> float | None:
        """The least step time the links alone allow (activations, gradients and a tied table's rows; every rank
        behind a link of its own: `aqpipe.runtime.capacity.step_wire`); 0 for a single stage, None without a bandwidth."""
        if self.bandwidth_bits is None:
            return None
        return links_seconds(self.rank_traffic(phase), self.bandwidth_bits, self.cfg.schedule != "gpipe")

    def rank_traffic(self, phase: str = STEADY) -> list[RankTraffic]:
        """What each stage's rank (of one replica) sends and receives per step in a phase of the run."""
        return rank_traffic([link.phase_bytes(phase) for link in self.links], self.tied.row_bytes // 2 if self.tied else 0)

    def sync_seconds(self, costliest: bool = False) -> float | None:
        """Seconds on the wire at --bandwidth of the slowest stage's grad sync in a step (in its costliest step with
        `costliest`); None without a bandwidth."""
        if self.bandwidth_bits is None:
            return None
        return max((8 * (s.sync.costliest if costliest else s.sync.steady) / self.bandwidth_bits
                    for s in self.stages), default=0.0)

    def step_wire_seconds(self, phase: str = STEADY, costliest_sync: bool = False) -> float | None:
        """The least step time the wire allows at --bandwidth in a phase of the run (`wire_bound`); None without a
        bandwidth."""
        bound = self.wire_bound(phase, costliest_sync)
        return None if bound is None else bound[0]

    def wire_bound(self, phase: str = STEADY, costliest_sync: bool = False) -> tuple[float, float] | None:
        """(The least step time the wire allows at --bandwidth in a phase of the run, the grad sync's seconds in it):
        each rank's link traffic up to its last backward pass, then its stage's grad sync (after the pipeline's tied
        copies kept whole are summed), or the links' traffic alone, whichever is longest
        (`aqpipe.runtime.capacity.step_wire`); in the grad sync's costliest step with `costliest_sync`. None without a
        bandwidth."""
        if self.bandwidth_bits is None:
            return None
        syncs = [stage.sync.costliest if costliest_sync else stage.sync.steady for stage in self.stages]
        pipeline = (self.tied.step_bytes - self.tied.row_bytes) // self.cfg.pp if self.tied else 0
        return least_step_seconds(self.rank_traffic(phase), self.bandwidth_bits, self.cfg.schedule != "gpipe", syncs,
                                  pipeline)

    def phases_ahead(self, first_step: int = 0) -> list[str]:
        """The phases (STEP_PHASES) the run's steps from `first_step` on go through."""
        cfg, per_epoch = self.cfg, self.steps_per_epoch
        warm = cfg.warmup_epochs * per_epoch
        ahead = [WARM_UP] if first_step < min(warm, self.steps) else []
        lossy_from = max(first_step, warm)
        if lossy_from < self.steps and cfg.warmup_epochs == 0 and cfg.keeps_messages and lossy_from < per_epoch:
            ahead.append(FIRST_EPOCH)  # every sample a first sight (a warm-up seeds m(xi) instead)
            lossy_from = per_epoch
        return ahead + ([STEADY] if lossy_from < self.steps else [])


def plan_capacity(plan: RunPlan) -> CapacityPlan:
    """The capacity plan of a resolved run (bounds known); a ConfigError where a link's codec cannot code the
    stages' activations (TAH-Quant's 64-channel tiles on another width)."""
    try:
        return _plan_capacity(plan)
    except CodecError as e:
        raise ConfigError(str(e)) from None


def _plan_capacity(plan: RunPlan) -> CapacityPlan:
    cfg = plan.cfg
    try:
        traced = trace_stages(plan)
    except Exception as e:  # noqa: BLE001 - whatever a custom model's forward raises on fake tensors
        raise TraceError(f"the stages could not be traced with fake tensors: {e}") from e
    options = QuantOptions.of(cfg)
    m = cfg.micro_batches
    samples_per_replica = -(-len(plan.dataset.train) // cfg.dp)
    store = STORE_DTYPES[cfg.store_dtype]
    rows = row_shapes(plan)
    links = [link_needs(cfg, k, traced[k].output_shape, traced[k].output_dtype, rows, options,
                        samples_per_replica * store.value_bytes) for k in range(cfg.pp - 1)]
    copies, (kept, peak) = state_copies(cfg), sync_copies(cfg.grad_spec, cfg.dp)
    sync_where = "RAM" if cfg.device == "cuda" and not gpu_each(cfg) else "device"
    if sync_where == "RAM" and peak:  # staged through the host: on the GPU, the flat gradient and its result
        kept, peak = 0.0, gloo_gpu_copies(cfg.grad_spec)
    headroom = store_headroom(cfg, samples_per_replica)
    stages = []
    link_shapes = [link.activation_shape for link in links]
    for s, trace in enumerate(traced):
        (params, trainable), act, shapes = trace.counts, trace.activation_bytes, trace.synced_shapes
        held = sum(numel(shape) for shape in shapes)  # what its optimizer and grad sync hold (not a row cache)
        sides = [links[k].store_side_bytes for k in (s - 1, s) if 0 <= k < cfg.pp - 1]
        stages.append(StageNeeds(
            s, (plan.bounds[s], plan.bounds[s + 1]), params, trainable, 4 * params, 4 * trainable,
            4 * copies * held, act, micro_batches_held(cfg.schedule, s, cfg.pp, m),
            int(sum(sides) * headroom), store_where(cfg), stage_graph_bytes(cfg, s, link_shapes),
            int(4 * kept * held), int(4 * peak * held), sync_where, shapes,
            sync_step_bytes(cfg.grad_spec, cfg.dp, shapes, freeze_step(plan.total_steps, cfg.warmup_steps))))
    capacity = CapacityPlan(cfg, stages, links, tied_needs(plan), steps=plan.total_steps, steps_per_epoch=plan.steps_per_epoch,
                            evaluation=eval_needs(plan, [(link.activation_shape, link.activation_dtype)
                                                         for link in links], options, rows))
    check_fits(capacity)
    return capacity


def tied_needs(plan: RunPlan, sampled_steps: int = 8) -> TiedNeeds | None:
    """Bytes per step one replica sends for its tied tables: with `--tied-exchange rows`, a table's looked-up rows
    and their gradient (`aqpipe.pipeline.links.tied_rows`), counted on the first `sampled_steps` steps of the real data
    order; otherwise a ring all-reduce of every table over the pipeline (every rank sends 2·(pp−1)/pp of it), and
    with replicas a second after the sync, where the copies re-agree (an all-gather, (pp−1) times the table from
    every rank, where three copies or more are added in stage order: `tied.added_in_order`)."""
    cfg = plan.cfg
    groups = tied_groups(plan.spec.extras)
    if cfg.pp < 2 or plan.lora is not None or not groups:
        return None
    by_rows = set(row_tables(plan.spec.extras, cfg.pp, cfg.tied_spec))
    table_bytes = {g.name: 4 * sum(numel(shape) for shape in g.shapes) for g in groups}
    dense = sum(dense_tied_bytes(table_bytes[g.name], cfg.pp, cfg.dp, added_in_order(g))
                for g in groups if g.name not in by_rows)
    if not by_rows:
        return TiedNeeds("dense", dense, sum(table_bytes.values()))
    epochs = plan.epoch_plan(0)
    counts = [len(step_rows([plan.dataset.train.inputs(ids) for ids in epochs.micro_batches_of(step)]))
              for step in range(min(sampled_steps, plan.total_steps))]
    distinct = sum(counts) / max(1, len(counts))
    widths = [g.shapes[0][1] for g in groups if g.name in by_rows]
    # the rows and the gradient's rows, `distinct` each with their indices, streamed as a message per micro-batch
    rows = sum(2 * (round(distinct) * (row_wire_bytes(cfg.tied_spec, width) + 8) + cfg.micro_batches * HEADER_SIZE)
               for width in widths)
    return TiedNeeds("rows", rows + dense, sum(table_bytes.values()), distinct, rows)


def row_wire_bytes(exchange: TiedExchange, width: int) -> int:
    """Bytes one row of `width` takes on the wire under a row exchange (a delta-coded one: a change the copies
    already vouch for, with its mode byte)."""
    if exchange.delta_bits:
        return RowDeltas(exchange.delta_bits, width).row_bytes() + 1
    return getattr(torch, exchange.wire_dtype).itemsize * width


def dense_tied_bytes(table_bytes: int, pp: int, dp: int, in_order: bool = False) -> int:
    """What one replica's pipeline sends a step to keep a tied table whole by summing its copies' gradients: an
    all-reduce, and with replicas another after the sync (an all-gather where the copies re-agree `in_order`)."""
    ring = ring_all_reduce_bytes(table_bytes, pp) * pp
    if dp == 1:
        return ring
    return ring + ((pp - 1) * table_bytes * pp if in_order else ring)


def gpu_each(cfg: ResolvedConfig) -> bool:
    """Whether each rank of a CUDA run has a GPU of this machine to itself, as the plan maps them (rank mod GPUs):
    its collectives then run on NCCL, with the grad sync's tensors on the GPU."""
    return 0 < cfg.world_size <= torch.cuda.device_count()


def store_where(cfg: ResolvedConfig) -> str:
    """Where the m(ξ) stores of a run live: RAM, GPU or disk."""
    if cfg.store == "lmdb":
        return "disk"
    return "GPU" if cfg.store_device == "cuda" else "RAM"


def check_fits(capacity: CapacityPlan) -> None:
    """Fill in what the machine offers and what does not fit it: the host's RAM for every local rank on the CPU
    (memory stores included), each GPU's free memory for the ranks sharing it."""
    cfg = capacity.cfg
    replicas = cfg.dp
    if cfg.device == "cpu":
        needed = replicas * sum(s.memory_bytes + (s.store_bytes if s.store_where == "RAM" else 0) for s in capacity.stages)
        free = run_plan.available_memory()  # (looked up at the call: one definition of the RAM on offer)
        capacity.available["RAM"] = free
        if needed > free:
            capacity.problems.append(f"the {cfg.world_size} ranks need about {human_bytes(needed)} of RAM (weights, gradients, "
                                     f"optimizer state, activations{', m(xi) stores' if cfg.store == 'memory' else ''}"
                                     f"{_sync_part(capacity)}) but {human_bytes(free)} is available")
        return
    gpus = torch.cuda.device_count()
    if gpus == 0:
        capacity.problems.append("--device cuda, but this machine shows no GPU")
        return
    per_gpu: dict[int, list[int]] = {}
    for rank in range(cfg.world_size):  # a rank runs on cuda:(local rank mod GPUs), like the worker's device
        per_gpu.setdefault(rank % gpus, []).append(capacity.stages[Grid(cfg.pp, cfg.dp, rank).stage].memory_bytes)
    for gpu, ranks in sorted(per_gpu.items()):
        free, known = gpu_free_bytes(gpu)
        needed = gpu_bytes_needed(ranks)
        capacity.available[f"cuda:{gpu}"] = free
        if needed > free:
            capacity.problems.append(
                f"cuda:{gpu} would hold about {human_bytes(needed)} (weights, gradients, optimizer state, activations"
                f"{', m(xi) stores' if cfg.store_device == 'cuda' else ''}"
                f"{', codec CUDA graphs' if cuda_graphs.enabled() else ''}{_sync_part(capacity)} of its "
                f"{len(ranks)} rank(s), with "
                f"{human_bytes(CUDA_CONTEXT_BYTES)} of CUDA context each and {ALLOCATOR_HEADROOM - 1:.0%} for the caching "
                f"allocator) but has {human_bytes(free)} {'free' if known else 'in all (free memory unknown: no pynvml)'}")


def _sync_part(capacity: CapacityPlan) -> str:
    """The grad sync's mention in a does-not-fit message, where the plan counts it with the stage's tensors."""
    return ", grad sync" if any(s.sync_peak_bytes for s in capacity.stages) else ""


# What a rank's process takes on its GPU beyond its tensors: the CUDA context with cuBLAS/cuDNN workspaces (about
# 0.5-0.7 GB on Hopper with torch 2.x), and the caching allocator's rounding and fragmentation.
CUDA_CONTEXT_BYTES = 640 << 20
ALLOCATOR_HEADROOM = 1.15


def gpu_bytes_needed(rank_bytes: list[int]) -> int:
    """Device memory the ranks sharing one GPU need: their tensors with the allocator's headroom, and a CUDA context
    each."""
    return sum(int(b * ALLOCATOR_HEADROOM) + CUDA_CONTEXT_BYTES for b in rank_bytes)


def gpu_free_bytes(gpu: int) -> tuple[int, bool]:
    """(bytes free on `gpu`, whether that is its free memory) — as NVML reports it, which needs no CUDA context in
    this launcher (a context would itself take memory, and a process that forks ranks must not hold one); the total
    when NVML cannot be asked."""
    total = int(torch.cuda.get_device_properties(gpu).total_memory)
    try:
        return total - int(torch.cuda.device_memory_used(gpu)), True
    except Exception:  # noqa: BLE001 - no pynvml, or NVML unavailable: the total is what is known
        return total, False


def human_bytes(n: float) -> str:
    """Bytes for people: kB, MB, GB or TB with three significant figures or so."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def refuse_if_unfit(plan: RunPlan, first_step: int | None = None) -> CapacityPlan | None:
    """Raise ConfigError with the plan's numbers when the run cannot fit (a resume's steps from the checkpoint of
    `first_step` on: by default its newest); the plan (None when a custom model cannot be traced with fake tensors:
    then nothing is refused)."""
    try:
        capacity = plan_capacity(plan)
    except TraceError:  # a custom model the fake tracer cannot run is trained without a plan
        return None
    if capacity.problems:
        raise ConfigError("the run does not fit: " + "; ".join(capacity.problems)
                          + f" (per stage in memory: {', '.join(human_bytes(s.memory_bytes) for s in capacity.stages)}; "
                          "see aqpipe launch ... --dry-run)")
    problem = steps_outlasting_the_stall_timeout(capacity, first_step)
    if problem is not None:
        raise ConfigError(problem)
    return capacity


def steps_outlasting_the_stall_timeout(capacity: CapacityPlan, first_step: int | None = None) -> str | None:
    """What is wrong when, at --bandwidth, the links and the grad sync alone keep a step the run has still to take (a
    resume's from the checkpoint of `first_step` on: by default its newest) as long as --stall-timeout or longer
    (None: nothing): the launcher's stall clock and every collective of a training step give up after it, so the run
    would fail at its first such step."""
    cfg = capacity.cfg
    if first_step is None:
        first_step = (latest_step(cfg.resume) or 0) if cfg.resume else 0
    # fp16: a step whose gradients overflowed skipped the grad sync, whose first steps count the syncs it ran
    skipped = sum(bool(r.get("skipped")) for r in kept_records(cfg.resume, first_step)) if cfg.resume and first_step else 0
    syncs = [s.sync for s in capacity.stages]
    periodic = any(sync.costliest_when == PERIODIC for sync in syncs)
    costly_first = any(sync.costliest_when == FIRST_STEPS and first_step - skipped < sync.costly_steps for sync in syncs)
    bounds = []
    for i, phase in enumerate(capacity.phases_ahead(first_step)):
        # the grad sync's costliest step: Marsit's full-precision ones come in every phase, fp32 first steps in the
        # phase the run (or its resume) begins in
        costliest = periodic or (costly_first and i == 0)
        bound = capacity.wire_bound(phase, costliest)
        if bound is not None:
            bounds.append((*bound, phase, costliest))
    if not bounds or max(bounds)[0] < cfg.stall_timeout:
        return None
    seconds, sync, phase, costliest = max(bounds)
    what = "the links alone need" if not sync else "the links and the grad sync alone need"
    when = (" in its full-precision steps" if periodic else " in its first steps (fp32)") if costliest else ""
    part = f" ({sync:.1f} s of it the grad sync's{when}, --grad-sync {cfg.grad_sync} at --dp {cfg.dp})" if sync else ""
    return (f"at --bandwidth {cfg.bandwidth} {what} at least {seconds:.1f} s per step{STEP_PHASES[phase]}{part}, but a "
            f"step must take less than --stall-timeout ({cfg.stall_timeout:g} s: the launcher's stall clock, and every "
            "collective's time-out while training): raise --stall-timeout well above it"
            + (", or compress the grad sync (--grad-sync)" if sync and not cfg.grad_spec.kind.compresses
               else ""))
