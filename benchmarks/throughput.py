"""Throughput vs bandwidth on tc-throttled links, like Tables 2, 3 and 5 of the AQ-SGD paper.

Every system trains the same communication-bound model (benchmarks.models:gpt2_2x128 over 2 stages, or
gpt2_4x128 over 4 with --pp 4: one GPT-2 block of hidden 128 per stage, a 512-token vocabulary) on WikiText-2 at
bandwidths {unthrottled (loopback), 1gbit, 500mbit, 300mbit, 100mbit, 30mbit, 25mbit}: aqpipe with fp32, fp16,
directq fw3 bw6, aqsgd fw3 bw6 and aqsgd fw4 bw8 under each schedule of --schedules, and DeepSpeed's pipeline
engine (fp32), each rank in its own network namespace behind `tc tbf` (aqpipe's own --bandwidth; DeepSpeed's
ranks are started inside an aqpipe topology). Systems alternate inside each round. Throughput is measured after
the first epoch (AQ-SGD's first sight of every sample goes in fp32 by design).

    python benchmarks/throughput.py --rounds 3 --out benchmarks/results/throughput     # about 45 minutes here
    python benchmarks/throughput.py --schedules gpipe,1f1b --no-deepspeed --pp 4 \
        --bandwidths unthrottled,100mbit,30mbit,25mbit --variants "fp32,aqsgd fw3 bw6,aqsgd fw3 bw4"
Writes <out>.json (every measurement), <out>.md (Table 2 and Table 3 shapes, targets) and <out>.png.
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

from aqpipe.compress.link.specs import DEFAULT_BW, DEFAULT_FIRST_SIGHT, DEFAULT_FW  # noqa: E402
from aqpipe.launch import netns  # noqa: E402
from aqpipe.pipeline.vocab.schedule import SCHEDULES  # noqa: E402
from benchmarks.provenance import machine, recorded  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "wikitext-2" / "valid.txt"
# 25mbit: where fp32's comm/compute ratio is about 8.5 on the 2-core machine of benchmarks/README.md; the AQ-SGD
# paper's 100 Mbps regime is a ratio of about 11-12, so a run for that regime names the bandwidth that gives it
# (e.g. 19mbit) and reads the ratio off the table
BANDWIDTHS = ["unthrottled", "1gbit", "500mbit", "300mbit", "100mbit", "30mbit", "25mbit"]
VARIANTS = {"fp32": ("fp32", "fp32"), "fp16": ("fp16", "fp16"), "directq fw3 bw6": ("directq:3", "directq:6"),
            "aqsgd fw3 bw6": ("aqsgd:3", "directq:6"), "aqsgd fw4 bw8": ("aqsgd:4", "directq:8")}
# not in the default grid: 4-bit gradients, the remedy for the backward link being the bottleneck at 25 Mbit; link
# codecs as they start a run (with --whole-run): the paper's fp32 first epoch with aqsgd:4 / directq:8 ("defaults
# before"), the same codecs with rotated 4-bit first sights from step 1 ("first rtq4 fw4 bw8"), 3-bit deltas and
# rotated 4-bit gradients with rtq:4 first sights, and this commit's defaults (launch_args asks for fp32 first sights,
# so each variant names its own)
EXTRA = {"aqsgd fw3 bw4": ("aqsgd:3", "directq:4"),
         "defaults before": ("aqsgd:4", "directq:8", ("--warmup-epochs", "1")),
         "first rtq4 fw4 bw8": ("aqsgd:4", "directq:8", ("--first-sight", "rtq:4", "--warmup-epochs", "0")),
         "first rtq4 fw3 bw rtq4": ("aqsgd:3", "rtq:4", ("--first-sight", "rtq:4", "--warmup-epochs", "0")),
         "defaults": (DEFAULT_FW, DEFAULT_BW, ("--first-sight", DEFAULT_FIRST_SIGHT, "--warmup-epochs", "0"))}
DEEPSPEED = "DeepSpeed fp32"
MODELS = {2: ("benchmarks.models:gpt2_2x128", "parameters"), 4: ("benchmarks.models:gpt2_4x128", "2,1,1,2")}


def system_name(variant: str, schedule: str, schedules: list[str]) -> str:
    """A variant under a schedule; plain when only one schedule is measured."""
    return variant if len(schedules) == 1 else f"{variant} · {schedule}"


def launch_args(args, fw: str, bw: str, bandwidth: str, out: Path, schedule: str = "gpipe") -> list[str]:
    model, partition = MODELS[args.pp]
    cmd = [sys.executable, "-m", "aqpipe", "launch", "--overwrite", "--model", model, "--pp", str(args.pp),
           "--partition", partition, "--schedule", schedule,
           "--data", str(args.data), "--vocab-size", "512", "--seq-len", str(args.seq_len),
           "--micro-batch-size", str(args.mbs), "--micro-batches", str(args.mb),
           "--max-samples", str(args.mbs * args.mb * args.steps_per_epoch), "--epochs", str(args.epochs),
           "--warmup-epochs", "0", "--first-sight", "fp32", "--fw", fw, "--bw", bw, "--device", args.device,
           "--out", str(out), "--no-progress"]
    return cmd + ([] if bandwidth == "unthrottled" else ["--bandwidth", bandwidth])


def run_aqpipe(args, variant: str, bandwidth: str, work: Path, schedule: str = "gpipe") -> dict:
    """One run; its throughput and per-micro-batch breakdown over the epochs after the first (with --whole-run, its
    throughput is every sample of the run over the run's training time, the first epoch included)."""
    fw, bw, *flags = {**VARIANTS, **EXTRA}[variant]
    out = work / f"{variant.replace(' ', '_')}-{schedule}-{bandwidth}-{time.monotonic_ns()}"
    # a whole run is timed without evaluations (the run's last step would carry the final one's time)
    whole = ["--eval-every", "0"] if args.whole_run else []
    proc = subprocess.run(launch_args(args, fw, bw, bandwidth, out, schedule) + [*(flags[0] if flags else ()), *whole],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} at {bandwidth} failed: {proc.stderr[-1500:]}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    result = _after_first_epoch(args, records) | {"config": str(out / "config.json")}
    if args.whole_run:
        result["samples_per_second_after_first_epoch"] = result["samples_per_second"]
        result["samples_per_second"] = args.mbs * args.mb * len(records) / records[-1]["elapsed_seconds"]
        result["link_bytes"] = sum(r["fwd_bytes"] + r["bwd_bytes"] for r in records)
    return result


def _after_first_epoch(args, records: list[dict]) -> dict:
    """Throughput and per-micro-batch breakdown over the epochs after the first."""
    measured = [r for r in records if r["epoch"] >= 1][1:]  # the first compressed step still fills caches
    ends = [r["elapsed_seconds"] for r in records if r["epoch"] >= 1]
    period = statistics.median(b - a for a, b in zip(ends[1:], ends[2:]))
    per_mb = args.mb

    def median_of(key, index=None, reduce=max):
        return statistics.median(reduce(r[key]) if index is None else r[key][index] for r in measured)

    return {
        "samples_per_second": args.mbs * args.mb / period,
        "forward_ms": 1000 * median_of("stage_forward_seconds") / per_mb,
        "backward_ms": 1000 * median_of("stage_backward_seconds") / per_mb,
        "fwd_wire_ms": 1000 * median_of("link_fwd_wire_seconds", 0) / per_mb,
        "bwd_wire_ms": 1000 * median_of("link_bwd_wire_seconds", 0) / per_mb,
        "fwd_bytes_per_micro_batch": median_of("link_fwd_bytes", 0) / per_mb,
        "bwd_bytes_per_micro_batch": median_of("link_bwd_bytes", 0) / per_mb,
        "fwd_rate_mbit": 8 * median_of("link_fwd_bytes_per_second", 0) / 1e6,
        "bwd_rate_mbit": 8 * median_of("link_bwd_bytes_per_second", 0) / 1e6,
        "stage0_peak_activation_mb": median_of("stage_peak_activation_bytes", 0) / 1e6,
    }


def run_deepspeed(args, config: str, bandwidth: str, work: Path) -> dict:
    """DeepSpeed's engine on the config of an aqpipe fp32 run, its two ranks in a topology at `bandwidth`."""
    result = work / f"ds-{bandwidth}-{time.monotonic_ns()}.json"
    steps = args.epochs * args.steps_per_epoch
    command = [sys.executable, str(ROOT / "benchmarks" / "deepspeed_pipe.py"), "--config", config,
               "--steps", str(steps), "--result", str(result)]
    port = str(29600 + time.monotonic_ns() % 300)

    def start(prefixes: list[list[str]], address: str, interface: str | None) -> None:
        procs = []
        for rank, prefix in enumerate(prefixes):
            env = dict(os.environ, DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR=address, MASTER_PORT=port, PYTHONPATH=str(ROOT))
            if interface:
                env["GLOO_SOCKET_IFNAME"] = interface
            procs.append(subprocess.Popen(prefix + command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"DeepSpeed at {bandwidth} failed: {outputs[0][-1500:]}")

    if bandwidth == "unthrottled":
        start([[], []], "127.0.0.1", None)
    else:
        with netns.throttled(2, netns.parse_rate(bandwidth)) as topo:
            start([topo.exec_prefix(0), topo.exec_prefix(1)], topo.address(0), netns.INTERFACE)
    seconds = json.loads(result.read_text())["step_seconds"][args.steps_per_epoch + 1:]
    return {"samples_per_second": args.mbs * args.mb / statistics.median(seconds)}


def summarize(runs: dict, bandwidths: list[str]) -> dict:
    """Medians over rounds of every number, per system and bandwidth."""
    table: dict = {}
    for system, by_bw in runs.items():
        table[system] = {}
        for bw in bandwidths:
            rounds = by_bw.get(bw, [])
            if rounds:
                table[system][bw] = {k: statistics.median(r[k] for r in rounds)
                                     for k in rounds[0] if isinstance(rounds[0][k], (int, float))}
                table[system][bw]["range"] = [min(r["samples_per_second"] for r in rounds),
                                              max(r["samples_per_second"] for r in rounds)]
    return table


def regime_ratio(table: dict, bw: str, fp32: str = "fp32") -> float:
    """fp32's comm/compute ratio as the paper counts it: one activation's time on the wire over one micro-batch's
    forward on a stage (about 12 in the AQ-SGD paper at 100 Mbps)."""
    row = table[fp32][bw]
    return row["fwd_wire_ms"] / row["forward_ms"]


def write_markdown(table: dict, bandwidths: list[str], info: dict, path: Path) -> None:
    sps = {s: {bw: table[s][bw]["samples_per_second"] for bw in table[s]} for s in table}
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, commit "
             f"{info['commit']}. pp={info['pp']}. Median of {info['rounds']} rounds; samples/s "
             f"{'over the whole run (no evaluation)' if info.get('whole_run') else 'after the first epoch'}; the "
             "per-micro-batch table after the first epoch.", "",
             "### Throughput (samples/s), like the paper's Table 2", "",
             "| system | " + " | ".join(bandwidths) + " |", "|---|" + "---|" * len(bandwidths)]
    for system in table:
        lines.append(f"| {system} | " + " | ".join(f"{sps[system].get(bw, float('nan')):.1f}" for bw in bandwidths) + " |")
    fp32 = next((s for s in table if s.split(" · ")[0] == "fp32"), None)
    if fp32 is not None:
        lines.append("| fp32 comm/compute ratio | " + " | ".join(f"{regime_ratio(table, bw, fp32):.2f}"
                                                                 for bw in bandwidths) + " |")
        lines.append("| fp32 achieved link rate (Mbit/s) | " + " | ".join(
            f"{table[fp32][bw]['fwd_rate_mbit']:.0f}" for bw in bandwidths) + " |")
    lines += ["", "### Per micro-batch: compute vs communication (ms), like the paper's Table 3", "",
              "| system | bandwidth | forward | backward | activation on the wire | gradient on the wire | "
              "activation bytes | gradient bytes | achieved Mbit/s (fwd) | stage-0 peak activations (MB) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for system in [s for s in table if s != DEEPSPEED]:
        for bw in bandwidths:
            row = table.get(system, {}).get(bw)
            if row:
                lines.append(f"| {system} | {bw} | {row['forward_ms']:.1f} | {row['backward_ms']:.1f} | "
                             f"{row['fwd_wire_ms']:.1f} | {row['bwd_wire_ms']:.1f} | {row['fwd_bytes_per_micro_batch']:.0f} | "
                             f"{row['bwd_bytes_per_micro_batch']:.0f} | {row['fwd_rate_mbit']:.0f} | "
                             f"{row.get('stage0_peak_activation_mb', float('nan')):.2f} |")
    if " · " in next(iter(table)):
        path.write_text("\n".join(lines + schedule_ratios(table, bandwidths, sps)) + "\n")
        return
    aq, dq = "aqsgd fw3 bw6", "directq fw3 bw6"
    if not {aq, dq, "fp32"} <= set(table):  # a partial run: no targets to state
        path.write_text("\n".join(lines) + "\n")
        return
    lines += ["", "### Targets", ""]
    for bw in [b for b in ("100mbit", "30mbit", "25mbit") if b in bandwidths]:
        own = sps[aq][bw] / sps[aq]["unthrottled"] if "unthrottled" in sps[aq] else float("nan")
        lines += [f"At {bw} (fp32 comm/compute ratio {regime_ratio(table, bw):.1f}):",
                  f"- aqsgd fw3bw6 / its own unthrottled: {own:.2f} (target ≥ 0.85)",
                  f"- aqsgd fw3bw6 / fp32: {sps[aq][bw] / sps['fp32'][bw]:.2f} (target ≥ 4)",
                  f"- aqsgd fw3bw6 / DeepSpeed fp32: {sps[aq][bw] / sps[DEEPSPEED][bw]:.2f} (target ≥ 4)"
                  if DEEPSPEED in sps and bw in sps[DEEPSPEED] else "- DeepSpeed: not measured",
                  f"- aqsgd fw3bw6 / directq fw3bw6: {sps[aq][bw] / sps[dq][bw]:.3f} (target ≥ 0.97)", ""]
    path.write_text("\n".join(lines) + "\n")


def schedule_ratios(table: dict, bandwidths: list[str], sps: dict) -> list[str]:
    """Each variant's throughput under each schedule other than GPipe over its throughput under GPipe, per bandwidth
    (above 1: that schedule is the faster); nothing when GPipe was not measured."""
    if not any(s.endswith(" · gpipe") for s in table):
        return []  # nothing to set them against
    variants = list(dict.fromkeys(s.split(" · ")[0] for s in table if " · " in s))
    schedules = list(dict.fromkeys(s.split(" · ")[1] for s in table if " · " in s and not s.endswith(" · gpipe")))
    lines = ["", "### Each schedule over GPipe (samples/s ratio)", "", "| variant | schedule | " + " / ".join(bandwidths)
             + " |", "|---|---|---|"]
    for variant in variants:
        gpipe = sps.get(f"{variant} · gpipe")
        for schedule in schedules:
            own = sps.get(f"{variant} · {schedule}")
            if gpipe is None or own is None:  # (that variant was not run under both)
                continue
            ratios = " / ".join(f"{own[bw] / gpipe[bw]:.2f}" if bw in own and bw in gpipe else "—" for bw in bandwidths)
            lines.append(f"| {variant} | {schedule} | {ratios} |")
    return lines


def plot(table: dict, bandwidths: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    xs = list(range(len(bandwidths)))
    for system in table:
        ys = [table[system].get(bw, {}).get("samples_per_second", float("nan")) for bw in bandwidths]
        ax.plot(xs, ys, marker="o", ls="--" if system == DEEPSPEED else "-", label=system)
    ax.set_xticks(xs, bandwidths)
    ax.set_xlabel("bandwidth per link (tc tbf)")
    ax.set_ylabel("samples / s")
    ax.set_title("one GPT-2 block of hidden 128 per stage: throughput vs bandwidth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bandwidths", default=",".join(BANDWIDTHS))
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma list of aqpipe variants from: {', '.join([*VARIANTS, *EXTRA])}")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--schedules", default="gpipe",
                        help=f"comma list of schedules to compare: {', '.join(SCHEDULES)}")
    parser.add_argument("--pp", type=int, default=2, choices=sorted(MODELS))
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--mb", type=int, default=8)
    parser.add_argument("--steps-per-epoch", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "throughput"))
    parser.add_argument("--whole-run", action="store_true", help="samples/s over every step of each run, the first "
                                                                      "epoch included (default: after the first epoch)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: every rank on this machine's GPU(s), ranks "
                                                        "sharing one when there are more ranks than GPUs")
    args = parser.parse_args()
    problem = netns.can_throttle()
    if problem:
        sys.exit(f"throughput benchmark: {problem}")
    bandwidths, variants, schedules = args.bandwidths.split(","), args.variants.split(","), args.schedules.split(",")
    if not args.no_deepspeed and args.pp != 2:
        sys.exit("throughput benchmark: the DeepSpeed baseline runs with --pp 2 only; add --no-deepspeed")
    named = [(system_name(v, s, schedules), v, s) for v in variants for s in schedules]
    systems = [name for name, _, _ in named] + ([] if args.no_deepspeed else [DEEPSPEED])
    runs: dict[str, dict[str, list[dict]]] = {s: {bw: [] for bw in bandwidths} for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for bw in bandwidths:
                for name, variant, schedule in named:
                    runs[name][bw].append(run_aqpipe(args, variant, bw, Path(tmp), schedule))
                    print(f"round {r + 1} {bw:>11} {name:>24}: {runs[name][bw][-1]['samples_per_second']:.1f} "
                          f"samples/s", flush=True)
                if not args.no_deepspeed:
                    config = next(runs[name][bw][-1]["config"] for name, _, _ in named)
                    runs[DEEPSPEED][bw].append(run_deepspeed(args, config, bw, Path(tmp)))
                    print(f"round {r + 1} {bw:>11} {DEEPSPEED:>16}: {runs[DEEPSPEED][bw][-1]['samples_per_second']:.1f} "
                          f"samples/s", flush=True)
    info = dict(machine(), rounds=args.rounds, pp=args.pp, whole_run=args.whole_run)
    table = summarize(runs, bandwidths)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": info, "settings": recorded(vars(args)),
                                                    "runs": recorded(runs), "medians": table}, indent=2) + "\n")
    write_markdown(table, bandwidths, info, out.with_suffix(".md"))
    plot(table, bandwidths, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
