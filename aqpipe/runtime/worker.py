"""The stage worker: executes one stage's instruction stream for each optimizer step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from aqpipe.compress.codecs import FloatCodec
from aqpipe.compress.grad import GradSync
from aqpipe.data import TokenSamples
from aqpipe.runtime import schedule as sch
from aqpipe.runtime.grid import Grid, ProcessGroups
from aqpipe.runtime.optim import clip_by_global_norm, local_grad_sq_norm
from aqpipe.runtime.transport import KIND_ACTIVATION, KIND_GRADIENT, Expect, Header, Inbox, Outbox


@dataclass
class StepStats:
    """What one rank measured during one optimizer step."""

    loss_sum: float = 0.0  # sum over micro-batches of the loss (last stage only)
    fwd_bytes: int = 0  # activation payload bytes this rank sent
    bwd_bytes: int = 0  # gradient payload bytes this rank sent
    grad_sync_bytes: int = 0
    compute_seconds: float = 0.0
    comm_wait_seconds: float = 0.0
    grad_norm: float = 0.0


@dataclass
class Links:
    """This rank's mailboxes: activations in from the previous stage, gradients in from the next."""

    act_in: Inbox | None = None
    act_out: Outbox | None = None
    grad_in: Inbox | None = None
    grad_out: Outbox | None = None

    def close(self) -> None:
        for box in (self.act_in, self.grad_in):
            if box is not None:
                box.close()


@dataclass
class _MicroBatch:
    ids: torch.Tensor | None = None
    inputs: torch.Tensor | None = None
    outputs: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None


@dataclass
class StageWorker:
    """One stage of one replica: its layers, links, codecs, optimizer and grad sync."""

    grid: Grid
    groups: ProcessGroups
    module: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    samples: TokenSamples | None  # first and last stage only
    links: Links
    fw_codec: FloatCodec
    bw_codec: FloatCodec
    grad_sync: GradSync
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LambdaLR
    clip: float
    device: torch.device
    micro_batch_size: int
    payload_sent: dict[str, int] = field(default_factory=lambda: {"fwd": 0, "bwd": 0})
    _mbs: dict[int, _MicroBatch] = field(default_factory=dict)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def run_step(self, step: int, micro_batch_ids: list[torch.Tensor]) -> StepStats:
        """Run one optimizer step over the given micro-batches (sample ids per micro-batch)."""
        stats = StepStats()
        n = len(micro_batch_ids)
        self._mbs = {mb: _MicroBatch(ids=ids) for mb, ids in enumerate(micro_batch_ids)}
        for mb in range(n):  # post every receive of the step now so the inbox threads run ahead of compute
            if self.links.act_in is not None:
                self.links.act_in.expect(Expect(KIND_ACTIVATION, step, mb, self.micro_batch_size,
                                                payload_bytes=self.fw_codec.payload_bytes))
            if self.links.grad_in is not None:
                self.links.grad_in.expect(Expect(KIND_GRADIENT, step, mb, self.micro_batch_size,
                                                 payload_bytes=self.bw_codec.payload_bytes))
        self.module.train()
        sent_before = dict(self.payload_sent)
        for instruction in sch.gpipe(self.grid.stage, self.grid.pp, n):
            self._execute(instruction, step, n, stats)
        stats.fwd_bytes = self.payload_sent["fwd"] - sent_before["fwd"]
        stats.bwd_bytes = self.payload_sent["bwd"] - sent_before["bwd"]
        self._mbs = {}
        return stats

    def _execute(self, ins: sch.Instruction, step: int, n: int, stats: StepStats) -> None:
        mb = self._mbs.get(ins.micro_batch) if ins.micro_batch is not None else None
        start = time.perf_counter()
        if isinstance(ins, sch.RecvActivation):
            msg = self.links.act_in.get()
            mb.ids = msg.ids
            x = self.fw_codec.decode(msg.header.shape, msg.header.dtype, msg.payload, msg.ids).to(self.device)
            mb.inputs = x.requires_grad_(True)
            stats.comm_wait_seconds += time.perf_counter() - start
        elif isinstance(ins, sch.LoadMicroBatch):
            if self.grid.is_first_stage:
                mb.inputs = self.samples.inputs(mb.ids).to(self.device)
            if self.grid.is_last_stage:
                mb.targets = self.samples.targets(mb.ids).to(self.device)
        elif isinstance(ins, sch.Forward):
            out = self.module(mb.inputs)
            if self.grid.is_last_stage:
                mb.loss = self.loss_fn(out, mb.targets)
                stats.loss_sum += float(mb.loss.detach())
            else:
                mb.outputs = out
            stats.compute_seconds += time.perf_counter() - start
        elif isinstance(ins, sch.SendActivation):
            self._send(self.links.act_out, self.fw_codec, KIND_ACTIVATION, step, ins.micro_batch, mb.outputs, mb.ids, "fwd")
            stats.compute_seconds += time.perf_counter() - start
        elif isinstance(ins, sch.RecvGrad):
            msg = self.links.grad_in.get()
            mb.output_grad = self.bw_codec.decode(msg.header.shape, msg.header.dtype, msg.payload, msg.ids).to(self.device)
            stats.comm_wait_seconds += time.perf_counter() - start
        elif isinstance(ins, sch.Backward):
            if self.grid.is_last_stage:
                (mb.loss / n).backward()
            else:
                mb.outputs.backward(mb.output_grad)
            stats.compute_seconds += time.perf_counter() - start
        elif isinstance(ins, sch.SendGrad):
            self._send(self.links.grad_out, self.bw_codec, KIND_GRADIENT, step, ins.micro_batch, mb.inputs.grad, mb.ids, "bwd")
            self._mbs[ins.micro_batch] = _MicroBatch(ids=mb.ids)  # free this micro-batch's activations
            stats.compute_seconds += time.perf_counter() - start
        elif isinstance(ins, sch.ReduceGrads):
            for box in (self.links.act_out, self.links.grad_out):
                if box is not None:
                    box.flush()
            before = self.grad_sync.bytes_sent
            self.grad_sync.synchronize(self.params)
            stats.grad_sync_bytes = self.grad_sync.bytes_sent - before
            stats.comm_wait_seconds += time.perf_counter() - start
        elif isinstance(ins, sch.OptimizerStep):
            sq = local_grad_sq_norm(self.params)
            if self.grid.pp > 1:
                dist.all_reduce(sq, group=self.groups.pipeline)
            stats.grad_norm = clip_by_global_norm(self.params, self.clip, sq)
            self.optimizer.step()
            self.lr_schedule.step()
            self.optimizer.zero_grad(set_to_none=True)
            stats.compute_seconds += time.perf_counter() - start
        else:
            raise RuntimeError(f"unknown instruction {ins!r}")

    def _send(self, box: Outbox, codec: FloatCodec, kind: int, step: int, mb: int, tensor: torch.Tensor,
              ids: torch.Tensor, direction: str) -> None:
        encoded = codec.encode(tensor.detach(), ids)
        header = Header(kind, step, mb, encoded.shape, encoded.wire_dtype, ids.numel(), encoded.payload.numel(),
                        codec=codec.code, codec_check=encoded.codec_check, flags=encoded.flags)
        box.send(header, ids, encoded.payload)
        self.payload_sent[direction] += encoded.payload.numel()
