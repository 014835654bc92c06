"""Fine-tuning a pretrained classifier over 3 stages: fp32 links vs AQ-SGD vs DirectQ (the AQ-SGD paper's
DeBERTa/CoLA experiment, scaled to a CPU): the packaged all-MiniLM-L6-v2 on the built-in acceptability task.

    python benchmarks/finetune.py --out benchmarks/results/finetune [--seeds 0 1] [--epochs 3]

Every variant trains with the same seed(s) and data order; the first epoch is the fp32 warm-up of AQ-SGD (as in
the paper). Writes <out>.json, <out>.md (table) and <out>.png (held-out accuracy and training loss per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import recorded  # noqa: E402

VARIANTS = {
    "fp32": ("fp32", "fp32"),
    "aqsgd fw2 bw4": ("aqsgd:2", "directq:4"),
    "directq fw2 bw4": ("directq:2", "directq:4"),
}


def train(name: str, fw: str, bw: str, seed: int, args, work: Path) -> dict:
    out = work / f"{name.replace(' ', '_')}-seed{seed}"
    cmd = [sys.executable, "-m", "aqpipe", "launch", "--overwrite", "--model", "minilm-l6", "--pp", "3", "--partition", "3,3,2",
           "--seq-len", "32", "--epochs", str(args.epochs), "--fw", fw, "--bw", bw, "--eval-every", str(args.eval_every),
           "--seed", str(seed), "--quant-grid", args.grid, "--device", "cpu", "--out", str(out), "--no-progress",
           "--warmup-epochs", "1", "--first-sight", "fp32"]  # the paper's fp32 warm-up epoch, in every run of these benchmarks
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"run": str(out), "summary": summary, "records": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/finetune")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=15)
    parser.add_argument("--grid", default="signed", help="quantization grid (--quant-grid): signed, fit, symmetric, uniform")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from: {', '.join(VARIANTS)} "
                                                                        "(fp32 always runs: it is the baseline)")
    args = parser.parse_args()
    chosen = {"fp32": VARIANTS["fp32"], **{n: VARIANTS[n] for n in args.variants.split(",")}}
    out = Path(args.out)
    work = out.parent / (out.name + "-runs")
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in chosen}
    for seed in args.seeds:  # variants alternate within each seed, so drifting machine load hits all alike
        for name, (fw, bw) in chosen.items():
            result = train(name, fw, bw, seed, args, work)
            s = result["summary"]
            print(f"{name} seed {seed}: accuracy {s['eval_accuracy']:.4f} MCC {s['eval_mcc']:.4f} "
                  f"eval loss {s['eval_loss']:.4f} train loss {s['final_loss']:.4f} fwd MB {s['link_bytes']['fwd'] / 1e6:.1f}",
                  flush=True)
            results[name].append(result)
    table = summarize(results)
    by_variant = {n: [{"seed": seed, **r["summary"]} for seed, r in zip(args.seeds, rs)] for n, rs in results.items()}
    out.with_suffix(".json").write_text(json.dumps(recorded(by_variant), indent=2) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    plot(results, out.with_suffix(".png"))
    print(table)


def summarize(results: dict[str, list[dict]]) -> str:
    rows = ["| variant | accuracy (mean) | per seed | MCC (mean) | eval loss | final train loss | fwd MB | bwd MB | samples/s |",
            "|---|---|---|---|---|---|---|---|---|"]
    base = statistics.fmean(r["summary"]["eval_accuracy"] for r in results["fp32"])
    for name, runs in results.items():
        s = [r["summary"] for r in runs]
        acc = statistics.fmean(x["eval_accuracy"] for x in s)
        per_seed = ", ".join(f"{x['eval_accuracy']:.4f}" for x in s)
        rows.append(
            f"| {name} | {acc:.4f} ({100 * (acc - base):+.1f} pt) | {per_seed} | "
            f"{statistics.fmean(x['eval_mcc'] for x in s):.4f} | {statistics.fmean(x['eval_loss'] for x in s):.4f} | "
            f"{statistics.fmean(x['final_loss'] for x in s):.4f} | {statistics.fmean(x['link_bytes']['fwd'] for x in s) / 1e6:.1f} | "
            f"{statistics.fmean(x['link_bytes']['bwd'] for x in s) / 1e6:.1f} | "
            f"{statistics.fmean(x['samples_per_second'] for x in s):.1f} |")
    return "\n".join(rows)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in results.items():
        color = None  # one colour per variant, its seeds drawn alike
        for i, run in enumerate(runs):
            evals = [r for r in run["records"] if "eval_accuracy" in r]
            label = name if i == 0 else None
            line, = left.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-", ms=3,
                              label=label, alpha=0.8, color=color)
            color = line.get_color()
            right.plot([r["step"] for r in run["records"]], [r["loss"] for r in run["records"]], lw=0.8,
                       color=color, label=label, alpha=0.8)
    left.set(xlabel="step", ylabel="held-out accuracy", title="MiniLM-L6, acceptability, pp=3")
    right.set(xlabel="step", ylabel="training loss")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
