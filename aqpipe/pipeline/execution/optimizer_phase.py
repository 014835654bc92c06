"""The end of one stage's step, from its gradients to its new weights, in the order it runs.

1. fp16: one overflow flag for the whole world; on overflow every rank drops its gradients and skips the update;
   otherwise the gradients are unscaled.
2. Tied tables: the head that owns a looked-up table adds the gradient rows the lookup side streamed during the
   backward (`aqpipe.pipeline.links.tied_rows`), and copies kept whole sum their gradients over the pipeline
   (`aqpipe.pipeline.numerics.tied`).
3. A sign-based grad sync clips before its vote; then the replicas combine gradients (`aqpipe.compress.grad`), and
   tied copies re-agree on the mean when a compressor may have treated them differently.
4. Clipping on the whole model's norm (tied tables counted once), the optimizer, the learning-rate schedule.

Steps 1-3 are the schedule's ReduceGrads instruction (they wait on peers), step 4 its OptimizerStep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from aqpipe.compress.grad import GradSync
from aqpipe.pipeline.links.tied_rows import LOOKUP, RowExchange
from aqpipe.pipeline.numerics.mixed_precision import LossScaler
from aqpipe.pipeline.numerics.optim import clip_by_global_norm, local_grad_sq_norm
from aqpipe.pipeline.numerics.tied import TiedGroup, agree_tied_grads, sum_tied_grads, tied_ids, tied_sq_norm
from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import Grid, ProcessGroups, collective_device

if TYPE_CHECKING:
    from aqpipe.pipeline.vocab.step_stats import StepStats


@dataclass
class OptimizerPhase:
    """One stage's gradient reduction and optimizer step (see the module's docstring for the order)."""

    grid: Grid
    groups: ProcessGroups
    module: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LambdaLR
    grad_sync: GradSync
    clip: float
    device: torch.device
    tied: list[TiedGroup] = field(default_factory=list)  # copies kept whole (DeBERTa's table; dense exchange)
    tied_rows: RowExchange | None = None  # this stage's end of a tied table's row exchange
    scaler: LossScaler | None = None
    overflow: bool = False  # this step's gradients overflowed on some rank: no update anywhere
    _sync_bytes_before: int = 0

    @property
    def params(self) -> list[nn.Parameter]:
        """Every trained parameter of the stage, a looked-up tied table included (fp16: its rows, sent scaled, count
        in the overflow check)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    @property
    def updated_params(self) -> list[nn.Parameter]:
        """The parameters this stage's optimizer updates: not a tied table it only looks rows up in (the stage
        holding the table's other copy updates it)."""
        cache = self.row_cache
        return [p for p in self.params if p is not cache]

    @property
    def row_cache(self) -> nn.Parameter | None:
        """A tied table this stage only looks rows up in (its copy is current only in those rows), or None."""
        rows = self.tied_rows
        return rows.table if rows is not None and rows.role == LOOKUP else None

    def run(self, step: int, stats: StepStats) -> None:
        """The whole phase: `reduce`, then `update`."""
        self.reduce(step, stats)
        self.update(stats)

    def reduce(self, step: int, stats: StepStats) -> None:
        """Steps 1-3: every rank of the world calls this together."""
        self._sync_bytes_before = self.grad_sync.bytes_sent
        where = collective_device(self.device)
        if self.scaler is not None:  # fp16: skip the step everywhere if any rank overflowed, before any compressor
            self.overflow = self.scaler.overflowed(self.params, where)
            if self.overflow:  # every gradient goes, a looked-up tied table's too (its optimizer is the head's)
                if self.tied_rows is not None:  # (the gradient rows already sent are received and dropped)
                    self.tied_rows.exchange_gradients(drop=True)
                for p in self.params:
                    p.grad = None
                return
            self.scaler.unscale(self.updated_params)  # a looked-up table's rows went scaled; the head unscales them
        if self.tied_rows is not None:  # the head's gradient takes the embedding's rows, before anything reads it
            self.tied_rows.exchange_gradients(unscale=1.0 / self.scaler.scale if self.scaler is not None else 1.0)
        if self.tied:  # every copy takes the sum of all copies' gradients, so the sync sees the true gradient
            sum_tied_grads(self.module, self.tied, self.groups.pipeline, self.grid.pp, where)
        if self.grad_sync.sign_based:  # a sign method's input is clipped (Marsit: before its compensation is formed)
            stats.grad_norm = self._clip()
        self.grad_sync.lr = self.lr_schedule.get_last_lr()[0]
        self.grad_sync.synchronize(self.updated_params)
        if self.tied and self.grid.dp > 1:  # a compressor may treat two copies' coordinates differently: re-agree
            agree_tied_grads(self.module, self.tied, self.groups.pipeline, self.grid.pp, where)

    def update(self, stats: StepStats) -> None:
        """Step 4 (or the skip of an overflowed step, the schedule still moving on)."""
        if self.scaler is not None:
            self.scaler.update(self.overflow)
        if self.overflow:  # skipped on every rank; the learning-rate schedule still moves on with the run's steps
            stats.overflow = 1
            self.lr_schedule.step()
            self.overflow = False
            return
        if not self.grad_sync.sign_based:
            stats.grad_norm = self._clip()
        self.optimizer.step()
        # counted after the optimizer: qadam's optimizer exchanges the momentum through the grad sync
        stats.grad_sync_bytes = self.grad_sync.bytes_sent - self._sync_bytes_before
        self.lr_schedule.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _clip(self) -> float:
        """Clip the gradients on the norm of the whole model (every stage, tied tables counted once); returns it."""
        params = self.updated_params
        skip = tied_ids(self.module) if self.tied else set()
        if self.tied_rows is not None:
            skip.add(id(self.tied_rows.table))
        sq = local_grad_sq_norm([p for p in params if id(p) not in skip])
        if self.tied:
            sq = sq + tied_sq_norm(self.module, self.tied, self.grid.is_last_stage)
        if self.tied_rows is not None:
            sq = sq + self.tied_rows.sq_norm()
        if self.grid.pp > 1:  # clip on the norm of the whole model, not of this stage, added alike in every replica
            sq = sq.to(collective_device(self.device))
            comm.ordered_sum(sq, comm.CONTROL, group=self.groups.pipeline)
        # signSGD's ±1 vector is the update itself: clipping its norm would only shrink every step
        return clip_by_global_norm(params, self.clip if self.grad_sync.clippable else 0.0, sq.cpu())
