"""Helpers for tests that start `aqpipe launch` and look for the processes it left (also used by
the fault campaign, benchmarks/faults.py and fault_harness.py)."""

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

LONG_RUN = ["--steps", "5000", "--seq-len", "16", "--max-samples", "128", "--pp", "3", "--no-progress"]


def tagged_processes(tag: str, rank: str | None = None) -> list[int]:
    """PIDs of live processes whose environment carries AQPIPE_TEST_TAG=tag (and that are rank `rank` if given: a
    forked rank is named aqpipe-rank-K, since /proc shows the environment a process was exec'd with, its fork
    server's; a rank started as a fresh process has RANK=K in it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if state == "Z" or f"AQPIPE_TEST_TAG={tag}".encode() not in env:
            continue
        if rank is None or f"RANK={rank}".encode() in env or name == f"aqpipe-rank-{rank}":
            pids.append(int(entry.name))
    return pids


def rank_under(launcher: int, rank: int) -> list[int]:
    """PIDs of live ranks `rank` that descend from process `launcher` (a launch started without an environment tag
    to find it by): named aqpipe-rank-K when forked, RANK=K in their environment when started as fresh processes."""
    parents, names = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                names[int(entry.name)] = (entry / "comm").read_text().strip()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == launcher:
                return True
        return False

    def is_rank(pid: int) -> bool:
        if names.get(pid) == f"aqpipe-rank-{rank}":
            return True
        try:
            return f"RANK={rank}".encode() in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            return False

    return [pid for pid in parents if descends(pid) and is_rank(pid)]


def none_left(tag: str, within: float = 15.0) -> bool:
    """Whether every process tagged `tag` is gone, waiting up to `within` seconds: a process killed a moment ago
    is still in /proc until the kernel has finished it, and a fixed pause would race with that on a loaded machine."""
    deadline = time.monotonic() + within
    while tagged_processes(tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def start_run(tmp_path, *extra, **popen) -> tuple[subprocess.Popen, str]:
    """Start a long `aqpipe launch` tagged with a fresh AQPIPE_TEST_TAG; return once it has logged 3 steps."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, AQPIPE_TEST_TAG=tag)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "aqpipe", "launch", *LONG_RUN, *extra, "--out", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    deadline = time.monotonic() + 120
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never started training"
        time.sleep(0.2)
    return proc, tag


def finish(proc, timeout) -> tuple[int, str, float]:
    """Wait for a launcher to end: (exit code, stderr, seconds waited). If it does not end in time, fail with what
    it was doing: its threads' Python stacks (SIGUSR1 makes aqpipe print them), its kernel wait channel, its
    children and the namespaces left, and everything it wrote to stderr."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        def read(path: str) -> str:
            try:
                return Path(path).read_text().strip()
            except OSError as e:
                return f"({e.strerror})"

        state = {"wchan": read(f"/proc/{proc.pid}/wchan"), "kernel stack": read(f"/proc/{proc.pid}/stack"),
                 "children": subprocess.run(["ps", "-o", "pid,stat,wchan:30,etime,args", "--ppid", str(proc.pid)],
                                            capture_output=True, text=True).stdout,
                 "namespaces": subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout}
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2.0)
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the launcher did not end within {timeout} s; {state}\nstderr:\n{err[-6000:]}") from None
    return proc.returncode, err, time.monotonic() - start


@contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` (e.g. "24m") mounted at `path` for the block (needs root); `path` is created if absent."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
