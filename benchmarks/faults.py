"""The fault campaign: every way a hostile user or a failing machine can hurt a run, one row per case.

    python benchmarks/faults.py --out benchmarks/results/faults        # as root (tmpfs, network namespaces)
    python benchmarks/faults.py --only stall,disk                      # cases whose name contains a word

Each case starts `aqpipe launch` (or a store tool), does one bad thing to it, and records: the exit code (and the
one it should be), seconds from the fault to the exit, the failure line (the first stderr line that reports the end:
`aqpipe: error: …`, `aqpipe: run failed: …`; else the last line), whether anything followed it or a traceback
appeared, orphans (live processes of the case, network namespaces, temporary files), and what was lost. A row is
clean when the exit code is the expected one, the failure line is the last stderr line, no traceback was printed
and nothing was left behind. Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # (its harness, and the tests' helpers)
from fault_harness import LONG, QUICK, Case, Row, finish, listening_ports, markdown  # noqa: E402 - its harness
from fault_hosts import across_hosts  # noqa: E402 - the cases across hosts

from tests.processes import small_disk  # noqa: E402 - the repository's own test helpers
from tests.test_health import DAMAGE  # noqa: E402 - the three kinds of LMDB damage


# -- kills, stalls, disk -------------------------------------------------------------------------------------------
def kill_rank_mid_run(case: Case) -> list[Row]:
    """A rank SIGKILLed between checkpoints, then resumed."""
    proc = case.start(*LONG, "--checkpoint-every", "5", "--out", str(case.out))
    case.wait_steps(proc, 12)
    os.kill(case.pids(rank="1")[0], signal.SIGKILL)
    reached = case.steps_logged()
    code, err, seconds = finish(proc)
    rows = [case.row("SIGKILL rank 1 mid-run", 1, code, err, seconds, lost=case.lost_since_checkpoint(reached),
                     says="rank 1 (stage 1, replica 0) died: killed by signal SIGKILL")]
    code, err, seconds = case.run("--resume", str(case.out), "--steps", "20")
    rows.append(case.row("  then --resume (to step 20)", 0, code, err, seconds))
    return rows


def kill_during_checkpoint(case: Case, attempts: int = 5) -> list[Row]:
    """SIGKILL the launcher the moment a checkpoint directory exists without COMPLETE (writing in progress). The
    ranks die a moment after the launcher (the fork server first, then they), and a small checkpoint may complete
    in that moment: then the run is started afresh, up to `attempts` times, until the kill leaves one incomplete."""
    for attempt in range(attempts):
        case.out = case.dir / f"run-{attempt}"
        proc = case.start(*LONG, "--checkpoint-every", "1", "--out", str(case.out))
        case.wait_steps(proc, 3)
        caught = _kill_mid_checkpoint(proc, case.out / "checkpoints")
        reached = case.steps_logged()
        code, err, seconds = finish(proc)
        incomplete = [d for d in (case.out / "checkpoints").glob("step-*") if not (d / "COMPLETE").exists()]
        if incomplete or not caught:
            break
    rows = [case.row("SIGKILL launcher during a checkpoint write", -9, code, err, seconds,
                     killed_in=incomplete[0] if incomplete else None, lost=case.lost_since_checkpoint(reached),
                     verified=caught,
                     note=f"caught mid-write: {caught}; left incomplete: {', '.join(d.name for d in incomplete) or 'none'}"
                          f" (attempt {attempt + 1})")]
    code, err, seconds = case.run("--resume", str(case.out), "--steps", str(reached + 3))
    removed = bool(incomplete) and all(d.name in err for d in incomplete)
    rows.append(case.row("  then --resume", 0, code, err, seconds, verified=removed,
                         note=f"the incomplete checkpoint and its partial files removed: {removed}"))
    return rows


def _kill_mid_checkpoint(proc: subprocess.Popen, checkpoints: Path, timeout: float = 60) -> bool:
    """SIGKILL `proc` as soon as a checkpoint directory under `checkpoints` lacks COMPLETE; whether one did in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(not (d / "COMPLETE").exists() for d in checkpoints.glob("step-*")):
            proc.kill()
            return True
        time.sleep(0.001)
    return False


def kill_launcher(case: Case) -> list[Row]:
    """The launcher SIGKILLed: nothing can print, but no rank may outlive it."""
    proc = case.start(*LONG, "--out", str(case.out))
    case.wait_steps(proc, 3)
    proc.kill()
    code, err, seconds = finish(proc)
    return [case.row("SIGKILL the launcher", -9, code, err, seconds, note="its ranks die with it (parent watch)")]


def stall(case: Case) -> list[Row]:
    """A rank stopped (SIGSTOP): detected as a stall and everything torn down."""
    proc = case.start(*LONG, "--stall-timeout", "10", "--out", str(case.out))
    case.wait_steps(proc, 3)
    victims = case.pids(rank="2")
    os.kill(victims[0], signal.SIGSTOP)
    code, err, seconds = finish(proc)
    for pid in victims:  # never leave a stopped process behind, whatever happened
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    return [case.row("SIGSTOP rank 2, --stall-timeout 10", 1, code, err, seconds, says="rank 2 (stage 2, replica 0)")]


def disk_full(case: Case) -> list[Row]:
    """A disk too small for the second checkpoint, then more space and a resume."""
    with small_disk(case.dir / "disk", "24m") as disk:
        case.out = disk / "run"
        proc = case.start("--pp", "3", "--seq-len", "64", "--max-samples", "256", "--no-progress",
                          "--checkpoint-every", "2", "--steps", "8", "--out", str(case.out))
        code, err, seconds = finish(proc)
        rows = [case.row("disk full (24 MB tmpfs) at a checkpoint", 1, code, err, seconds,
                         lost=case.lost_since_checkpoint(case.steps_logged()), says="disk full writing")]
        subprocess.run(["mount", "-o", "remount,size=200m", str(disk)], check=True)
        code, err, seconds = case.run("--resume", str(case.out))
        rows.append(case.row("  then space freed, --resume", 0, code, err, seconds))
        return rows


def disk_filled_mid_run(case: Case) -> list[Row]:
    """Another process fills the disk while a --store lmdb run writes m(ξ) to it (LMDB must not fault with SIGBUS)."""
    with small_disk(case.dir / "disk", "96m") as disk:
        case.out = disk / "run"
        proc = case.start(*LONG, "--store", "lmdb", "--checkpoint-every", "4", "--out", str(case.out))
        case.wait_steps(proc, 5)
        try:  # leave about 100 KB (the run writes meanwhile, so this may fill the disk completely)
            with open(disk / "filler", "wb") as f:
                f.write(b"\0" * max(0, shutil.disk_usage(disk).free - 100_000))
        except OSError:
            pass
        code, err, seconds = finish(proc)
        rows = [case.row("disk filled by another process mid-run (--store lmdb)", 1, code, err, seconds,
                         lost=case.lost_since_checkpoint(case.steps_logged()), says="disk full writing")]
        (disk / "filler").unlink()
        code, err, seconds = case.run("--resume", str(case.out), "--steps", str(case.steps_logged() + 4))
        rows.append(case.row("  then space freed, --resume", 0, code, err, seconds))
        return rows


# -- interrupts ----------------------------------------------------------------------------------------------------
def _maps_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def interrupts(case: Case, bandwidth: bool) -> list[Row]:
    """SIGINT/SIGTERM at start-up, during namespace setup (with --bandwidth), mid-run and twice during cleanup."""
    extra = ["--bandwidth", "200mbit"] if bandwidth else []
    where = " under --bandwidth" if bandwidth else ""
    rows = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        out = case.dir / f"startup-{sig.name}"
        proc = case.start(*LONG, *extra, "--out", str(out))
        deadline = time.monotonic() + 60
        while not _maps_torch(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(sig)
        code, err, seconds = finish(proc)
        rows.append(case.row(f"{sig.name} at start-up{where}", 1, code, err, seconds))
    if bandwidth:
        for sig in (signal.SIGINT, signal.SIGTERM):
            state = Path(case.env["AQPIPE_NETNS_STATE"])
            proc = case.start(*LONG, *extra, "--pp", "4", "--out", str(case.dir / f"netns-{sig.name}"))
            deadline = time.monotonic() + 120
            while not (state.is_dir() and any(state.glob("*.json"))) and proc.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.005)
            proc.send_signal(sig)
            code, err, seconds = finish(proc)
            rows.append(case.row(f"{sig.name} during namespace setup", 1, code, err, seconds))
    for sig in (signal.SIGINT, signal.SIGTERM):
        out = case.dir / f"mid-{sig.name}"
        proc = case.start(*LONG, *extra, "--out", str(out))
        case.wait_steps(proc, 3, out)
        proc.send_signal(sig)
        code, err, seconds = finish(proc)
        rows.append(case.row(f"{sig.name} mid-run{where}", 1, code, err, seconds))
    out = case.dir / "cleanup"
    proc = case.start(*LONG, *extra, "--out", str(out))
    case.wait_steps(proc, 3, out)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    code, err, seconds = finish(proc)
    rows.append(case.row(f"SIGINT, then SIGINT+SIGTERM during cleanup{where}", 1, code, err, seconds))
    return rows


# -- stray connections ---------------------------------------------------------------------------------------------
def stray_connections(case: Case) -> list[Row]:
    """Garbage on every port the run listens on, mid-run; the losses must equal an undisturbed run's."""
    args = [*QUICK, "--steps", "40", "--seed", "3"]
    code, err, _ = case.run(*args, "--out", str(case.dir / "reference"))
    reference = [json.loads(x)["loss"] for x in (case.dir / "reference" / "metrics.jsonl").read_text().splitlines()]
    proc = case.start(*args, "--out", str(case.out))
    case.wait_steps(proc, 3)
    ports = listening_ports([proc.pid, *case.pids()])
    sent = 0
    for _ in range(5):
        for port in ports:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(os.urandom(4096) + struct.pack("<Q", 1 << 62))
                    sent += 1
            except OSError:
                pass
        time.sleep(0.2)
    code, err, seconds = finish(proc)
    losses = [json.loads(x)["loss"] for x in (case.out / "metrics.jsonl").read_text().splitlines()] \
        if (case.out / "metrics.jsonl").exists() else []
    return [case.row("stray connections with garbage, mid-run", 0, code, err, seconds,
                     verified=losses == reference and sent > 0,
                     note=f"{sent} connections to {len(ports)} ports; losses identical to an undisturbed run: "
                          f"{losses == reference}")]


# -- resume abuse --------------------------------------------------------------------------------------------------
def resume_abuse(case: Case) -> list[Row]:
    """Every way to resume what should not be resumed, and one extension that should work."""
    rows = []
    run = case.finished_run()
    pristine = case.dir / "pristine"
    shutil.copytree(run, pristine)

    def fresh() -> Path:
        shutil.rmtree(run)
        shutil.copytree(pristine, run)
        return run

    def attempt(name: str, expect: int, *args: str, **extra) -> None:
        code, err, seconds = case.run("--resume", str(run), *args)
        rows.append(case.row(name, expect, code, err, seconds, **extra))

    code, err, seconds = case.run("--resume", str(case.dir / "nowhere"))
    rows.append(case.row("--resume of a directory that does not exist", 2, code, err, seconds))
    empty = case.dir / "killed-early"
    proc = case.start(*LONG, "--checkpoint-every", "1000", "--out", str(empty))
    case.wait_steps(proc, 2, empty)
    proc.send_signal(signal.SIGINT)
    finish(proc)
    code, err, seconds = case.run("--resume", str(empty))
    rows.append(case.row("--resume of a run with no checkpoint yet", 2, code, err, seconds))
    for field_name, value in (("seq_len", 32), ("fw", "fp32")):
        config = json.loads((fresh() / "config.json").read_text())
        config[field_name] = value
        (run / "config.json").write_text(json.dumps(config))
        attempt(f"config.json edited: {field_name} -> {value}", 2)
    step = fresh() / "checkpoints" / "step-00000006"
    shutil.copy(step / "rank-0.pt", step / "rank-1.pt")
    shutil.copy(step / "rank-0.sha256", step / "rank-1.sha256")
    attempt("rank 0's checkpoint file (and checksum) copied over rank 1's", 2)
    step = fresh() / "checkpoints" / "step-00000006"
    os.truncate(step / "rank-2.pt", (step / "rank-2.pt").stat().st_size // 2)
    attempt("newest checkpoint truncated (an older one is sound)", 2)
    (fresh() / "checkpoints" / "step-00000006" / "rank-1.pt").unlink()
    attempt("newest checkpoint's rank file deleted", 2)
    fresh()
    attempt("--resume extending 6 -> 9 steps", 0, "--steps", "9")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows[-1].note = (f"lr at step 7: {records[6]['lr']:.2e} (must be > 0), weights move: "
                     f"{records[6]['loss'] != records[5]['loss']}")
    rows[-1].verified = records[6]["lr"] > 0 and records[6]["loss"] != records[5]["loss"]
    proc = case.start(*LONG, "--checkpoint-every", "2", "--out", str(case.dir / "running"))
    case.wait_steps(proc, 3, case.dir / "running")
    code, err, seconds = case.run("--resume", str(case.dir / "running"))
    proc.send_signal(signal.SIGINT)  # first, so that the running run's processes are not counted as orphans
    finish(proc)
    rows.append(case.row("--resume of a run that is still running", 2, code, err, seconds, says="in use by another",
                         killed_in=case.dir / "running"))  # its interrupted checkpoint is its own (swept on resume)
    return rows


# -- launches into the same directory ------------------------------------------------------------------------------
def same_directory(case: Case) -> list[Row]:
    """Launches that land on another run's directory, running or finished."""
    rows = []
    proc = case.start(*LONG, "--out", str(case.out))
    case.wait_steps(proc, 2)
    second = case.run(*QUICK, "--steps", "4", "--out", str(case.out))
    overwrite = case.run(*QUICK, "--steps", "4", "--overwrite", "--out", str(case.out))
    proc.send_signal(signal.SIGINT)  # first, so that the running run's processes are not counted as orphans
    finish(proc)
    rows.append(case.row("second launch into a running run's --out", 2, *second, says="in use by another",
                         killed_in=case.out))
    rows.append(case.row("  and with --overwrite", 2, *overwrite, says="in use by another", killed_in=case.out))
    before = sorted(p.name for p in case.out.iterdir())
    code, err, seconds = case.run(*QUICK, "--steps", "4", "--seed", "1", "--out", str(case.out))
    same = sorted(p.name for p in case.out.iterdir()) == before
    rows.append(case.row("launch of another run into a finished run", 2, code, err, seconds,
                         says="holds another run", lost="nothing" if same else "files changed", verified=same))
    code, err, seconds = case.run(*QUICK, "--steps", "4", "--seed", "1", "--overwrite", "--out", str(case.out))
    rows.append(case.row("  and with --overwrite", 0, code, err, seconds, lost="the old run (asked for)"))
    code, err, seconds = case.run(*QUICK, "--steps", "6", "--seed", "1", "--out", str(case.out))
    steps = [json.loads(line)["step"] for line in (case.out / "metrics.jsonl").read_text().splitlines()]
    rows.append(case.row("  then the same run's command again, --steps 6", 0, code, err, seconds,
                         verified=steps == [1, 2, 3, 4, 5, 6] and "continues after step 4" in err,
                         note="continues from its checkpoint"))
    return rows


# -- bad data ------------------------------------------------------------------------------------------------------
def bad_data(case: Case) -> list[Row]:
    """--data that is not usable text, and text that could stall data preparation (one unbroken line, no newline)."""
    rows = []
    files = {"an executable": Path(sys.executable).resolve(), "an empty file": case.dir / "empty.txt",
             "a file that does not exist": case.dir / "missing.txt", "too short for one sample": case.dir / "short.txt"}
    files["an empty file"].write_text("")
    files["too short for one sample"].write_text("a b c\n")
    says = {"an executable": "is not text", "an empty file": "is empty", "a file that does not exist": "does not exist",
            "too short for one sample": "too short"}
    for i, (what, path) in enumerate(files.items()):
        code, err, seconds = case.run(*QUICK, "--steps", "1", "--data", str(path), "--out", str(case.dir / f"x{i}"))
        rows.append(case.row(f"--data {what}", 2, code, err, seconds, says=says[what]))
    long_text = case.dir / "long.txt"
    long_text.write_text("a" * 2_000_000 + "\n")
    env_cache = case.env["AQPIPE_CACHE"]
    case.env["AQPIPE_CACHE"] = str(case.dir / "cache")  # nothing cached: the whole preparation is timed
    code, err, seconds = case.run(*QUICK, "--steps", "2", "--data", str(long_text), "--out", str(case.dir / "long"))
    case.env["AQPIPE_CACHE"] = env_cache
    rows.append(case.row("--data 2 MB of one character, no break", 0, code, err, seconds))
    return rows


# -- damaged LMDB stores -------------------------------------------------------------------------------------------
def damaged_stores(case: Case) -> list[Row]:
    """Each kind of LMDB damage on rank 1's store: the tools say so in one line, and a resume re-seeds."""
    rows = []
    run = case.finished_run(6, "--store", "lmdb", "--fw", "aqsgd:3", "--warmup-epochs", "1", "--max-samples", "32",
                            "--checkpoint-every", "6")
    pristine = case.dir / "pristine"
    shutil.copytree(run, pristine)
    for name, damage in DAMAGE.items():
        shutil.rmtree(run)
        shutil.copytree(pristine, run)
        damage(run / "store" / "rank-1.lmdb")
        for action in ("verify", "stats"):
            code, err, seconds = case.run(action, str(run), command="store")
            rows.append(case.row(f"store {action}: LMDB {name}", 1, code, err, seconds,
                                 says="rank 1's m(xi) store is damaged"))
        code, err, seconds = case.run("--resume", str(run), "--steps", "8")
        summary = json.loads((run / "summary.json").read_text()) if code == 0 else {}
        reseeded = summary.get("store", {}).get("reseeded")
        rows.append(case.row(f"--resume with an LMDB store {name}", 0, code, err, seconds,
                             lost="m(xi) of rank 1 (re-seeded)", verified=bool(reseeded),
                             note=f"store.reseeded = {summary.get('store', {}).get('reseeded')}"))
    return rows


CASES = {
    "kill rank": kill_rank_mid_run, "kill checkpoint": kill_during_checkpoint, "kill launcher": kill_launcher,
    "stall": stall, "disk": disk_full, "disk lmdb": disk_filled_mid_run, "interrupts": lambda c: interrupts(c, False),
    "interrupts bandwidth": lambda c: interrupts(c, True), "stray": stray_connections, "resume": resume_abuse,
    "same directory": same_directory, "bad data": bad_data, "lmdb": damaged_stores, "hosts": across_hosts,
}


def main() -> int:
    """Run the chosen cases, print a line per row, write the JSON and Markdown tables; exit 1 unless all clean."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/faults")
    parser.add_argument("--only", default="", help="comma-separated words; run the cases whose name holds one")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("the campaign needs root (a small tmpfs for the full disk, network namespaces)", file=sys.stderr)
        return 2
    words = [w for w in args.only.split(",") if w]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="aqpipe-faults-") as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        for name, case in CASES.items():
            if words and not any(w in name for w in words):
                continue
            start = time.monotonic()
            try:
                found = case(Case(work, cache, name))
            except Exception as e:  # noqa: BLE001 - a case that could not run is a row too
                found = [Row(name, 0, None, note=f"case failed to run: {type(e).__name__}: {str(e)[:300]}")]
            rows += found
            for r in found:
                print(f"{'ok ' if r.clean else 'BAD'} {r.case}: exit {r.code} ({r.expect}) in {r.seconds} s: {r.line[:100]}"
                      f"{' orphans: ' + ', '.join(r.orphans) if r.orphans else ''} {r.note}", flush=True)
            print(f"   ({name}: {time.monotonic() - start:.0f} s)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps([asdict(r) | {"clean": r.clean} for r in rows], indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    print(f"{sum(r.clean for r in rows)} of {len(rows)} rows clean; table: {out.with_suffix('.md')}")
    return 0 if all(r.clean for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
