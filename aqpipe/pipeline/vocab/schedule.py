"""Micro-batch schedules as pure instruction streams, one stream per stage (no torch, tested alone)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Instruction:
    """One step a stage worker executes; `micro_batch` is None for per-step instructions."""

    micro_batch: int | None = None

    def __repr__(self) -> str:
        mb = "" if self.micro_batch is None else str(self.micro_batch)
        return f"{type(self).__name__}({mb})"


class LoadMicroBatch(Instruction):
    """First stage: take the inputs of a micro-batch from the data (last stage: its targets)."""


class RecvActivation(Instruction):
    """Receive a micro-batch's input activation from the previous stage."""


class Forward(Instruction):
    """Run the stage's layers on a micro-batch (and the loss, on the last stage)."""


class SendActivation(Instruction):
    """Send a micro-batch's output activation to the next stage (asynchronously)."""


class RecvGrad(Instruction):
    """Receive the gradient of a micro-batch's output from the next stage."""


class Backward(Instruction):
    """Back-propagate a micro-batch through the stage, accumulating parameter gradients."""


class SendGrad(Instruction):
    """Send the gradient of a micro-batch's input to the previous stage (asynchronously)."""


class ReduceGrads(Instruction):
    """Combine gradients across the stage's data-parallel group."""


class OptimizerStep(Instruction):
    """Clip on the global norm, step the optimizer and the learning-rate schedule."""


def _check(stage: int, stages: int, micro_batches: int) -> None:
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}")
    if micro_batches < 1:
        raise ValueError(f"need at least one micro-batch, got {micro_batches}")


def _forward(mb: int, first: bool, last: bool) -> list[Instruction]:
    """One micro-batch's forward on a stage: receive (or load), compute, send."""
    ops: list[Instruction] = [] if first else [RecvActivation(mb)]
    if first or last:  # after the receive: the last stage looks its targets up by the ids that arrived
        ops.append(LoadMicroBatch(mb))
    ops.append(Forward(mb))
    if not last:
        ops.append(SendActivation(mb))
    return ops


def _backward(mb: int, first: bool, last: bool) -> list[Instruction]:
    """One micro-batch's backward on a stage: receive the output's gradient, compute, send the input's."""
    ops: list[Instruction] = [] if last else [RecvGrad(mb)]
    ops.append(Backward(mb))
    if not first:
        ops.append(SendGrad(mb))
    return ops


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """GPipe (fill-drain): every forward, then every backward, then one optimizer step.

    Backward runs micro-batches in the same order as forward, so parameter gradients accumulate in the order a
    single process would accumulate them.
    """
    _check(stage, stages, micro_batches)
    return _interleaved(stage, stages, micro_batches, micro_batches)  # every forward is a warm-up one: none interleave


def _interleaved(stage: int, stages: int, micro_batches: int, warmup: int) -> list[Instruction]:
    """`warmup` forwards, then one backward and one forward in turn, then the remaining backwards (the one shape of
    every schedule here: they differ only in how many forwards run before the first backward)."""
    first, last = stage == 0, stage == stages - 1
    stream: list[Instruction] = []
    for mb in range(warmup):
        stream += _forward(mb, first, last)
    for mb in range(micro_batches):
        stream += _backward(mb, first, last)
        if mb + warmup < micro_batches:
            stream += _forward(mb + warmup, first, last)
    return stream + [ReduceGrads(), OptimizerStep()]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """1F1B (PipeDream-flush): `min(stages - stage, micro_batches)` warm-up forwards, then one backward and one
    forward in turn, then the remaining backwards, then one optimizer step.

    In the steady state a stage sends activations down and gradients up at the same time, so both directions of a
    link carry data together, and it holds at most `stages - stage` micro-batches' activations. Backward runs
    micro-batches in forward order, as GPipe does, so gradients accumulate in the same order.
    """
    _check(stage, stages, micro_batches)
    return _interleaved(stage, stages, micro_batches, min(stages - stage, micro_batches))


def eager_one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """Eager 1F1B: 1F1B with `min(2 (stages - stage) - 1, micro_batches)` warm-up forwards.

    Under plain 1F1B a stage's next backward waits for a full round trip (its activation down every later stage and
    link, the gradient back up); on a slow link that round trip is several micro-batches long and the stage idles.
    Starting about twice as many forwards first keeps a micro-batch crossing each link in each direction while the
    round trip completes, at the price of holding up to `2 (stages - stage) - 1` micro-batches' activations.
    """
    _check(stage, stages, micro_batches)
    return _interleaved(stage, stages, micro_batches, min(2 * (stages - stage) - 1, micro_batches))


@dataclass(frozen=True)
class Schedule:
    """A named schedule: the function giving each stage's stream, and one line for the CLI help."""

    stream: Callable[[int, int, int], list[Instruction]]
    summary: str


# The one table of schedules: the worker executes SCHEDULES[cfg.schedule]; the config and the CLI help read it.
SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule(gpipe, "all forwards, then all backwards (holds every micro-batch's activations)"),
    "1f1b": Schedule(one_f_one_b, "one forward, one backward in turn (both link directions busy; holds at most "
                                  "pp - stage micro-batches)"),
    "eager-1f1b": Schedule(eager_one_f_one_b, "1F1B with about twice the warm-up forwards, so slow links' round "
                                              "trips overlap compute (holds at most 2 (pp - stage) - 1)"),
}
# The one measured fastest over slow links (benchmarks/README.md, "Schedules"), holding no more than GPipe.
DEFAULT_SCHEDULE = "eager-1f1b"
