"""aqpipe's fp32 pipeline vs DeepSpeed's pipeline engine: samples/s for pp in {1, 2, 4}, same model, data,
partition and micro-batches, alternating the two systems round by round.

    python benchmarks/pipeline_throughput.py --rounds 3 --steps 20 --out benchmarks/results/pipeline
Writes <out>.json (every measurement) and <out>.md (medians, ratios, spread).
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
from benchmarks.provenance import machine, recorded  # noqa: E402

SKIP = 3  # first steps left out of every median (allocation, gloo connection set-up)


def run_aqpipe(pp: int, args, work: Path) -> tuple[float, Path]:
    out = work / f"aq-pp{pp}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "aqpipe", "launch", "--overwrite", "--model", args.model, "--pp", str(pp), "--steps", str(args.steps),
           "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.mbs), "--micro-batches", str(args.mb),
           "--fw", "fp32", "--bw", "fp32", "--warmup-epochs", "0", "--schedule", "gpipe", "--device", "cpu", "--out", str(out),
           "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # the period between consecutive steps on rank 0: everything a step costs, metrics gathering included
    ends = [r["elapsed_seconds"] for r in records]
    seconds = statistics.median(b - a for a, b in zip(ends[SKIP:], ends[SKIP + 1:]))
    return args.mbs * args.mb / seconds, out / "config.json"


def run_deepspeed(pp: int, config: Path, args, work: Path) -> float:
    result = work / f"ds-pp{pp}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(pp),
           str(ROOT / "benchmarks" / "deepspeed_pipe.py"), "--config", str(config), "--steps", str(args.steps),
           "--result", str(result)]
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    seconds = json.loads(result.read_text())["step_seconds"][SKIP:]
    return args.mbs * args.mb / statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--mb", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline"))
    args = parser.parse_args()
    stages = [int(x) for x in args.pp.split(",")]
    samples: dict[str, dict[int, list[float]]] = {"aqpipe": {p: [] for p in stages}, "deepspeed": {p: [] for p in stages}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            for pp in stages:
                aq, config = run_aqpipe(pp, args, work)
                ds = run_deepspeed(pp, config, args, work)
                samples["aqpipe"][pp].append(aq)
                samples["deepspeed"][pp].append(ds)
                print(f"round {r + 1} pp={pp}: aqpipe {aq:.1f}  deepspeed {ds:.1f} samples/s", flush=True)
    result = {"machine": machine(), "settings": recorded(vars(args)), "samples_per_second": samples}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| pp | aqpipe samples/s (median) | DeepSpeed samples/s (median) | ratio | aqpipe range | DeepSpeed range |",
             "|---|---|---|---|---|---|"]
    for pp in stages:
        a, d = samples["aqpipe"][pp], samples["deepspeed"][pp]
        lines.append(f"| {pp} | {statistics.median(a):.1f} | {statistics.median(d):.1f} | "
                     f"{statistics.median(a) / statistics.median(d):.2f} | {min(a):.1f}–{max(a):.1f} | {min(d):.1f}–{max(d):.1f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
