"""What one rank measured during one optimizer step, each field declaring how rank 0 combines every rank's value
into the step's metrics record (`aqpipe.runtime.outputs.step_record`): the one home of a step's statistics.

A field's `combine` names its record fields:
- `sum`: summed over every rank, under the field's name;
- `max`: the slowest (largest) rank's, under the field's name;
- `first`: rank 0's (a number every rank holds alike: the gradient norm, the loss scale);
- `per_stage`: a list over stages of replica 0's values, as `stage_<name>`;
- `stage_sum`: a list over stages of the values summed over replicas, as `stage_<name>`.
A field with no `combine` feeds a record field worked out from several (the loss, link rates, bytes per element,
AQ-SGD's fidelity), which `step_record` forms itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

COMBINES = ("sum", "max", "first", "per_stage", "stage_sum")


def stat(default: Any, *combine: str) -> Any:
    """A StepStats field and how its record fields combine the ranks' values."""
    unknown = [c for c in combine if c not in COMBINES]
    if unknown:
        raise ValueError(f"unknown combine {unknown}; use {', '.join(COMBINES)}")
    return field(default=default, metadata={"combine": combine})


@dataclass
class StepStats:
    """What one rank measured during one optimizer step (bytes are what this rank sent)."""

    loss_sum: float = stat(0.0)  # sum over micro-batches of the loss (last stage only)
    fwd_bytes: int = stat(0, "sum")  # activation payload bytes
    bwd_bytes: int = stat(0, "sum")  # gradient payload bytes
    fwd_elements: int = stat(0)  # activation values those bytes stood for
    bwd_elements: int = stat(0)
    grad_sync_bytes: int = stat(0, "sum")
    tied_bytes: int = stat(0, "sum", "stage_sum")  # a tied table's rows and gradient rows (dense: all-reduce share)
    fwd_framing_bytes: int = stat(0, "sum")  # the rest of the messages whose payloads fwd_bytes/bwd_bytes count:
    bwd_framing_bytes: int = stat(0, "sum")  # headers, sample ids, attention masks
    checkpoint_bytes: int = stat(0, "sum")  # copies of checkpoint parts sent to other hosts (in the background)
    control_bytes: int = stat(0)  # loss weights, overflow flags, norm all-reduces, re-seed requests… (+ the gather)
    fwd_recv_bytes: int = stat(0)  # activation message bodies received, and their time on the wire
    fwd_recv_seconds: float = stat(0.0)
    bwd_recv_bytes: int = stat(0)  # gradient message bodies received, and their time on the wire
    bwd_recv_seconds: float = stat(0.0)
    compute_seconds: float = stat(0.0, "max", "per_stage")
    comm_wait_seconds: float = stat(0.0, "max", "per_stage")
    forward_seconds: float = stat(0.0, "per_stage")  # the model's forward and backward alone (a GPU's: by its events)
    backward_seconds: float = stat(0.0, "per_stage")
    grad_norm: float = stat(0.0, "first")
    peak_activation_bytes: int = stat(0, "per_stage")  # the most bytes of activations held for backward at once
    peak_memory_bytes: int = stat(0, "per_stage")  # CUDA: the most bytes allocated this step; CPU: peak RSS so far
    codec_graph_bytes: int = stat(0, "per_stage")  # CUDA: what the codecs' graphs hold on the GPU (0 without graphs)
    overflow: int = stat(0)  # 1: an fp16 gradient overflowed somewhere, and every rank skipped this step's update
    loss_scale: float = stat(0.0, "first")  # fp16's loss scale during this step (0 without loss scaling)
    store_hits: int = stat(0, "sum")  # the m(ξ) store's counters so far (the loop fills them in)
    store_misses: int = stat(0, "sum")
    store_reseeded: int = stat(0, "sum")
    store_overflow: int = stat(0, "sum")
    aqsgd_signal: float = stat(0.0)  # AQ-SGD activations sent as deltas: Σ‖a‖², Σ‖a − m_old‖², Σ‖a − m_new‖²
    aqsgd_change: float = stat(0.0)
    aqsgd_error: float = stat(0.0)


STAT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepStats))  # the order every rank's row travels in
INTEGER_FIELDS = frozenset(f.name for f in fields(StepStats) if f.type in ("int", int))
COMBINED: dict[str, tuple[str, ...]] = {f.name: f.metadata["combine"] for f in fields(StepStats)
                                        if f.metadata.get("combine")}
