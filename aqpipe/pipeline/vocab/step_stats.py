"""What one rank measured during one optimizer step, each field declaring how rank 0 combines every rank's value
(`aqpipe.runtime.outputs.step_record`): the one home of a step's statistics.

A field's `combine` names its combined values:
- `sum`: summed over every rank, under the field's name;
- `max`: the slowest (largest) rank's, under the field's name;
- `first`: rank 0's (a number every rank holds alike: the gradient norm, the loss scale);
- `last_stage`: summed over the last stage's replicas (the loss), under the field's name;
- `per_stage`: a list over stages of replica 0's values, as `stage_<name>`;
- `stage_sum`: a list over stages of the values summed over replicas, as `stage_<name>`;
- `link_send` / `link_recv`: a list over links of the values summed over the replicas of the stage on that side
  of each link (activations go from its send side to its recv side, gradients back), as `link_<name>`.
A field with `recorded=False` is combined like the others but written nowhere itself: a record field worked out
from several reads it (the loss, link rates, bytes per element, AQ-SGD's fidelity: `step_record.DERIVED`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

COMBINES = ("sum", "max", "first", "last_stage", "per_stage", "stage_sum", "link_send", "link_recv")


def stat(default: Any, *combine: str, recorded: bool = True) -> Any:
    """A StepStats field, how the ranks' values combine (at least one way), and whether the combined values go into
    the step's record as they are."""
    unknown = [c for c in combine if c not in COMBINES]
    if unknown or not combine:
        raise ValueError(f"unknown combine {unknown or '(none)'}; use {', '.join(COMBINES)}")
    return field(default=default, metadata={"combine": combine, "recorded": recorded})


@dataclass
class StepStats:
    """What one rank measured during one optimizer step (bytes are what this rank sent)."""

    loss_sum: float = stat(0.0, "last_stage", recorded=False)  # sum over micro-batches of the loss (last stage only)
    step_seconds: float = stat(0.0, "max")  # the step's wall time (the slowest rank's)
    fwd_bytes: int = stat(0, "sum", "link_send")  # activation payload bytes
    bwd_bytes: int = stat(0, "sum", "link_recv")  # gradient payload bytes
    fwd_elements: int = stat(0, "sum", recorded=False)  # activation values those bytes stood for
    bwd_elements: int = stat(0, "sum", recorded=False)
    grad_sync_bytes: int = stat(0, "sum")
    tied_bytes: int = stat(0, "sum", "stage_sum")  # a tied table's rows and gradient rows (dense: all-reduce share)
    fwd_framing_bytes: int = stat(0, "sum")  # the rest of the messages whose payloads fwd_bytes/bwd_bytes count:
    bwd_framing_bytes: int = stat(0, "sum")  # headers, sample ids, attention masks
    checkpoint_bytes: int = stat(0, "sum")  # copies of checkpoint parts sent to other hosts (in the background)
    # loss weights, overflow flags, norm all-reduces, re-seed requests… (the record adds its own gather)
    control_bytes: int = stat(0, "sum")
    # activation and gradient message bodies received; what of them arrived while timed, and that time (the rate)
    fwd_recv_bytes: int = stat(0, "link_recv", recorded=False)
    fwd_arrived_bytes: int = stat(0, "link_recv", recorded=False)
    fwd_recv_seconds: float = stat(0.0, "link_recv", recorded=False)
    bwd_recv_bytes: int = stat(0, "link_send", recorded=False)
    bwd_arrived_bytes: int = stat(0, "link_send", recorded=False)
    bwd_recv_seconds: float = stat(0.0, "link_send", recorded=False)
    compute_seconds: float = stat(0.0, "max", "per_stage")
    comm_wait_seconds: float = stat(0.0, "max", "per_stage")
    forward_seconds: float = stat(0.0, "per_stage")  # the model's forward and backward alone (a GPU's: by its events)
    backward_seconds: float = stat(0.0, "per_stage")
    grad_norm: float = stat(0.0, "first")
    peak_activation_bytes: int = stat(0, "per_stage")  # the most bytes of activations held for backward at once
    peak_memory_bytes: int = stat(0, "per_stage")  # CUDA: the most bytes allocated this step; CPU: peak RSS so far
    codec_graph_bytes: int = stat(0, "per_stage")  # CUDA: what the codecs' graphs hold on the GPU (0 without graphs)
    # 1: an fp16 gradient overflowed somewhere, and every rank skipped this step's update
    overflow: int = stat(0, "max", recorded=False)
    loss_scale: float = stat(0.0, "first")  # fp16's loss scale during this step (0 without loss scaling)
    store_hits: int = stat(0, "sum")  # the m(ξ) store's counters so far (the loop fills them in)
    store_misses: int = stat(0, "sum")
    store_reseeded: int = stat(0, "sum")
    store_overflow: int = stat(0, "sum")
    # AQ-SGD activations sent as deltas: Σ‖a‖², Σ‖a − m_old‖², Σ‖a − m_new‖²
    aqsgd_signal: float = stat(0.0, "link_send", recorded=False)
    aqsgd_change: float = stat(0.0, "link_send", recorded=False)
    aqsgd_error: float = stat(0.0, "link_send", recorded=False)


@dataclass(frozen=True)
class Statistic:
    """One StepStats field as rank 0 combines it: its name, whether it is a count (int), how it combines, and
    whether its combined values are recorded as they are."""

    name: str
    integer: bool
    combine: tuple[str, ...]
    recorded: bool


def statistics_of(kind: type = StepStats) -> tuple[Statistic, ...]:
    """Every field of a StepStats class, in the order every rank's row travels in."""
    return tuple(Statistic(f.name, f.type in ("int", int), f.metadata["combine"], f.metadata["recorded"])
                 for f in fields(kind))
