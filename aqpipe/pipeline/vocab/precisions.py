"""The --precision vocabulary: the one table the configuration, the CLI help and the mixed-precision code read.

No torch import here, so the `aqpipe` command can describe and validate the choice before torch is loaded (the
command installs its interrupt handling first; see aqpipe.launch.signals).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    """A compute precision: the torch dtype autocast runs forward and loss in (None: plain fp32), whether it trains
    with a dynamic loss scale, and a few words for --help."""

    autocast_dtype: str | None
    loss_scaling: bool
    summary: str


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(None, False, "full precision"),
    "bf16": Precision("bfloat16", False, "fp32's exponent range, no loss scaling"),
    "fp16": Precision("float16", True, "dynamic loss scaling"),
}


def describe_precisions() -> str:
    """The --precision choices for the CLI help."""
    return ", ".join(f"{name} ({p.summary})" for name, p in PRECISIONS.items())
