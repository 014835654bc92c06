"""The pipeline engine, in five rooms that import one way (execution -> links -> numerics -> world -> vocab):

- `execution/`: one stage's work, step by step: the stage worker that interprets its instruction stream, the
  optimizer phase, evaluation, and what a step measures of itself (activations held, GPU times, CUDA syncs);
- `links/`: how the stages reach each other: rendezvous, TCP streams, framed messages, a rank's link ends with their
  codecs, a padded batch's real rows grouped for the codecs, and the row exchange that keeps a tied embedding and LM
  head one tensor;
- `numerics/`: the arithmetic of a stage's step: the optimizer and its schedule, clipping, mixed precision and loss
  scaling, the gradients of tied parameters;
- `world/`: the rank grid and its process groups, and every collective counted by traffic class;
- `vocab/`: the engine's vocabularies, read without torch by the configuration and the runtime too: the schedules as
  instruction streams, a step's statistics and how the ranks' values combine, the `--precision`, `--tied-exchange`
  and `--link-rows` choices.

At the top, `present`, which checks that a value a stage's work needs is set at this point. The engine knows nothing
of configuration files or launching."""

from typing import TypeVar

T = TypeVar("T")


def present(value: T | None, what: str) -> T:
    """`value`, which must be set at this point of a stage's work; an error naming `what` if it is not (an
    instruction stream out of order, a link end this stage does not have)."""
    if value is None:
        raise RuntimeError(f"{what} missing at this point of the stage's work (an instruction out of order, or a link "
                           "this stage does not have)")
    return value
