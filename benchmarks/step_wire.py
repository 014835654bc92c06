"""The plan's least step time at --bandwidth against throttled runs' measured step times.

For a few pipelines (3 and 4 stages, GPipe and 1F1B, fp32 and compressed links, a tied embedding's row exchange),
print the capacity plan's least step time on the wire (`aqpipe.runtime.capacity.step_wire`: every rank behind a link of its
own), the earlier count (each stage-to-stage link alone, no tied rows), and the median step time of a real run under
`aqpipe launch --bandwidth` (network namespaces with tc tbf; needs root). A least time is a lower bound: the measured
time should lie above it, and, where the wire dominates, not far above.

    python benchmarks/step_wire.py [--bandwidth 4mbit] [--steps 5] [--out benchmarks/results/step-wire]

Writes <out>.json (every step time, the machine and commit) and <out>.md (the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.provenance import machine  # noqa: E402

CASES = [
    ("gpt2-tiny", 3, "1f1b", "fp32", "fp32"),
    ("gpt2-tiny", 3, "gpipe", "fp32", "fp32"),
    ("gpt2-tiny", 4, "1f1b", "aqsgd:4", "directq:8"),
    ("llama-tiny", 3, "1f1b", "fp32", "fp32"),
]


def flags(model: str, pp: int, schedule: str, fw: str, bw: str, bandwidth: str, steps: int) -> list[str]:
    """The launch flags of one case."""
    return ["--model", model, "--pp", str(pp), "--schedule", schedule, "--fw", fw, "--bw", bw, "--seq-len", "64",
            "--micro-batch-size", "4", "--micro-batches", "8", "--max-samples", "256", "--warmup-epochs", "0",
            "--first-sight", "fp32", "--bandwidth", bandwidth, "--eval-every", "0", "--steps", str(steps),
            "--stall-timeout", "300", "--no-progress"]


def planned(args: list[str], out: Path) -> tuple[float, float]:
    """(The plan's least step time on the wire, the per-link count it replaced), in the run's compressed phase."""
    import dataclasses

    from aqpipe.cli import _parser
    from aqpipe.config import RunConfig, build_config, resolve
    from aqpipe.runtime.capacity.links import FIRST_EPOCH
    from aqpipe.runtime.capacity.plan import plan_capacity
    from aqpipe.runtime.plan import make_plan

    parsed = _parser().parse_args(["launch", *args, "--out", str(out)])
    values = {f.name: getattr(parsed, f.name) for f in dataclasses.fields(RunConfig) if f.name != "stage_bounds"}
    capacity = plan_capacity(make_plan(resolve(build_config({}, values))))
    phase = FIRST_EPOCH  # every step of a short run without a warm-up sees its samples for the first time
    per_link = [capacity.link_seconds(link, phase) or (0.0, 0.0) for link in capacity.links]
    overlapped = capacity.cfg.schedule != "gpipe"
    earlier = max((max(t) if overlapped else sum(t)) for t in per_link)
    return capacity.step_wire_seconds(phase) or 0.0, earlier


def measured(args: list[str], out: Path) -> list[float]:
    """Step times of a real throttled run (all steps but the first, which starts the pipeline's streams)."""
    proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", *args, "--out", str(out)], capture_output=True,
                          text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_seconds"] for r in records[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="4mbit")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step-wire"))
    opts = parser.parse_args()
    print(f"{'case':<40} {'plan (s)':>9} {'earlier (s)':>12} {'measured median (s) [min-max]':>32}")
    rows = []
    for case in CASES:
        args = flags(*case, opts.bandwidth, opts.steps)
        with tempfile.TemporaryDirectory() as tmp:
            bound, earlier = planned(args, Path(tmp) / "plan")
            times = measured(args, Path(tmp) / "run")
        name = f"{case[0]} pp{case[1]} {case[2]} {case[3]}/{case[4]}"
        rows.append({"case": name, "plan_seconds": bound, "earlier_seconds": earlier, "step_seconds": times})
        print(f"{name:<40} {bound:9.2f} {earlier:12.2f} {statistics.median(times):>14.2f} "
              f"[{min(times):.2f}-{max(times):.2f}]", flush=True)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.with_suffix(".json").write_text(json.dumps(
        {"machine": machine(), "bandwidth": opts.bandwidth, "steps": opts.steps, "cases": rows}, indent=2))
    lines = ["| case | plan (s) | measured median (s) [range] |", "|---|---|---|"]
    lines += [f"| {r['case']} | {r['plan_seconds']:.2f} | {statistics.median(r['step_seconds']):.2f} "
              f"[{min(r['step_seconds']):.2f}–{max(r['step_seconds']):.2f}] |" for r in rows]
    opts.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
