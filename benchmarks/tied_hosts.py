"""A tied-embedding LLM over simulated hosts: what the dense tied all-reduce cost, and what exchanging rows saves.

The model (benchmarks.models:llama_tied_4x128) has SmolLM2's real 49,152-row vocabulary tied between the input
embedding and the LM head, and one decoder layer of hidden 128 per stage, so its links are the bottleneck on a
CPU. Four simulated hosts (tests/hosts.py: each a network namespace behind a `tc tbf` link of --rate, with a private
disk), one rank each, one `torchrun … -m aqpipe launch` per host. For each variant (fp32 links or AQ-SGD fw3/bw6,
tied table exchanged as rows or all-reduced whole), it records samples/s (median over the measured steps: those
of the last epoch, after AQ-SGD's fp32 first sight) and the bytes per step of every traffic class, and the fp32
comm/compute ratio (one fp32 activation's time on the wire over the slowest stage's forward of one micro-batch).

    sudo python benchmarks/tied_hosts.py --rate 4mbit --out benchmarks/results/tied-hosts
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aqpipe.config.rates import parse_rate  # noqa: E402
from benchmarks.provenance import machine, recorded  # noqa: E402
from tests.hosts import simulated_hosts, wait_all  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "wikitext-2" / "valid.txt"
VARIANTS = {  # name -> (fw, bw, tied exchange)
    "fp32, rows": ("fp32", "fp32", "rows"),
    "aqsgd fw3 bw6, rows": ("aqsgd:3", "directq:6", "rows"),
    "fp32, rows:bf16": ("fp32", "fp32", "rows:bf16"),
    "aqsgd fw3 bw6, rows:bf16": ("aqsgd:3", "directq:6", "rows:bf16"),
    "fp32, dense": ("fp32", "fp32", "dense"),
    "aqsgd fw3 bw6, dense": ("aqsgd:3", "directq:6", "dense"),
}
CLASSES = ("link_payload", "link_framing", "tied", "control")


def run(args, variant: str, work: Path) -> dict:
    """One launch of a variant over 4 simulated hosts; its per-step records and summary."""
    fw, bw, exchange = VARIANTS[variant]
    root = work / variant.replace(" ", "-").replace(",", "")
    with simulated_hosts(root, 4, 1, parse_rate(args.rate), port=29541) as hosts:
        out = hosts.mount / "run"
        launch = ("launch", "--model", "benchmarks.models:llama_tied_4x128", "--pp", "4", "--partition", "2,1,1,2",
                  "--data", str(args.data), "--vocab-size", "4096", "--seq-len", str(args.seq_len),
                  "--micro-batch-size", str(args.mbs), "--micro-batches", str(args.mb),
                  "--max-samples", str(args.mbs * args.mb * args.steps_per_epoch), "--epochs", str(args.epochs),
                  "--fw", fw, "--bw", bw, "--tied-exchange", exchange, "--eval-every", "0", "--no-progress",
                  "--out", str(out), "--stall-timeout", "1200", "--schedule", "gpipe",
                  "--warmup-epochs", "1", "--first-sight", "fp32")  # an fp32 first epoch, as in every fine-tuning benchmark
        start = time.perf_counter()
        procs = [hosts.start(h, *launch, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}) for h in range(4)]
        codes = wait_all(procs, args.timeout)
        wall = time.perf_counter() - start
        if codes != [0, 0, 0, 0]:
            raise SystemExit(f"{variant}: hosts exited {codes}:\n"
                             + (hosts.disk(0) / "torchrun.log").read_text(errors="replace")[-3000:])
        records = [json.loads(line) for line in hosts.on_disk(0, out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads(hosts.on_disk(0, out / "summary.json").read_text())
    measured = [r for r in records if r["epoch"] == records[-1]["epoch"]]
    per_step = {name: statistics.fmean(sum(r.get(f, 0) for f in fields) for r in measured)
                for name, fields in (("link_payload", ("fwd_bytes", "bwd_bytes")),
                                     ("link_framing", ("fwd_framing_bytes", "bwd_framing_bytes")),
                                     ("tied", ("tied_bytes",)), ("control", ("control_bytes",)))}
    forward = max(statistics.median(r["stage_forward_seconds"][s] for r in measured) for s in range(4)) / args.mb
    return {"variant": variant, "samples_per_second": statistics.median(r["samples_per_second"] for r in measured),
            "step_seconds": statistics.median(r["step_seconds"] for r in measured), "bytes_per_step": per_step,
            "slowest_forward_seconds_per_micro_batch": forward, "steps_measured": len(measured),
            "final_loss": summary["final_loss"], "wall_seconds": wall, "traffic": summary["traffic"]}


def write_markdown(results: list[dict], args, info: dict, path: Path) -> None:
    fp32 = {r["variant"].split(", ")[1]: r for r in results if r["variant"].startswith("fp32")}
    activation = args.mbs * args.seq_len * 128 * 4
    wire = 8 * activation / parse_rate(args.rate)
    lines = [f"Tied-embedding LLM over 4 simulated hosts at {args.rate}: {info}", "",
             "| variant | samples/s | vs fp32 (same exchange) | step s | link payload MB/step | framing kB/step | "
             "tied MB/step | control kB/step |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        exchange = r["variant"].split(", ")[1]
        base = fp32.get(exchange)
        ratio = f"{r['samples_per_second'] / base['samples_per_second']:.2f}x" if base else "-"
        b = r["bytes_per_step"]
        lines.append(f"| {r['variant']} | {r['samples_per_second']:.2f} | {ratio} | {r['step_seconds']:.2f} | "
                     f"{b['link_payload'] / 1e6:.2f} | {b['link_framing'] / 1e3:.1f} | {b['tied'] / 1e6:.2f} | "
                     f"{b['control'] / 1e3:.1f} |")
    forward = max(r["slowest_forward_seconds_per_micro_batch"] for r in results)
    lines += ["", f"fp32 comm/compute ratio: one {activation / 1e3:.0f} kB fp32 activation takes {wire * 1e3:.0f} ms "
                  f"on the wire, the slowest stage's forward of a micro-batch {forward * 1e3:.0f} ms: "
                  f"{wire / forward:.1f}"]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="4mbit")
    parser.add_argument("--variants", default=";".join(VARIANTS), help="names separated by ;")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--mb", type=int, default=8)
    parser.add_argument("--steps-per-epoch", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tied-hosts"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="aqpipe-tied-") as work:
        for variant in args.variants.split(";"):
            results.append(run(args, variant, Path(work)))
            print(json.dumps(results[-1]), flush=True)
    info = machine()
    Path(args.out + ".json").write_text(json.dumps({"machine": info, "args": recorded(vars(args)),
                                                    "results": recorded(results)}, indent=2) + "\n")
    write_markdown(results, args, info, Path(args.out + ".md"))
    print(Path(args.out + ".md").read_text())


if __name__ == "__main__":
    main()
