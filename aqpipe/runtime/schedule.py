"""Micro-batch schedules as pure instruction streams, one stream per stage (no torch, tested alone)."""

from __future__ import annotations

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


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """GPipe (fill-drain): every forward, then every backward, then one optimizer step.

    Backward runs micro-batches in the same order as forward, so parameter gradients accumulate in the order a
    single process would accumulate them.
    """
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}")
    if micro_batches < 1:
        raise ValueError(f"need at least one micro-batch, got {micro_batches}")
    first, last = stage == 0, stage == stages - 1
    stream: list[Instruction] = []
    for mb in range(micro_batches):
        if not first:
            stream.append(RecvActivation(mb))
        if first or last:  # after the receive: the last stage looks its targets up by the ids that arrived
            stream.append(LoadMicroBatch(mb))
        stream.append(Forward(mb))
        if not last:
            stream.append(SendActivation(mb))
    for mb in range(micro_batches):
        if not last:
            stream.append(RecvGrad(mb))
        stream.append(Backward(mb))
        if not first:
            stream.append(SendGrad(mb))
    stream += [ReduceGrads(), OptimizerStep()]
    return stream


SCHEDULES = {"gpipe": gpipe}
