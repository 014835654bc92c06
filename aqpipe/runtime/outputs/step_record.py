"""One optimizer step's metrics record: every rank's `StepStats` gathered on rank 0, each field combined as it
declares (`aqpipe.pipeline.vocab.step_stats`), and the record fields worked out from several of them (`DERIVED`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from aqpipe.config import ResolvedConfig
from aqpipe.pipeline.links.transport import achieved_rate
from aqpipe.pipeline.vocab.step_stats import Statistic, StepStats, statistics_of
from aqpipe.pipeline.world.grid import Grid, gather_rows
from aqpipe.storage.base import stage_holding


def step_record(stats: StepStats, grid: Grid, cfg: ResolvedConfig, step: int, steps_per_epoch: int, lr: float,
                step_seconds: float, device: torch.device) -> dict:
    """Collect every rank's numbers of this step on rank 0 and combine them into one metrics record (every rank
    calls this; {} elsewhere)."""
    stats.step_seconds = step_seconds
    statistics = statistics_of(type(stats))
    mine = torch.tensor([float(getattr(stats, s.name)) for s in statistics], dtype=torch.float64)
    rows = gather_rows(mine, grid, device)
    if rows is None:
        return {}
    values = combine_rows(rows, grid, statistics)
    # this record's own gather (every rank but 0 sends its row) is control traffic of this step too
    values["control_bytes"] += (grid.world_size - 1) * mine.numel() * mine.element_size()
    recorded = {name for s in statistics if s.recorded for name in record_names(s)}
    derived = {name: rule(values, cfg) for name, rule in DERIVED.items()}
    return {"step": step + 1, "epoch": step // steps_per_epoch, "lr": lr,
            **{name: value for name, value in values.items() if name in recorded},
            **{name: value for name, value in derived.items() if value is not None}}


# What a combined value's name starts with, by how it combines (the rest: the statistic's name alone)
NAME_PREFIX = {"per_stage": "stage_", "stage_sum": "stage_", "link_send": "link_", "link_recv": "link_"}


def record_names(statistic: Statistic) -> list[str]:
    """The names a statistic's combined values go by, one per way it combines."""
    return [NAME_PREFIX.get(how, "") + statistic.name for how in statistic.combine]


def combine_rows(rows: torch.Tensor, grid: Grid, statistics: tuple[Statistic, ...]) -> dict:
    """Every rank's row of `statistics` (one row per rank, in rank order) combined as each declares."""
    combined: dict = {}
    for i, statistic in enumerate(statistics):
        cast = int if statistic.integer else float
        column = rows[:, i]
        for how, name in zip(statistic.combine, record_names(statistic)):
            if how == "sum":
                combined[name] = cast(column.sum())
            elif how == "max":
                combined[name] = cast(column.max())
            elif how == "first":
                combined[name] = cast(column[0])
            elif how == "last_stage":
                combined[name] = cast(_over_replicas(column, grid, grid.pp - 1))
            elif how == "per_stage":
                combined[name] = [cast(column[grid.rank_of(s, 0)]) for s in range(grid.pp)]
            elif how == "stage_sum":
                combined[name] = [cast(_over_replicas(column, grid, s)) for s in range(grid.pp)]
            else:  # link_send, link_recv: the stage on that side of each link
                side = how.removeprefix("link_")
                combined[name] = [cast(_over_replicas(column, grid, stage_holding(k, side))) for k in range(grid.pp - 1)]
    return combined


def _over_replicas(column: torch.Tensor, grid: Grid, stage: int) -> float:
    """A stage's values summed over its replicas."""
    return float(sum(column[grid.rank_of(stage, r)] for r in range(grid.dp)))


def _rates(values: dict, direction: str) -> list[float]:
    """Achieved bytes/s of each link while a message body was on the wire (`transport.achieved_rate`)."""
    return [achieved_rate(*link) for link in zip(values[f"link_{direction}_recv_bytes"],
                                                 values[f"link_{direction}_arrived_bytes"],
                                                 values[f"link_{direction}_recv_seconds"])]


def _relative(values: dict, name: str) -> list[float | None] | None:
    """Each link's √(Σ name / Σ ‖a‖²) over the AQ-SGD deltas its sender sent this step (None: it sent none; the
    field is left out when no link sent any)."""
    ratios = [math.sqrt(part / whole) if whole > 0 else None
              for part, whole in zip(values[f"link_aqsgd_{name}"], values["link_aqsgd_signal"])]
    return ratios if any(r is not None for r in ratios) else None


# Record fields worked out from the combined statistics and the run's settings (None leaves the field out)
DERIVED: dict[str, Callable[[dict, ResolvedConfig], object]] = {
    "loss": lambda v, cfg: v["loss_sum"] / (cfg.micro_batches * cfg.dp),
    "samples_per_second": lambda v, cfg: cfg.samples_per_step * cfg.dp / v["step_seconds"],
    "link_fwd_wire_seconds": lambda v, cfg: v["link_fwd_recv_seconds"],
    "link_bwd_wire_seconds": lambda v, cfg: v["link_bwd_recv_seconds"],
    "link_fwd_bytes_per_second": lambda v, cfg: _rates(v, "fwd"),
    "link_bwd_bytes_per_second": lambda v, cfg: _rates(v, "bwd"),
    "fwd_bytes_per_element": lambda v, cfg: v["fwd_bytes"] / v["fwd_elements"] if v["fwd_elements"] else 0.0,
    "bwd_bytes_per_element": lambda v, cfg: v["bwd_bytes"] / v["bwd_elements"] if v["bwd_elements"] else 0.0,
    "skipped": lambda v, cfg: v["overflow"] > 0,  # fp16: a gradient overflowed and no rank updated
    "link_aqsgd_change": lambda v, cfg: _relative(v, "change"),
    "link_aqsgd_error": lambda v, cfg: _relative(v, "error"),
}
