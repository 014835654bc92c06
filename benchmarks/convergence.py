"""AQ-SGD vs DirectQ vs fp32 convergence (the AQ-SGD paper's Figure 3 pattern) on a 4-stage GPT-2-style model.

    python benchmarks/convergence.py --out benchmarks/results/convergence
Trains from scratch on WikiText-2 valid.txt (byte-level tokens), evaluates the final weights on test.txt, and writes
<out>.json, <out>.md (table) and <out>.png (training loss per step, every variant).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import machine, recorded  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "wikitext-2"
VARIANTS = {
    "fp32": ("fp32", "fp32"),
    "directq fw3 bw6": ("directq:3", "directq:6"),
    "aqsgd fw3 bw6": ("aqsgd:3", "directq:6"),
    "directq fw2 bw4": ("directq:2", "directq:4"),
    "aqsgd fw2 bw4": ("aqsgd:2", "directq:4"),
}
# Extra variants that separate the forward codec's share of a gap from the backward one's.
EXTRA = {
    "directq fw2 bw32": ("directq:2", "fp32"),
    "aqsgd fw2 bw32": ("aqsgd:2", "fp32"),
    "fp32 fw32 bw4": ("fp32", "directq:4"),
    # end-to-end compression (the paper's Figure 5): AQ-SGD activations, quantized gradients, QuantizedAdam
    # across replicas; run with --dp 2
    "e2e aqsgd fw3 bw6 qadam4": ("aqsgd:3", "directq:6", "qadam:4"),
    # rotated tile quantization: on AQ-SGD's deltas, on the gradients, and on the activations themselves
    "aqsgd-rtq fw2 bw4": ("aqsgd-rtq:2", "directq:4"),
    "aqsgd-rtq fw2 rtq bw4": ("aqsgd-rtq:2", "rtq:4"),
    "rtq fw2 bw4": ("rtq:2", "rtq:4"),
    # the contract's link codecs: with this script's fp32 warm-up epoch (the paper's schedule), and
    # compressed from the first step with rotated 4-bit first sights
    "aqsgd fw4 bw8": ("aqsgd:4", "directq:8"),
    "first rtq4 fw4 bw8": ("aqsgd:4", "directq:8", "none", ("--first-sight", "rtq:4", "--warmup-epochs", "0")),
    # aqpipe's default links and quantizer, compressed from the first step
    "defaults": ("aqsgd:3", "rtq:4", "none", ("--first-sight", "rtqo:3", "--warmup-epochs", "0", "--quant-scales",
                                              "channel", "--quant-rounding", "nearest", "--quant-grid", "signed")),
}


def train(name: str, fw: str, bw: str, args, work: Path, grad_sync: str = "none", flags: tuple[str, ...] = ()) -> Path:
    """One variant's run directory; `flags` (a variant's own) override the script's warm-up and first sight."""
    out = work / name.replace(" ", "_")
    cmd = [sys.executable, "-m", "aqpipe", "launch", "--overwrite", "--model", "benchmarks.models:gpt2_6x128", "--pp", "4",
           "--dp", str(args.dp), "--grad-sync", grad_sync,
           "--data", str(args.data / "valid.txt"), "--seq-len", "128", "--max-samples", str(args.samples),
           "--vocab-size", "260", "--micro-batch-size", "4", "--micro-batches", "4", "--epochs", str(args.epochs),
           "--lr", "1e-3", "--warmup-steps", "10", "--fw", fw, "--bw", bw, "--quant-rounding", args.rounding,
           "--quant-scales", args.scales, "--quant-grid", args.grid, "--seed", str(args.seed), "--device", "cpu",
           "--out", str(out), "--no-progress", "--warmup-epochs", str(args.warmup_epochs), "--first-sight", "fp32",
           *flags]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return out


def test_loss(run: Path, args) -> float:
    """Mean next-token loss of the run's final weights on test.txt, in one process."""
    from aqpipe.data.corpus import file_corpus
    from aqpipe.data.samples import chunk
    from aqpipe.data.tokenizer import train_bpe
    from aqpipe.stages.models import build_spec

    config = json.loads((run / "config.json").read_text())
    tokenizer = train_bpe(file_corpus(str(args.data / "valid.txt")), 260)
    samples = chunk(tokenizer.encode((args.data / "test.txt").read_text()), 128)
    spec = build_spec(config["model"], tokenizer.vocab_size, 128)
    bounds = config["stage_bounds"]
    layers = []
    for stage in range(len(bounds) - 1):
        state = torch.load(run / "checkpoints" / "final" / f"stage-{stage}.pt", weights_only=True)
        module = spec.build_stage(bounds[stage], bounds[stage + 1])
        module.load_state_dict(state)
        layers.append(module)
    model = torch.nn.Sequential(*layers).eval()
    ids = torch.arange(min(len(samples), args.eval_samples))
    with torch.no_grad():
        losses = [float(spec.loss(model(samples.inputs(b)), samples.targets(b))) for b in ids.split(16)]
    return sum(losses) / len(losses)


def aqsgd_by_epoch(records: list[dict]) -> dict[str, tuple[float, float]]:
    """Per epoch, the mean over steps and links of AQ-SGD's change and error (metrics.jsonl's link_aqsgd_change and
    link_aqsgd_error); empty for a run without AQ-SGD deltas."""
    sums: dict[str, list[list[float]]] = {}
    for r in records:
        for name, slot in (("link_aqsgd_change", 0), ("link_aqsgd_error", 1)):
            values = [v for v in r.get(name, []) if v is not None]
            sums.setdefault(str(r["epoch"]), [[], []])[slot].extend(values)
    return {e: (sum(c) / len(c), sum(m) / len(m)) for e, (c, m) in sums.items() if c and m}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--eval-samples", type=int, default=512)
    parser.add_argument("--scales", default="token", help="quantization scale granularity (per row = token)")
    parser.add_argument("--grid", default="signed", help="quantization grid (--quant-grid): signed, fit, symmetric, uniform")
    parser.add_argument("--rounding", default="stochastic", help="quantization rounding: stochastic or nearest")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-epochs", type=int, default=1, help="epochs every variant sends uncompressed (the "
                                                                      "paper's setup; a variant may override it)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (each with its shard of the samples)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma list from: {', '.join([*VARIANTS, *EXTRA])} (fp32 is always run first)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "convergence"))
    args = parser.parse_args()
    chosen = {"fp32": VARIANTS["fp32"]}
    for name in args.variants.split(","):
        chosen[name] = {**VARIANTS, **EXTRA}[name]
    out = Path(args.out)
    work = out.parent / (out.name + "-runs")
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, (fw, bw, *sync) in chosen.items():
        start = time.monotonic()
        run = train(name, fw, bw, args, work, *sync)  # type: ignore[arg-type]
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run / "summary.json").read_text())
        results[name] = {"fw": fw, "bw": bw, "grad_sync": str(sync[0]) if sync else "none", "final_loss": summary["final_loss"], "test_loss": test_loss(run, args),
                         "losses": [r["loss"] for r in records], "fwd_bytes": summary["link_bytes"]["fwd"],
                         "bwd_bytes": summary["link_bytes"]["bwd"], "minutes": (time.monotonic() - start) / 60,
                         "aqsgd_by_epoch": aqsgd_by_epoch(records)}
        print(f"{name:16s} final train loss {summary['final_loss']:.4f}  test loss {results[name]['test_loss']:.4f}",
              flush=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine(), "settings": recorded(vars(args)),
                                                    "results": results}, indent=2) + "\n")
    base = results["fp32"]["final_loss"]
    lines = ["| variant | fw | bw | grad sync | final train loss | gap to fp32 | test loss | fwd MB | bwd MB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['fw']} | {r['bw']} | {r['grad_sync']} | {r['final_loss']:.4f} | {100 * (r['final_loss'] / base - 1):+.1f}% | "
                     f"{r['test_loss']:.4f} | {r['fwd_bytes'] / 1e6:.1f} | {r['bwd_bytes'] / 1e6:.1f} |")
    tracked = {name: r["aqsgd_by_epoch"] for name, r in results.items() if r["aqsgd_by_epoch"]}
    if tracked:
        epochs = sorted({e for by_epoch in tracked.values() for e in by_epoch}, key=int)
        lines += ["", "AQ-SGD per epoch, mean over steps and links: ‖a − m_old‖/‖a‖ (what the delta carried) → "
                  "‖a − m_new‖/‖a‖ (what the next stage computed on)", "",
                  "| variant | " + " | ".join(f"epoch {int(e) + 1}" for e in epochs) + " |",
                  "|---|" + "---|" * len(epochs)]
        for name, by_epoch in tracked.items():
            cells = [f"{by_epoch[e][0]:.2f} → {by_epoch[e][1]:.2f}" if e in by_epoch else "" for e in epochs]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], lw=1.0, label=name,
                ls="-" if "aqsgd" in name or name == "fp32" else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("4-stage GPT-2 6x128 on WikiText-2 (byte tokens): fp32 vs DirectQ vs AQ-SGD")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
