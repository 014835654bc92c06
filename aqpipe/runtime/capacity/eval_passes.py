"""What a run's held-out passes send over the links, for the capacity plan (`--dry-run`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aqpipe.compress.link.base import numel
from aqpipe.compress.link.codes import lossless_dtype
from aqpipe.compress.link.factory import message_bytes
from aqpipe.compress.link.options import QuantOptions
from aqpipe.pipeline.execution.evaluate import held_out_samples

if TYPE_CHECKING:
    from aqpipe.runtime.capacity.rows import RowShapes
    from aqpipe.runtime.plan import RunPlan


@dataclass
class EvalNeeds:
    """What the run's held-out passes send over the links (payload bytes, every replica's share together)."""

    samples: int  # held-out samples a pass runs on (--eval-samples)
    pass_bytes: int  # one pass with --eval-codec
    lossless_pass_bytes: int  # one pass over lossless links (fp32, or the activations' own bf16/fp16)
    passes: int  # evaluations over the run

    @property
    def run_bytes(self) -> int:
        """Every pass of the run."""
        return self.pass_bytes * self.passes


def eval_passes(steps: int, eval_every: int | None) -> int:
    """Evaluations a run of `steps` makes: every `eval_every` steps and after the last (0: never; None: the last
    step only)."""
    if eval_every == 0:
        return 0
    if not eval_every:
        return 1
    return steps // eval_every + (1 if steps % eval_every else 0)


def eval_needs(plan: RunPlan, links: list[tuple[tuple[int, ...], str]], options: QuantOptions, rows: RowShapes
               ) -> EvalNeeds | None:
    """The held-out passes' link bytes, given each link's micro-batch activation (shape, dtype name): each sample's
    activation on every link, as `rows` says it travels, as --eval-codec codes it (a sample's bytes never depend on
    the others of its micro-batch)."""
    cfg = plan.cfg
    samples = held_out_samples(len(plan.dataset.valid), cfg.eval_samples)
    passes = eval_passes(plan.total_steps, cfg.eval_every)
    if not samples or not passes or not links:
        return None
    coded = lossless = 0
    for shape, name in links:
        dtype = getattr(torch, name)
        coded += rows.held_out_bytes(functools.partial(message_bytes, cfg.eval_spec, "fw", dtype=dtype,
                                                       options=options), shape)
        lossless += rows.held_out_bytes(functools.partial(_lossless_bytes, dtype=dtype), shape)
    return EvalNeeds(samples, coded, lossless, passes)


def _lossless_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a lossless message of `shape` (in the activation's own float dtype)."""
    return numel(shape) * lossless_dtype(dtype).itemsize
