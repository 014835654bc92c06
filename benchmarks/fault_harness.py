"""The fault campaign's harness (benchmarks/faults.py): a case's scratch directory, tagged launches and waits, and
the row one attempt makes — its exit code, its failure line, what it left behind — with the table of rows."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.processes import tagged_processes  # noqa: E402 - the repository's own test helpers

QUICK = ["--pp", "3", "--seq-len", "16", "--max-samples", "128", "--no-progress"]
LONG = [*QUICK, "--steps", "5000"]


@dataclass
class Row:
    """One attempt: what happened, and whether that is what a clean failure (or success) looks like."""

    case: str
    expect: int
    code: int | None = None
    seconds: float = 0.0
    line: str = ""
    after: int = 0  # stderr lines after the failure line
    traceback: bool = False
    orphans: list[str] = field(default_factory=list)
    lost: str = "nothing"
    note: str = ""
    says: str = ""  # the failure line must contain this
    verified: bool = True  # the case's own property (same losses, lr > 0, re-seeded, …) held

    @property
    def clean(self) -> bool:
        return (self.code == self.expect and not self.after and not self.traceback and not self.orphans
                and self.says in self.line and self.verified)


class Case:
    """One case's scratch directory, tag (every process it starts carries it) and launches."""

    def __init__(self, work: Path, cache: Path, name: str) -> None:
        self.dir = work / name.replace(" ", "-").replace("/", "-")
        self.dir.mkdir(parents=True)
        self.out = self.dir / "run"
        self.tag = uuid.uuid4().hex
        self.env = dict(os.environ, AQPIPE_TEST_TAG=self.tag, AQPIPE_CACHE=str(cache),
                        AQPIPE_NETNS_STATE=str(self.dir / "netns"))
        self.namespaces_before = namespaces()

    def start(self, *args: str, command: str = "launch") -> subprocess.Popen:
        """`aqpipe COMMAND ARGS` in the background, tagged."""
        return subprocess.Popen([sys.executable, "-m", "aqpipe", command, *args], cwd=ROOT, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, *args: str, command: str = "launch", timeout: float = 600) -> tuple[int, str, float]:
        """`aqpipe COMMAND ARGS` to its end: (exit code, stderr (and stdout of store tools), seconds)."""
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "aqpipe", command, *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stderr + proc.stdout * (command == "store"), time.monotonic() - start

    def steps_logged(self, out: Path | None = None) -> int:
        """Steps recorded in the run's metrics.jsonl so far."""
        metrics = (out or self.out) / "metrics.jsonl"
        return metrics.read_text().count("\n") if metrics.exists() else 0

    def wait_steps(self, proc: subprocess.Popen, n: int, out: Path | None = None, timeout: float = 180) -> None:
        """Return once the run has logged `n` steps."""
        deadline = time.monotonic() + timeout
        while self.steps_logged(out) < n:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run never reached step {n}: {proc.communicate()[1][-2000:]}")
            time.sleep(0.05)

    def pids(self, rank: str | None = None) -> list[int]:
        """Live processes of this case (of one rank when given)."""
        return tagged_processes(self.tag, rank)

    def lost_since_checkpoint(self, reached: int) -> str:
        """The steps a resume has to redo."""
        kept = last_checkpoint(self.out)
        return f"steps {kept or 0}+1..{reached} (resumable from {kept})" if kept else f"steps 1..{reached} (no checkpoint)"

    def finished_run(self, steps: int = 6, *extra: str) -> Path:
        """A short run with checkpoints, finished."""
        code, err, _ = self.run(*QUICK, "--steps", str(steps), "--checkpoint-every", "2", *extra, "--out", str(self.out))
        if code != 0:
            raise RuntimeError(err[-2000:])
        return self.out

    def row(self, case: str, expect: int, code: int | None, err: str, seconds: float, killed_in: Path | None = None,
            **extra) -> Row:
        """The row of one attempt; `killed_in`: a checkpoint a SIGKILL interrupted, whose partial files only the
        next launch can remove (the row after it checks that it did)."""
        line, after = failure_line(err)
        time.sleep(0.5)
        left = [f"pid {p}" for p in self.pids()]
        left += [f"netns {n}" for n in namespaces() if n not in self.namespaces_before]
        left += [str(p.relative_to(self.dir)) for p in self.dir.rglob("*.tmp")
                 if killed_in is None or killed_in not in p.parents]
        return Row(case, expect, code, round(seconds, 1), line[:400], after, "Traceback" in err, left, **extra)


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int | None, str, float]:
    """Wait for a background launch: (exit code or None if it hung, stderr, seconds waited)."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return None, err + f"\n(no exit within {timeout} s)", time.monotonic() - start
    return proc.returncode, err, time.monotonic() - start


def failure_line(err: str) -> tuple[str, int]:
    """The line that reports how the command ended, and how many stderr lines came after it."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith(("aqpipe: error", "aqpipe: run failed", "aqpipe: interrupted")):
            return line, len(lines) - 1 - i
    return (lines[-1] if lines else ""), 0


def namespaces() -> list[str]:
    """aqpipe's network namespaces on this machine."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("aqpipe-")]


def last_checkpoint(out: Path) -> int | None:
    """The newest complete checkpoint's step."""
    done = [int(d.name[5:]) for d in (out / "checkpoints").glob("step-*") if (d / "COMPLETE").is_file()]
    return max(done) if done else None


def listening_ports(pids: list[int]) -> list[int]:
    """TCP ports the processes listen on."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    ports = set()
    for line in out.splitlines():
        if any(f"pid={p}," in line for p in pids):
            ports.add(int(line.split()[3].rsplit(":", 1)[1]))
    return sorted(ports)


def markdown(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = ["| case | exit (expected) | s | failure line | orphans | lost | clean | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = (f" (+{r.after} lines after)" if r.after else "") + (" TRACEBACK" if r.traceback else "")
        line = r.line.replace("|", "\\|")
        lines.append(f"| {r.case} | {r.code} ({r.expect}) | {r.seconds} | `{line}`{extra} | "
                     f"{', '.join(r.orphans) or 0} | {r.lost} | {'yes' if r.clean else '**no**'} | {r.note} |")
    return "\n".join(lines) + "\n"
