"""The stage worker: executes one stage's instruction stream for each optimizer step."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from aqpipe.compress.gpu import cuda_graphs
from aqpipe.compress.grad import GradSync
from aqpipe.data import ClassifySamples, InstructSamples, TokenSamples
from aqpipe.pipeline import present
from aqpipe.pipeline.execution import sync_audit
from aqpipe.pipeline.execution.gpu_timing import GpuTimer
from aqpipe.pipeline.execution.held import ActivationMeter
from aqpipe.pipeline.execution.optimizer_phase import OptimizerPhase
from aqpipe.pipeline.links.link_ends import StageLinks
from aqpipe.pipeline.links.tied_rows import LOOKUP
from aqpipe.pipeline.numerics.mixed_precision import LossScaler, autocast
from aqpipe.pipeline.numerics.tied import TiedGroup
from aqpipe.pipeline.vocab import schedule as sch
from aqpipe.pipeline.vocab.step_stats import StepStats
from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import Grid, ProcessGroups, collective_device
from aqpipe.stages.spec import Stage


@dataclass
class _MicroBatch:
    ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # per-sample side information (attention mask), sent losslessly
    inputs: torch.Tensor | None = None
    outputs: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None


@dataclass
class StageWorker:
    """One stage of one replica: its layers, link ends, optimizer and grad sync; it executes its schedule's
    instruction stream once per optimizer step."""

    grid: Grid
    groups: ProcessGroups
    module: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    samples: TokenSamples | ClassifySamples | InstructSamples | None  # first and last stage only
    links: StageLinks
    grad_sync: GradSync
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LambdaLR
    clip: float
    device: torch.device
    schedule: str  # a name in aqpipe.pipeline.vocab.schedule.SCHEDULES
    tied: list[TiedGroup] = field(default_factory=list)  # parameters copied on several layers (DeBERTa)
    precision: str = "fp32"  # the compute dtype of forward and loss (aqpipe.pipeline.vocab.precisions.PRECISIONS)
    scaler: LossScaler | None = None  # fp16's dynamic loss scale
    _mbs: dict[int, _MicroBatch] = field(default_factory=dict)
    _step: int = 0
    _n: int = 1
    _weights: list[float] | None = None  # each micro-batch's share of the step's loss terms (instruction data)
    _tied_bytes_before: int = 0
    _meter: ActivationMeter = field(init=False)
    optimizer_phase: OptimizerPhase = field(init=False)

    def __post_init__(self) -> None:
        self._meter = ActivationMeter(self.module)
        self._gpu_time = GpuTimer(self.device)
        self.optimizer_phase = OptimizerPhase(
            self.grid, self.groups, self.module, self.optimizer, self.lr_schedule, self.grad_sync, self.clip,
            self.device, self.tied, self.links.tied_rows, self.scaler)

    @property
    def params(self) -> list[nn.Parameter]:
        """Every trained parameter of the stage, a looked-up tied table included (fp16: its rows, sent scaled, count
        in the overflow check)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    @property
    def _looks_rows_up(self) -> bool:
        """This stage looks rows up in a tied table whose other copy (the head) is on the last stage."""
        rows = self.links.tied_rows
        return rows is not None and rows.role == LOOKUP

    @property
    def row_cache_names(self) -> frozenset[str]:
        """The state-dict names of a tied table this stage only looks rows up in (its unused rows are stale)."""
        rows = self.links.tied_rows
        return frozenset([rows.name]) if rows is not None and rows.role == LOOKUP else frozenset()

    def run_step(self, step: int, micro_batch_ids: list[torch.Tensor], compress: bool = True,
                 next_ids: list[int] | None = None) -> StepStats:
        """Run one optimizer step over the given micro-batches (sample ids per micro-batch); with `compress`
        False (warm-up epochs) every link sends fp32 and AQ-SGD refreshes m(ξ). `next_ids` (the next step's
        samples, when it compresses) lets an AQ-SGD receiver ask for samples whose m(ξ) it lacks to be re-seeded."""
        stats = StepStats()
        n = len(micro_batch_ids)
        self._mbs = {mb: _MicroBatch(ids=ids) for mb, ids in enumerate(micro_batch_ids)}
        stream = sch.SCHEDULES[self.schedule].stream(self.grid.stage, self.grid.pp, n)
        self.links.begin_step(step, stream, compress, next_ids)
        self._meter.begin_step()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.module.train()
        self._step, self._n = step, n
        self._finite: list[tuple[torch.Tensor, torch.Tensor]] = []  # each send's finite rows and sample ids
        self._loss_sum: torch.Tensor | None = None  # the step's loss, summed on the device (read after the step)
        self._weights = self._loss_weights(micro_batch_ids) if self.grid.is_last_stage else None
        stats.loss_scale = self.scaler.scale if self.scaler is not None else 0.0
        self._tied_bytes_before = self._tied_bytes()
        if self.links.tied_rows is not None:  # a tied table's rows stream to the first stage, its gradient rows back
            assert self.samples is not None, "a first or last stage holds its samples"
            first_stage = sch.SCHEDULES[self.schedule].stream(0, self.grid.pp, n)
            self.links.tied_rows.begin(step, [self.samples.inputs(ids) for ids in micro_batch_ids],
                                       backward_order=[i.micro_batch for i in first_stage
                                                       if isinstance(i, sch.Backward) and i.micro_batch is not None])
        try:
            with sync_audit.audited(step, self.device):
                for ins in stream:
                    self._run_instruction(ins, stats)
        except Exception as error:
            self.links.settle_after(error)
            raise
        self.links.settle()  # (the step's last checksum checks: their sums are on the host by now, or nearly)
        self._mbs = {}
        for name, seconds in self._gpu_time.settle().items():  # a GPU's forward and backward time, from its events
            setattr(stats, name, getattr(stats, name) + seconds)
        report_nonfinite(self._finite, step, self.grid.stage, self.links.keeps_messages)
        stats.loss_sum = float(self._loss_sum) if self._loss_sum is not None else 0.0
        stats.tied_bytes = self._tied_bytes() - self._tied_bytes_before  # a skipped (fp16 overflow) step's rows too
        stats.peak_activation_bytes = self._meter.peak_bytes
        stats.peak_memory_bytes = peak_memory_bytes(self.device)
        stats.codec_graph_bytes = cuda_graphs.held_on(self.device)
        self._count_links(stats)
        return stats

    def _run_instruction(self, ins: sch.Instruction, stats: StepStats) -> None:
        handler, waits_on_peers = self._HANDLERS[type(ins)]
        blocked_before = self.links.blocked_seconds()
        start = time.perf_counter()
        handler(self, self._mbs[ins.micro_batch] if ins.micro_batch is not None else None, ins.micro_batch, stats)
        elapsed = time.perf_counter() - start
        # a receive waits for its peer only while its message has not arrived; decoding it (and, on a GPU, waiting
        # for work queued before it) is this stage's own time
        waited = elapsed if waits_on_peers else self.links.blocked_seconds() - blocked_before
        stats.comm_wait_seconds += waited
        stats.compute_seconds += elapsed - waited
        if type(ins) in self._MODEL_TIMERS and not self._gpu_time.enabled:  # (a GPU's are timed by its events)
            setattr(stats, self._MODEL_TIMERS[type(ins)], getattr(stats, self._MODEL_TIMERS[type(ins)]) + elapsed)

    def _loss_weights(self, micro_batch_ids: list[torch.Tensor]) -> list[float] | None:
        """With response-only targets, each micro-batch's weight in the step's loss, so that the step's loss (after the
        grad sync averages the replicas) is the mean over every response token of the step on every replica, not a
        mean of micro-batch or replica means; None for plain samples. The last stages of the replicas call this
        together (one all-reduce of the step's token count over their DP group)."""
        count = getattr(self.samples, "loss_tokens", None)
        if count is None:
            return None
        tokens = [count(ids) for ids in micro_batch_ids]
        total = torch.tensor([float(sum(tokens))], dtype=torch.float64)
        if self.grid.dp > 1:
            total = total.to(collective_device(self.device))
            comm.all_reduce(total, comm.CONTROL, group=self.groups.data_parallel)
        return [t * self.grid.dp / float(total) for t in tokens]

    def _count_links(self, stats: StepStats) -> None:
        counters = self.links.take_counters()
        stats.fwd_bytes, stats.fwd_elements = counters["fwd_sent"].payload_bytes, counters["fwd_sent"].elements
        stats.bwd_bytes, stats.bwd_elements = counters["bwd_sent"].payload_bytes, counters["bwd_sent"].elements
        stats.fwd_framing_bytes = counters["fwd_sent"].framing_bytes
        stats.bwd_framing_bytes = counters["bwd_sent"].framing_bytes
        stats.control_bytes += counters["bwd_sent"].control_bytes  # re-seed requests
        for direction in ("fwd", "bwd"):
            received = counters[f"{direction}_received"]
            setattr(stats, f"{direction}_recv_bytes", received.body_bytes)
            setattr(stats, f"{direction}_arrived_bytes", received.arrived_bytes)
            setattr(stats, f"{direction}_recv_seconds", received.wire_seconds)
        fidelity = counters["fwd_sent"].fidelity
        if fidelity is not None:  # one read per step (a GPU waits once, not per message)
            stats.aqsgd_signal, stats.aqsgd_change, stats.aqsgd_error = (float(v) for v in fidelity.squares.tolist())

    def _recv_activation(self, mb: _MicroBatch, index: int, stats: StepStats) -> None:
        mb.inputs, mb.ids, mb.mask = self.links.receive_activation()

    def _load_micro_batch(self, mb: _MicroBatch, index: int, stats: StepStats) -> None:
        samples, ids = self.samples, present(mb.ids, "sample ids")
        assert samples is not None, "a first or last stage holds its samples"
        if self.grid.is_first_stage:
            mb.inputs = samples.inputs(ids).to(self.device, non_blocking=True)  # (host tensors: staged, no wait)
            mb.mask = samples.mask(ids)
        if self.grid.is_last_stage:
            mb.targets = samples.targets(ids).to(self.device, non_blocking=True)

    def _forward(self, mb: _MicroBatch, index: int, stats: StepStats) -> None:
        if self._looks_rows_up:  # the rows this micro-batch looks up, current (waiting on the head's stage)
            start = time.perf_counter()
            present(self.links.tied_rows, "tied rows").ready(index)
            waited = time.perf_counter() - start
            stats.comm_wait_seconds += waited
            stats.compute_seconds -= waited  # the handler's whole time is counted as compute and as the forward's
            if not self._gpu_time.enabled:
                stats.forward_seconds -= waited
        if isinstance(self.module, Stage) and self.module.recompute:  # the layer inputs kept for the backward
            self.module.on_held = lambda held: self._meter.keep(index, held)
        with self._gpu_time.span("forward_seconds"), self._meter.forward(index), autocast(self.device, self.precision):
            out = self.module(present(mb.inputs, "inputs"),
                              None if mb.mask is None else mb.mask.to(self.device, non_blocking=True))
            if self.grid.is_last_stage:
                mb.loss = loss = self.loss_fn(out, present(mb.targets, "targets"))
        if self.grid.is_last_stage:  # loss_sum / micro-batches is the step's loss
            share = 1.0 if self._weights is None else self._weights[index] * self._n
            part = loss.detach().double() * share  # (float64: the sum a host float sum gave, bit for bit)
            self._loss_sum = part if self._loss_sum is None else self._loss_sum + part
        else:
            mb.outputs = out
        self._meter.keep(index, mb.outputs)

    def _send_activation(self, mb: _MicroBatch, index: int, stats: StepStats) -> None:
        outputs, ids = present(mb.outputs, "outputs"), present(mb.ids, "sample ids")
        self._finite.append((finite_rows(outputs), ids))  # read once, after the step
        self.links.send_activation(index, outputs, ids, mb.mask)

    def _recv_grad(self, mb: _MicroBatch, index: int, stats: StepStats) -> None:
        mb.output_grad = self.links.receive_gradient(mb.mask)

    def _backward(self, mb: _MicroBatch, index: int, stats: StepStats) -> None:
        scale = self.scaler.scale if self.scaler is not None else 1.0
        with self._gpu_time.span("backward_seconds"):
            if self.grid.is_last_stage and self._weights is not None:
                (present(mb.loss, "loss") * (self._weights[index] * scale)).backward()  # the mean over response tokens
            elif self.grid.is_last_stage:
                (present(mb.loss, "loss") * (scale / self._n)).backward()  # the step's loss: the mean over micro-batches
            elif (outputs := present(mb.outputs, "outputs")).requires_grad:  # (not when nothing up to here trains)
                outputs.backward(mb.output_grad)
        if self._looks_rows_up:  # the tied table's gradient rows no later backward touches go to the head now
            present(self.links.tied_rows, "tied rows").backward_done(
                self._step, self.scaler.scale if self.scaler is not None else 1.0)
        if self.grid.is_first_stage:
            self._release(index)

    def _send_grad(self, mb: _MicroBatch, index: int, stats: StepStats) -> None:
        grad = present(present(mb.inputs, "inputs").grad, "the gradient of the inputs")
        self.links.send_gradient(index, grad, present(mb.ids, "sample ids"), mb.mask)
        self._release(index)

    def _release(self, index: int) -> None:
        """Micro-batch `index` is done on this stage: free its activations."""
        self._mbs[index] = _MicroBatch(ids=self._mbs[index].ids)
        self._meter.release(index)

    def _reduce_grads(self, mb: None, index: None, stats: StepStats) -> None:
        self.links.flush()
        self.optimizer_phase.reduce(self._step, stats)

    def _optimizer_step(self, mb: None, index: None, stats: StepStats) -> None:
        self.optimizer_phase.update(stats)

    def _tied_bytes(self) -> int:
        """Bytes this rank has sent so far to keep tied copies equal (row exchange and dense all-reduce)."""
        rows = self.links.tied_rows
        return comm.TRAFFIC.sent[comm.TIED] + (rows.bytes_sent if rows is not None else 0)

    # instruction type -> (handler, whether its time counts as waiting on peers rather than computing)
    _HANDLERS: ClassVar[dict[type, tuple[Callable[..., None], bool]]] = {
        sch.RecvActivation: (_recv_activation, False),  # (its wait for the message: links.blocked_seconds)
        sch.LoadMicroBatch: (_load_micro_batch, False),
        sch.Forward: (_forward, False),
        sch.SendActivation: (_send_activation, False),
        sch.RecvGrad: (_recv_grad, False),
        sch.Backward: (_backward, False),
        sch.SendGrad: (_send_grad, False),
        sch.ReduceGrads: (_reduce_grads, True),
        sch.OptimizerStep: (_optimizer_step, False),
    }

    _MODEL_TIMERS: ClassVar[dict[type, str]] = {sch.Forward: "forward_seconds", sch.Backward: "backward_seconds"}


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this rank has used: on CUDA the bytes allocated on its device since the step began, on the
    host the process's peak resident set since it started (the kernel keeps no per-step peak)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return process_peak_rss_bytes()


def process_peak_rss_bytes() -> int:
    """This process's own peak resident set in bytes, since it (or its program) started."""
    # getrusage's ru_maxrss survives execve: a process started by vfork+exec (subprocess's way) reports its parent's
    # peak if that was higher (a launcher that tokenized a corpus). The kernel's high-water mark of this address space
    # (VmHWM) starts afresh with the program.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kB


def finite_rows(activation: torch.Tensor) -> torch.Tensor:
    """Per sample, on the activation's device: whether its activation is finite (nothing read: a GPU is not waited
    for on every send)."""
    return torch.isfinite(activation.detach().reshape(activation.shape[0], -1)).all(dim=1)


def report_nonfinite(checks: list[tuple[torch.Tensor, torch.Tensor]], step: int, stage: int, aqsgd: bool = True
                     ) -> list[int]:
    """Name on stderr the samples whose activation held an inf or NaN (an AQ-SGD link sends them at full precision
    and keeps no m(ξ) for them), from each send's (`finite_rows`, sample ids), read in one wait; returns their ids."""
    if not checks:
        return []
    finite = torch.cat([rows for rows, _ in checks]).tolist()
    ids = torch.cat([i.reshape(-1).cpu() for _, i in checks]).tolist()
    bad = [i for i, ok in zip(ids, finite) if not ok]
    if bad:
        print(f"warning: step {step + 1}, stage {stage}: the activation of sample(s) {bad} is not finite (inf or NaN)"
              f"{'; sent at full precision, its m(xi) not stored' if aqsgd else ''}", file=sys.stderr, flush=True)
    return bad
