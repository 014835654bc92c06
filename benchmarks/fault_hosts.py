"""The fault campaign's cases across hosts (benchmarks/faults.py --only hosts): three simulated hosts (tests/hosts.py),
one rank each, run by torchrun's elastic agent (c10d rendezvous, --max-restarts 3) as the README's "Restarts across
hosts" says, each rank's checkpoint part copied to the next host; one fault each, mid-run: once a checkpoint is
complete on every host, or, where the fault takes a disk, once its copies are kept (or while they travel). A row is
clean when every host's torchrun ends as expected, every step is recorded once in host 0's metrics.jsonl (or, for a
fault nothing can survive, the run stopped before training over what was lost, saying what to do), and no process or
namespace is left."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from fault_harness import Case, Row, namespaces

from aqpipe.launch import netns
from tests.hosts import descendants, simulated_hosts, wait_all, wipe

STEPS = 160  # (a first checkpoint's copies wait up to 5 s for an idle core before they run at their rank's priority: 50–60
# of these ~0.1 s steps on busy cores; every fault lands mid-run)
RUN = ("--model", "llama-tiny", "--seq-len", "32", "--max-samples", "64", "--micro-batch-size", "2",
       "--micro-batches", "3", "--eval-every", "0", "--no-progress", "--stall-timeout", "30", "--pp", "3",
       "--steps", str(STEPS), "--checkpoint-every", "4")
ENV = {"OMP_NUM_THREADS": "1"}


def _steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def _one(case: Case, name: str, fault, expect: int = 0, says: str = "", args: tuple[str, ...] = (),
         when: str = "REPLICATED") -> Row:
    """Start the job on three hosts, do `fault(hosts, procs, run)` once 6 steps are recorded and some checkpoint
    directory on every host holds the marker `when` (it may replace procs' entries), wait for every host, and
    judge."""
    namespaces_before = namespaces()
    with simulated_hosts(case.dir / name.replace(" ", "-"), 3, 1, 200_000_000, port=29611) as hosts:
        run = hosts.mount / "run"
        command = ("launch", *RUN, *args, "--out", str(run))
        procs = [hosts.start(h, *command, env=ENV, max_restarts=3) for h in range(3)]
        metrics = hosts.on_disk(0, run / "metrics.jsonl")
        deadline = time.monotonic() + 180

        def ready() -> bool:
            marked = [list(hosts.on_disk(h, run / "checkpoints").glob(f"step-*/{when}")) for h in range(3)]
            if when == "COPYING":  # (a checkpoint whose copies are on their way)
                marked = [[p for p in found if not (p.parent / "REPLICATED").exists()] for found in marked]
            return len(_steps(metrics)) >= 6 and all(marked)

        while not ready() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.02)
        reached, caught = len(_steps(metrics)), ready()
        start = time.monotonic()
        fault(hosts, procs, command)
        codes = wait_all(procs, 300)
        seconds = time.monotonic() - start
        logs = [(hosts.disk(h) / name).read_text(errors="replace") for h in range(3)
                for name in ("torchrun.log", "again.log") if (hosts.disk(h) / name).is_file()]
        left = [f"pid {p}" for proc in procs for p in descendants(proc.pid)]
        done = _steps(metrics)
        resumed = re.findall(r"it continues after step (\d+)", logs[0])
        errors = [line for log in logs for line in log.splitlines() if line.startswith("aqpipe: error:")]
    settled = time.monotonic() + 10  # (the kernel may take a moment to let a namespace go)
    while any(n not in namespaces_before for n in namespaces()) and time.monotonic() < settled:
        time.sleep(0.5)
    left += [f"netns {n}" for n in namespaces() if n not in namespaces_before]
    caught = caught and reached < STEPS  # (a fault after the last step tests nothing)
    if expect == 0:
        verified = caught and codes == [0, 0, 0] and done == list(range(1, STEPS + 1))
        line = f"finished: {len(done)} steps, each once; continued after step {', '.join(resumed) or '-'}"
        lost = f"steps {resumed[-1]}+1..{reached}+ trained again" if resumed else "nothing"
    else:
        verified = caught and codes == [expect] * 3 and len(done) < STEPS and any(says in e for e in errors)
        line = next((e for e in errors if says in e), errors[-1] if errors else "")
        lost = "the run stops: nothing trained over the lost part"
    return Row(f"3 hosts: {name}", expect, 0 if verified and expect == 0 else max(codes), round(seconds, 1),
               line[:400], 0, False, left, lost, note=f"torchrun exits {codes}; fault at step {reached}"
               + ("" if caught else f" (not mid-run: no checkpoint directory held {when} everywhere before step "
                                     f"{STEPS})"), says=says,
               verified=verified)


def _kill_rank(hosts, procs, command) -> None:
    hosts.kill_ranks(procs[1])


def _host_dies_and_returns(hosts, procs, command) -> None:
    hosts.kill(procs[1])
    time.sleep(3)
    procs[1] = hosts.start(1, *command, env=ENV, max_restarts=3, log=hosts.disk(1) / "again.log")


def _host_dies_with_its_disk(hosts, procs, command) -> None:
    """Host 1 dies; a host with an empty disk starts in its place, with the same command."""
    hosts.kill(procs[1])
    wipe(hosts.disk(1))
    procs[1] = hosts.start(1, *command, env=ENV, max_restarts=3, log=hosts.disk(1) / "again.log")


def _link_cut(hosts, procs, command) -> None:
    """Host 1's link down for 30 s (every packet to and from it lost), then up again."""
    subprocess.run([*hosts.topology.exec_prefix(1), "ip", "link", "set", netns.INTERFACE, "down"], check=True)
    time.sleep(30)
    subprocess.run([*hosts.topology.exec_prefix(1), "ip", "link", "set", netns.INTERFACE, "up"], check=True)


def _frozen(hosts, procs, command) -> None:
    """Host 1's torchrun and rank stopped for 45 s (past the 30 s stall time-out), then continued."""
    frozen = [procs[1].pid, *descendants(procs[1].pid)]
    for pid in frozen:
        _signal(pid, signal.SIGSTOP)
    time.sleep(45)
    for pid in frozen:
        _signal(pid, signal.SIGCONT)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def across_hosts(case: Case) -> list[Row]:
    """Each cross-host fault on its own job."""
    return [
        _one(case, "a rank SIGKILLed (torchrun restarts it)", _kill_rank, when="COMPLETE"),
        _one(case, "a host dies whole and starts again", _host_dies_and_returns, when="COMPLETE"),
        _one(case, "a host dies, a fresh host (empty disk) in its place", _host_dies_with_its_disk),
        _one(case, "the same without copies (--checkpoint-replicas 0)", _host_dies_with_its_disk, expect=1,
             says="no longer holds its part", args=("--checkpoint-replicas", "0"), when="COMPLETE"),
        _one(case, "a rank SIGKILLed while a checkpoint's copies travel", _kill_rank, when="COPYING"),
        _one(case, "the link to a host cut for 30 s", _link_cut, when="COMPLETE"),
        _one(case, "a host frozen (SIGSTOP) 45 s, past the stall time-out", _frozen, when="COMPLETE"),
    ]
