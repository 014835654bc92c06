"""What a run's held-out passes send over the links, for the capacity plan (`--dry-run`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aqpipe.compress.link.base import numel
from aqpipe.compress.link.codes import lossless_dtype
from aqpipe.compress.link.factory import message_bytes
from aqpipe.compress.link.options import QuantOptions
from aqpipe.pipeline.execution.evaluate import held_out_samples

if TYPE_CHECKING:
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


def eval_needs(plan: RunPlan, links: list[tuple[tuple[int, ...], str]], options: QuantOptions) -> EvalNeeds | None:
    """The held-out passes' link bytes, given each link's micro-batch activation (shape, dtype name): each sample's
    activation on every link, as --eval-codec codes it (a sample's bytes never depend on the others of its
    micro-batch)."""
    cfg = plan.cfg
    samples = held_out_samples(len(plan.dataset.valid), cfg.eval_samples)
    passes = eval_passes(plan.total_steps, cfg.eval_every)
    if not samples or not passes or not links:
        return None
    one = [((1, *shape[1:]), getattr(torch, dtype)) for shape, dtype in links]
    coded = sum(message_bytes(cfg.eval_codec, "fw", shape, dtype, options) for shape, dtype in one)
    lossless = sum(numel(shape) * lossless_dtype(dtype).itemsize for shape, dtype in one)
    return EvalNeeds(samples, samples * coded, samples * lossless, passes)
