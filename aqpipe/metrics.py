"""Run outputs: one JSON line per optimizer step, the run summary, and the loss curve."""

from __future__ import annotations

import io
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aqpipe.disk import write_atomic, writing


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a reader sees the old file or the complete new one)."""
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


class MetricsLog:
    """Appends per-step records to `metrics.jsonl` in the run directory and keeps them for the summary."""

    def __init__(self, out_dir: str | Path, records: list[dict] | None = None) -> None:
        """Start `metrics.jsonl` afresh, holding `records` (a resumed run's history up to its checkpoint)."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = list(records or [])
        self.path = self.out_dir / "metrics.jsonl"
        write_atomic(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records).encode())
        self._file = open(self.path, "a", buffering=1)

    def log(self, record: dict) -> None:
        """Record one step (with `eval_*` fields when an evaluation ran after it)."""
        self.records.append(record)
        line = json.dumps(record, sort_keys=True) + "\n"
        with writing(self.path, len(line)):
            self._file.write(line)

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class RunTotals:
    """What a run's summary counts beyond its step records: its restarts, the bytes that travelled outside every
    record (`setup`, and since the last record `control` and `checkpoint`, by traffic class) and the final weights'
    gather."""

    restarts: int = 0
    unrecorded: dict[str, int] = field(default_factory=dict)
    final_weights_bytes: int = 0


def summarize(records: list[dict], *, used_steps: bool, warmup_epochs: int, wall_seconds: float,
              totals: RunTotals = RunTotals()) -> dict:
    """The run summary (`summary.json`, docs/runs.md) from the per-step records and the run's `totals` (the exports'
    paths and the data's description are the run's to add).

    final_loss: mean loss of the last epoch (of the last 10% of steps when the run was sized by --steps);
    samples_per_second: median over the steps after the warm-up epochs (over all steps if none are after).
    """
    if not records:
        raise ValueError("no steps were recorded")
    if used_steps:
        tail = records[-max(1, len(records) // 10):]
    else:
        last_epoch = records[-1]["epoch"]
        tail = [r for r in records if r["epoch"] == last_epoch]
    after_warmup = [r for r in records if r["epoch"] >= warmup_epochs] or records
    last = records[-1]
    return {
        "final_loss": statistics.fmean(r["loss"] for r in tail),
        "steps": len(records),
        "epochs": last["epoch"] + 1,
        "samples_per_second": statistics.median(r["samples_per_second"] for r in after_warmup),
        "link_bytes": {
            "fwd": sum(r["fwd_bytes"] for r in records),
            "bwd": sum(r["bwd_bytes"] for r in records),
            "per_link_fwd": [sum(v) for v in zip(*(r.get("link_fwd_bytes", []) for r in records))],
            "per_link_bwd": [sum(v) for v in zip(*(r.get("link_bwd_bytes", []) for r in records))],
        },
        "bytes_per_element": run_bytes_per_element(records),
        "link_rate": {
            "fwd_bytes_per_second": _mean_rate(records, "fwd"),
            "bwd_bytes_per_second": _mean_rate(records, "bwd"),
        },
        "grad_sync_bytes": sum(r["grad_sync_bytes"] for r in records),
        "tied_bytes": sum(r.get("tied_bytes", 0) for r in records),
        "traffic": traffic_totals(records, totals),
        "final_weights_bytes": totals.final_weights_bytes,
        "wall_seconds": wall_seconds,
        "compute_seconds": sum(r["compute_seconds"] for r in records),
        "comm_wait_seconds": sum(r["comm_wait_seconds"] for r in records),
        # the store's counters are running totals: the last record's are the run's
        "store": {name: last.get(f"store_{name}", 0) for name in ("hits", "misses", "reseeded", "overflow")},
        "skipped_steps": sum(1 for r in records if r.get("skipped")),
        "restarts": totals.restarts,
        **_aqsgd_fidelity(tail),
        **_last_evaluation(records),
    }


def _last_evaluation(records: list[dict]) -> dict:
    """The last evaluation's numbers as summary fields (eval_loss, eval_accuracy, …), with the step it ran at."""
    evaluated = [r for r in records if "eval_loss" in r]
    if not evaluated:
        return {}
    final = evaluated[-1]
    return {**{k: v for k, v in final.items() if k.startswith("eval_")}, "eval_step": final["step"]}


def run_bytes_per_element(records: list[dict]) -> dict:
    """Link payload bytes per activation (forward) and gradient (backward) value over the whole run, and over both
    (lossless fp32 links: 4; AQ-SGD adds a mode byte per sample)."""
    totals = {}
    for direction in ("fwd", "bwd"):
        sent = sum(r[f"{direction}_bytes"] for r in records)
        values = sum(r[f"{direction}_bytes"] / r[f"{direction}_bytes_per_element"] for r in records
                     if r.get(f"{direction}_bytes_per_element"))
        totals[direction] = (sent, values)
    per = {d: sent / values if values else 0.0 for d, (sent, values) in totals.items()}
    values = sum(v for _, v in totals.values())
    per["all"] = sum(s for s, _ in totals.values()) / values if values else 0.0
    return per


# Per-step record fields by traffic class: every byte a run's ranks send, by what it is for.
TRAFFIC_FIELDS = {"link_payload": ("fwd_bytes", "bwd_bytes"), "link_framing": ("fwd_framing_bytes", "bwd_framing_bytes"),
                  "grad_sync": ("grad_sync_bytes",), "tied": ("tied_bytes",), "control": ("control_bytes",),
                  "evaluation": ("eval_bytes",), "checkpoint": ("checkpoint_bytes",)}


def traffic_totals(records: list[dict], run: RunTotals = RunTotals()) -> dict:
    """Bytes the whole run sent, by traffic class (the records' classes, with what travelled outside them: `setup`,
    `final_weights`), and in all."""
    totals = {name: sum(r.get(f, 0) for r in records for f in fields) + run.unrecorded.get(name, 0)
              for name, fields in TRAFFIC_FIELDS.items()}
    totals["setup"] = run.unrecorded.get("setup", 0)
    totals["final_weights"] = run.final_weights_bytes
    totals["total"] = sum(totals.values())
    return totals


def _aqsgd_fidelity(tail: list[dict]) -> dict:
    """`aqsgd` {change, error}: each link's mean over `tail`'s steps (the last epoch, or the last tenth of the steps
    of a run sized by --steps) of ‖a − m(ξ)‖/‖a‖ before and after the update (absent when no link sent AQ-SGD deltas
    then): how much activations moved since each sample's last visit, and how far what the receiver computed on was
    from the true activations."""
    out = {}
    for name in ("change", "error"):
        rows = [r[f"link_aqsgd_{name}"] for r in tail if f"link_aqsgd_{name}" in r]
        per_link = [[v for v in link if v is not None] for link in zip(*rows)]
        if any(per_link):
            out[name] = [statistics.fmean(values) if values else None for values in per_link]
    return {"aqsgd": out} if out else {}


def _mean_rate(records: list[dict], direction: str) -> list[float]:
    """Each link's achieved bytes/s over the whole run: bytes moved over time on the wire, summed over steps."""
    rates = [r.get(f"link_{direction}_bytes_per_second", []) for r in records]
    seconds = [r.get(f"link_{direction}_wire_seconds", []) for r in records]
    moved = [sum(rate * sec for rate, sec in zip(link_rates, link_secs))
             for link_rates, link_secs in zip(zip(*rates), zip(*seconds))]
    total = [sum(link_secs) for link_secs in zip(*seconds)]
    return [m / t if t > 0 else 0.0 for m, t in zip(moved, total)]


def plot_loss(records: list[dict], path: Path, title: str = "") -> None:
    """Training loss per step, with epoch boundaries marked and held-out losses as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.2, label="train loss")
    for r_prev, r in zip(records, records[1:]):
        if r["epoch"] != r_prev["epoch"]:
            ax.axvline(r["step"], color="grey", lw=0.6, ls=":")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "o--", ms=4, lw=0.8, label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    # (placed, not searched for: the best spot and a tight layout were about a fifth of the time a run spends drawing it)
    ax.legend(loc="upper right")
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.12, top=0.92)
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format="png")
    write_atomic(path, image.getvalue())
    plt.close(fig)


def kept_records(out: str | Path, step: int) -> list[dict]:
    """The metrics records a resumed run keeps: those of steps up to and including `step`."""
    path = Path(out) / "metrics.jsonl"
    records: list[dict] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short when the run was killed
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                records.append(record)
    return records
