"""The pipeline engine: schedules as instruction streams, the stage worker that interprets them, the links between
stages (framed streams, codecs at both ends), the rank grid, and the numerics of a stage's step (mixed precision,
optimizer, tied parameters, evaluation). Knows nothing of configuration files or launching."""

from typing import TypeVar

T = TypeVar("T")


def present(value: T | None, what: str) -> T:
    """`value`, which must be set at this point of a stage's work; an error naming `what` if it is not (an
    instruction stream out of order, a link end this stage does not have)."""
    if value is None:
        raise RuntimeError(f"{what} missing at this point of the stage's work (an instruction out of order, or a link "
                           "this stage does not have)")
    return value
