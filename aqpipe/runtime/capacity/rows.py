"""What real rows (`--link-rows real`) leave of a padded batch on the links, for the capacity plan (`--dry-run`,
`aqpipe bench`): the groups the run's micro-batches make (`aqpipe.pipeline.links.real_rows`), sampled on the first
steps of the real data order, and each held-out sample's real rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aqpipe.pipeline.execution.evaluate import held_out_samples
from aqpipe.pipeline.links.real_rows import RealRows

if TYPE_CHECKING:
    from aqpipe.runtime.plan import RunPlan

Shape = tuple[int, ...]


@dataclass
class RowShapes:
    """The real rows of a run's batches: the sequence length whose batches travel as real rows (None: every position
    of every batch crosses the links), each sampled micro-batch's groups as (samples, real rows each) — a micro-batch
    without padding is one group of every sample at the full length — the share of the training samples' positions
    that are real, and each held-out sample's count of real rows (every position, where they are not counted)."""

    seq_len: int | None
    micro_batches: list[list[tuple[int, int]]]
    train_fraction: float
    held_out: list[int]

    def applies_to(self, shape: Shape) -> bool:
        """Whether a link's micro-batch activation of `shape` [B, T, ...] travels as real rows."""
        return self.seq_len is not None and len(shape) >= 3 and shape[1] == self.seq_len

    def store_fraction(self, shape: Shape) -> float:
        """The share of a link's activation values of `shape` that its m(ξ) keeps."""
        return self.train_fraction if self.applies_to(shape) else 1.0

    def step_bytes(self, message_bytes: Callable[[Shape], int], shape: Shape, micro_batches: int) -> int:
        """A step's payload bytes on a link of activation `shape` whose message of a batch of shape s takes
        `message_bytes(s)`: the mean sampled micro-batch's groups, `micro_batches` times."""
        if not self.applies_to(shape):
            return micro_batches * message_bytes(shape)
        rest = shape[2:]
        total = sum(sum(message_bytes((count, length, *rest)) for count, length in groups)
                    for groups in self.micro_batches)
        return round(micro_batches * total / len(self.micro_batches))

    def held_out_bytes(self, sample_bytes: Callable[[Shape], int], shape: Shape) -> int:
        """A held-out pass's payload bytes on a link of activation `shape`, each sample's real rows alone."""
        if not self.applies_to(shape):
            return len(self.held_out) * sample_bytes((1, *shape[1:]))
        return sum(sample_bytes((1, length, *shape[2:])) for length in self.held_out if length)


EVERY_POSITION = RowShapes(None, [], 1.0, [])  # batches that cross the links whole (held-out samples not counted)


def row_shapes(plan: RunPlan, sampled_steps: int = 8) -> RowShapes:
    """The real rows of the run's batches; every position where every position crosses the links (`--link-rows
    padded`, or data without masks: LM windows are never padded)."""
    cfg = plan.cfg
    train, valid = plan.dataset.train, plan.dataset.valid
    held = held_out_samples(len(valid), cfg.eval_samples)
    if cfg.link_rows != "real" or not len(train) or train.mask(torch.arange(1)) is None:
        return RowShapes(None, [], 1.0, [cfg.seq_len] * held)
    epochs = plan.epoch_plan(0)
    groups = []
    for step in range(min(sampled_steps, plan.total_steps)):
        for ids in epochs.micro_batches_of(step):
            mask = _mask(train, ids)
            rows = RealRows.of(mask, (*mask.shape, 1))
            groups.append([(len(ids), mask.shape[1])] if rows is None else
                          [(positions.shape[0], positions.shape[1]) for _, positions in rows.groups])
    every = _mask(train, torch.arange(len(train)))
    lengths = (_mask(valid, torch.arange(held)) != 0).sum(dim=1).tolist() if held else []
    return RowShapes(every.shape[1], groups, float((every != 0).float().mean()), lengths)


def _mask(samples, ids: torch.Tensor) -> torch.Tensor:
    """The attention masks of `ids` among samples that have them."""
    mask = samples.mask(ids)
    assert mask is not None, "only masked samples have real rows"
    return mask
