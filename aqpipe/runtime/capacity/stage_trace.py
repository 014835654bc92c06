"""What each stage of a run holds, before anything trains: its parameters and those that train and the activations
it holds for backward under the schedule (traced), and the optimizer state they need (from the configuration).

Activations are not guessed from formulas: each stage's real forward (and the last stage's loss) runs once on one
micro-batch of the real data with *fake* tensors (torch's FakeTensorMode: shapes, dtypes and autocast behave as on
the device, nothing is allocated), counted by the same ActivationMeter the worker uses during training. A stage's
peak is that micro-batch's bytes times the most micro-batches its schedule holds at once (`micro_batches_held`).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from aqpipe.config import ResolvedConfig
from aqpipe.pipeline.execution.held import ActivationMeter
from aqpipe.pipeline.links.tied_rows import table_parameter
from aqpipe.pipeline.numerics.mixed_precision import autocast
from aqpipe.pipeline.numerics.tied import row_tables
from aqpipe.pipeline.vocab import schedule as sch
from aqpipe.runtime.plan import RunPlan

# optimizer -> fp32 copies of each trained parameter it keeps (AdamW: both moments; SGD: its momentum buffer, when
# it has momentum)
OPTIMIZER_STATE_COPIES = {"adamw": 2, "sgd": 1}


class TraceError(RuntimeError):
    """A stage the fake-tensor tracer cannot run (a custom model doing something fake tensors cannot)."""


class StageTrace(NamedTuple):
    """What tracing one stage found."""

    counts: tuple[int, int]  # (parameters, trained parameters)
    activation_bytes: int  # held for backward for one micro-batch
    output_shape: tuple[int, ...]
    output_dtype: torch.dtype
    synced_shapes: list[tuple[int, ...]]  # the trained parameters its optimizer holds and its replicas' grad sync exchanges


def state_copies(cfg: ResolvedConfig) -> int:
    """fp32 copies per trained parameter the optimizer keeps, plus a sign-based grad sync's vote momentum."""
    from aqpipe.pipeline.numerics.optim import momenta

    optimizer_momentum, vote_momentum = momenta(cfg.momentum, cfg.grad_spec.sign_based)
    copies = OPTIMIZER_STATE_COPIES[cfg.optimizer] if cfg.optimizer == "adamw" or optimizer_momentum > 0 else 0
    return copies + (1 if vote_momentum > 0 else 0)


def micro_batches_held(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """The most micro-batches whose activations `stage` holds at once under `schedule` (from its stream: from a
    forward until the backward that frees it)."""
    held = peak = 0
    for ins in sch.SCHEDULES[schedule].stream(stage, stages, micro_batches):
        if isinstance(ins, sch.Forward):
            held += 1
            peak = max(peak, held)
        elif isinstance(ins, sch.Backward):
            held -= 1
    return peak


def trace_stages(plan: RunPlan) -> list[StageTrace]:
    """Run every stage's forward on one fake micro-batch: what each stage holds and outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = plan.cfg
    batch = plan.first_micro_batch()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device("cpu")  # autocast and every kernel's output dtype as on the host
    traced = []
    x: torch.Tensor | None = None
    row_names = [] if plan.lora is not None else row_tables(plan.spec.extras, cfg.pp, cfg.tied_spec)  # as assembled
    for s in range(cfg.pp):
        with torch.device("meta"):
            module = plan.build_stage(s)
        with mode:
            module = module.to_empty(device=device)
            params = list(module.parameters())
            counts = (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))
            # (a tied table the first stage only looks rows up in is the last stage's to update and synchronize)
            cache = table_parameter(module, row_names[0])[1] if s == 0 and row_names else None
            synced = [tuple(p.shape) for p in params if p.requires_grad and p is not cache]
            meter = ActivationMeter(module)
            meter.begin_step()
            if cfg.recompute:
                module.on_held = partial(meter.keep, 0)
            inputs = mode.from_tensor(_given(batch["inputs"])) if s == 0 else x
            mask = batch["mask"]
            with meter.forward(0), autocast(device, cfg.precision):
                out = module(inputs, None if mask is None else mode.from_tensor(mask))
                if s == cfg.pp - 1:
                    plan.spec.loss(out, mode.from_tensor(_given(batch["targets"])))
            meter.keep(0, out if s < cfg.pp - 1 else None)
        traced.append(StageTrace(counts, meter.peak_bytes, tuple(out.shape), out.dtype, synced))
        x = out.detach().requires_grad_(True)  # as a received activation is (aqpipe.pipeline.links.link_ends)
    return traced


def _given(tensor: torch.Tensor | None) -> torch.Tensor:
    """A tensor the traced batch holds for this stage (inputs on the first, targets on the last)."""
    if tensor is None:
        raise TraceError("the traced batch lacks the inputs or targets this stage needs")
    return tensor
