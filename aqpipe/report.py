"""`aqpipe report RUN_DIR…`: the training (and evaluation) curves of several runs on one plot, and a table of
their summaries — how a user compares fp32, directq and aqsgd runs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class ReportError(ValueError):
    """A run directory that cannot be reported on; the text names it and says why."""


@dataclass
class Run:
    """What a run directory holds: its config, per-step records and (for a finished run) its summary."""

    path: Path
    config: dict
    records: list[dict]
    summary: dict | None = None
    evals: list[dict] = field(default_factory=list)
    name: str = ""  # how tables and legends call it: the directory's name, or more of its path if that is ambiguous

    def __post_init__(self) -> None:
        self.name = self.name or self.path.name

    @property
    def label(self) -> str:
        """The run's name and what distinguishes it: codecs and grad sync."""
        c = self.config
        sync = f", grad sync {c['grad_sync']}" if c.get("grad_sync", "none") != "none" else ""
        return f"{self.name} (fw {c.get('fw', '?')}, bw {c.get('bw', '?')}{sync})"


def load_run(directory: str | Path) -> Run:
    """Read one run directory; a missing directory or metrics file is a ReportError naming it."""
    path = Path(directory)
    if not path.is_dir():
        raise ReportError(f"{directory}: not a run directory (it does not exist or is not a directory)")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{directory}: no metrics.jsonl — not an aqpipe run directory, or the run never trained")
    records, evals = [], []
    for number, line in enumerate(metrics.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ReportError(f"{metrics}: line {number} is not JSON (a damaged or truncated file)") from None
        records.append(record)
        if "eval_loss" in record:
            evals.append({"step": record["step"], "loss": record["eval_loss"], "accuracy": record.get("eval_accuracy")})
    if not records:
        raise ReportError(f"{metrics}: no training steps recorded")
    config = _read_json(path / "config.json") or {}
    return Run(path, config, records, _read_json(path / "summary.json"), evals)


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise ReportError(f"{path}: not valid JSON (a damaged or truncated file)") from None


def summary_table(runs: list[Run]) -> str:
    """A markdown table with one row per run; an unfinished run shows what its records tell."""
    header = ("| run | model | pp×dp | fw | bw | grad sync | steps | final loss | eval loss | eval acc | samples/s | "
              "link MB | grad-sync MB | wall s |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for run in runs:
        c, s = run.config, run.summary or {}
        link = s.get("link_bytes", {})
        link_mb = (link.get("fwd", 0) + link.get("bwd", 0)) / 1e6 if link else None
        final = s.get("final_loss", run.records[-1]["loss"])
        eval_loss = run.evals[-1]["loss"] if run.evals else s.get("eval_loss")
        eval_accuracy = run.evals[-1]["accuracy"] if run.evals else s.get("eval_accuracy")
        cells = [
            run.name, c.get("model", "?"), f"{c.get('pp', '?')}×{c.get('dp', '?')}", c.get("fw", "?"),
            c.get("bw", "?"), c.get("grad_sync", "none"), str(s.get("steps", len(run.records))) + ("" if s else " (unfinished)"),
            f"{final:.4f}", "—" if eval_loss is None else f"{eval_loss:.4f}",
            "—" if eval_accuracy is None else f"{eval_accuracy:.4f}",
            "—" if "samples_per_second" not in s else f"{s['samples_per_second']:.1f}",
            "—" if link_mb is None else f"{link_mb:.1f}",
            "—" if "grad_sync_bytes" not in s else f"{s['grad_sync_bytes'] / 1e6:.1f}",
            "—" if "wall_seconds" not in s else f"{s['wall_seconds']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_runs(runs: list[Run], path: Path) -> None:
    """Training loss per step of every run on one axis (evaluation losses as markers when recorded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        line, = ax.plot([r["step"] for r in run.records], [r["loss"] for r in run.records], lw=1.2, label=run.label)
        if run.evals:
            ax.plot([e["step"] for e in run.evals], [e["loss"] for e in run.evals], "o--", color=line.get_color(),
                    ms=4, lw=0.8, label=f"{run.name} eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("aqpipe runs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(directories: list[str], out: str | Path) -> str:
    """Load every run, write the plot to `out`, and return the summary table."""
    if not directories:
        raise ReportError("name at least one run directory")
    runs = [load_run(d) for d in directories]
    if len({r.name for r in runs}) != len(runs):  # two runs named alike would share a legend entry
        for run in runs:
            run.name = str(run.path)
    plot_runs(runs, Path(out))
    return summary_table(runs)
