"""Start-up and tail of `aqpipe launch` and of the Python API: seconds to the plan, to the first step and to exit,
A/B against a baseline.

Each launch runs `python -m aqpipe launch --model M --pp 4 --steps 1 --eval-every 0` (`--models python-api`:
`python examples/custom_model.py`, 3 ranks, 30 steps) with unbuffered output, and the clock stops at the first line
starting `aqpipe: ` (the plan), at the first `step 1/` line and at exit; "tail" is exit minus the last step line
(checkpoint, export, plot, summary). The baseline is a git commit checked out in
a temporary worktree and imported through PYTHONPATH (the ranks inherit it); rounds alternate baseline and
current, and medians with their spread are reported.

    python benchmarks/startup.py --baseline f507492 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import machine  # noqa: E402

MODELS = {"gpt2-tiny": [], "smollm2-135m": [], "python-api": []}
SCRIPT = Path("examples") / "custom_model.py"  # what `python-api` runs


def launch_once(source: Path, model: str, extra: list[str], out: Path) -> dict[str, float]:
    """One launch from the package in `source`; seconds from start to plan, first step, last step and exit."""
    env = dict(os.environ, PYTHONPATH=str(source), PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "aqpipe", "launch", "--model", model, "--pp", "4", "--steps", "1",
            "--eval-every", "0", "--out", str(out), *extra]
    cwd = source
    if model == "python-api":  # (the script puts its run under runs/ in its working directory)
        argv, cwd = [sys.executable, str(source / SCRIPT)], out
        out.mkdir(parents=True)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks: dict[str, float] = {}
    lines = []
    for line in proc.stdout:
        now = time.perf_counter() - start
        lines.append(line)
        if line.startswith("aqpipe: ") and "plan" not in marks:
            marks["plan"] = now
        if line.startswith("step "):
            marks.setdefault("first_step", now)
            marks["last_step"] = now
    code = proc.wait()
    marks["exit"] = time.perf_counter() - start
    if code != 0 or "first_step" not in marks:
        raise SystemExit(f"launch from {source} failed with {code}:\n{''.join(lines[-20:])}")
    marks["tail"] = marks["exit"] - marks["last_step"]
    return marks


def baseline_checkout(commit: str, into: Path) -> Path:
    """A worktree of `commit` (removed by the caller's temporary directory; pruned from git at the end)."""
    path = into / f"baseline-{commit}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True,
                   capture_output=True)
    return path


def summarise(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median, least and most of every mark."""
    return {mark: {"median": statistics.median(s[mark] for s in samples), "min": min(s[mark] for s in samples),
                   "max": max(s[mark] for s in samples)} for mark in samples[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="a commit to compare against (omit: the current tree only)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "startup.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aqpipe-startup-") as tmp:
        variants = {"current": ROOT}
        if args.baseline:
            variants = {args.baseline: baseline_checkout(args.baseline, Path(tmp)), **variants}
        try:
            samples: dict[str, dict[str, list]] = {m: {v: [] for v in variants} for m in args.models}
            for model in args.models:
                launch_once(ROOT, model, MODELS[model], Path(tmp) / "warm")  # caches (GGUF conversion) and page cache
                for round_ in range(args.rounds):
                    for name, source in variants.items():
                        marks = launch_once(source, model, MODELS[model], Path(tmp) / f"{name}-{round_}-{model}")
                        samples[model][name].append(marks)
                        print(f"{model:13s} {name:8s} round {round_}: "
                              + "  ".join(f"{k} {v:6.2f}s" for k, v in marks.items()), flush=True)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(variants[args.baseline])], capture_output=True)
    result = {
        "machine": machine(),
        "rounds": args.rounds, "samples": samples,
        "summary": {m: {v: summarise(s) for v, s in by_variant.items()} for m, by_variant in samples.items()},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"\nmedian seconds over {args.rounds} rounds (min-max):")
    for model, by_variant in result["summary"].items():
        for name, marks in by_variant.items():
            print(f"{model:13s} {name:8s} " + "  ".join(
                f"{mark} {m['median']:.2f} ({m['min']:.2f}-{m['max']:.2f})" for mark, m in marks.items()))


if __name__ == "__main__":
    main()
