"""Runs that outlive a failed rank or a lost host across hosts (tests/hosts.py): torchrun's elastic agent restarts
every rank and the run continues from its newest checkpoint complete everywhere, with nothing trained twice past it
and the same result as a run that never failed."""

import json
import os
import re
import time
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

from aqpipe.launch import netns
from tests import warm
from tests.hosts import copies_processes, simulated_hosts, verify_stores, wait_all, wipe

CANNOT = netns.can_throttle()
pytestmark = [pytest.mark.xdist_group("netns"),
              pytest.mark.skipif(CANNOT is not None, reason=f"cannot build namespaces here: {CANNOT}")]
ENV = {"OMP_NUM_THREADS": "1"}  # the same arithmetic as the one-machine run's ranks (one thread each)
RUN = ("--model", "llama-tiny", "--seq-len", "32", "--max-samples", "64", "--micro-batch-size", "2",
       "--micro-batches", "3", "--eval-every", "0", "--no-progress", "--stall-timeout", "60", "--pp", "3",
       "--steps", "16", "--checkpoint-every", "4")


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def logs(hosts) -> str:
    return "\n".join(f"--- host {h}\n" + (hosts.disk(h) / "torchrun.log").read_text(errors="replace")[-2500:]
                     for h in range(hosts.count))


def start_job(hosts, args: tuple[str, ...]):
    """`aqpipe launch ARGS --out <run>` on every host under torchrun --max-restarts 3: the run directory, the
    command, each host's torchrun and host 0's metrics.jsonl."""
    run = hosts.mount / "run"
    command = ("launch", *args, "--out", str(run))
    procs = [hosts.start(h, *command, env=ENV, max_restarts=3) for h in range(hosts.count)]
    return run, command, procs, hosts.on_disk(0, run / "metrics.jsonl")


def wait_for_steps(hosts, procs, metrics, steps: int) -> None:
    """Until host 0 has recorded `steps` steps (and fewer than the run's 16)."""
    deadline = time.monotonic() + 180
    while len(records(metrics)) < steps and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.1)
    assert steps <= len(records(metrics)) < 16, logs(hosts)


def until(condition, hosts, procs, seconds: float = 180, meanwhile=lambda: None) -> bool:
    """Until `condition()` holds (while host 0 runs, calling `meanwhile()` before each look); whether it did within
    `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        meanwhile()
        if condition():
            return True
        assert procs[0].poll() is None, logs(hosts)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def copies_arriving(hosts, run) -> bool:
    """Whether a host holds another rank's part, arriving or kept: the copies of that checkpoint are under way on
    every host (they start together, once each host's copies' process has been asked)."""
    return any(path.name.endswith(".copy.tmp") or re.fullmatch(rf"rank-(?!{h}\.)\d+\.pt", path.name)
               for h in range(hosts.count) for path in hosts.on_disk(h, run / "checkpoints").glob("step-*/*"))


@contextmanager
def paused_with_copies_under_way(hosts, procs, run):
    """Hosts 1 and 2's ranks paused (`Hosts.paused`) once a checkpoint is complete on every host and its copies are
    under way, which go on at the ranks' priority (`Hosts.hurry_copies`; one still starting lowers itself once
    ready, so again at each look). Host 0's rank runs on, waiting for host 1's: its process serves the job's store,
    where the copies' processes meet. (A rank asks for its copies right after marking the checkpoint complete: one
    paused in between is let go on a moment.)"""
    assert until(lambda: all(list(hosts.on_disk(h, run / "checkpoints").glob("step-*/COMPLETE"))
                             for h in range(hosts.count)), hosts, procs), logs(hosts)
    for _ in range(10):
        with hosts.paused(procs[1:]):
            if until(lambda: copies_arriving(hosts, run), hosts, procs, 20, lambda: hosts.hurry_copies(procs)):
                yield
                return
        time.sleep(0.2)
    raise AssertionError(f"no copies under way\n{logs(hosts)}")


def one_machine_run(local, args: tuple[str, ...]) -> tuple[list[dict], dict]:
    """An uninterrupted run of `args` on one machine: its step records and its export."""
    proc = warm.run("launch", *args, "--out", str(local), env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records(local / "metrics.jsonl"), load_file(next((local / "export").glob("*.safetensors")))


def assert_as_on_one_machine(local, args: tuple[str, ...], done: list[dict], exported: dict) -> None:
    """An uninterrupted run of `args` on one machine records the losses `done` holds and exports `exported`, bit for
    bit."""
    want, reference = one_machine_run(local, args)
    assert [r["loss"] for r in want] == [r["loss"] for r in done]
    assert reference.keys() == exported.keys()
    assert all(torch.equal(reference[k], exported[k]) for k in reference)


# With m(ξ) in memory the restarted ranks load it from their checkpoint parts, as after a local launch's restart
# (tests/test_launch.py) and a resume (tests/test_finetune.py) do: across hosts, that variant runs with -m slow.
@pytest.mark.parametrize("store", [pytest.param("memory", marks=pytest.mark.slow), "lmdb"])
def test_a_rank_killed_under_torchruns_restarts_continues_the_run_as_if_nothing_failed(tmp_path, store):
    """3 hosts x 1 rank, AQ-SGD links, private disks, torchrun --max-restarts 3 (c10d): host 1's rank is SIGKILLed
    after the first checkpoint and its torchrun lives on. The restarted ranks continue the run (neither training
    from step 1 over its own checkpoints nor dialling the dead ranks' addresses): it finishes with no further command,
    every step recorded once, and its losses and export equal those of one machine's uninterrupted run bit for bit: a
    resume is exact, m(ξ), the optimizer and the RNG come back as they were. With m(ξ) in memory it is saved with each
    checkpoint; on disk (LMDB) it outlives the crash holding values written after the checkpoint, and each host's
    store is rewound to it (`aqpipe store verify` across the hosts then finds the two copies of every link equal)."""
    args = (*RUN, "--store", store, "--max-samples", "24")  # (4 steps an epoch: the kill comes in the second)
    with simulated_hosts(tmp_path / "hosts", 3, 1, 200_000_000) as hosts:
        run, _, procs, metrics = start_job(hosts, args)
        wait_for_steps(hosts, procs, metrics, 6)
        assert hosts.kill_ranks(procs[1]), logs(hosts)
        assert wait_all(procs, 240) == [0, 0, 0], logs(hosts)
        said = (hosts.disk(0) / "torchrun.log").read_text(errors="replace")
        resumed = [int(step) for step in re.findall(r"holds this run: it continues after step (\d+)", said)]
        assert len(resumed) == 1 and resumed[0] >= 4, logs(hosts)
        trained = [int(step) for step in re.findall(r"^step (\d+)/16 ", said, flags=re.M)]  # (host 0's progress)
        assert sorted(set(trained)) == list(range(1, 17))
        assert all(trained.count(step) == 1 for step in range(1, resumed[0] + 1)), trained
        assert all(trained.count(step) <= 2 for step in range(1, 17)), trained  # only those after it, again
        done = records(metrics)
        assert [r["step"] for r in done] == list(range(1, 17))
        summary = json.loads(hosts.on_disk(0, run / "summary.json").read_text())
        assert summary["steps"] == 16 and summary["restarts"] == 1
        exported = load_file(next(hosts.on_disk(0, run / "export").glob("*.safetensors")))
        if store == "lmdb":
            verified = verify_stores(hosts, run)
            assert verified.returncode == 0 and verified.stdout.startswith("0 mismatch(es) in"), verified.stdout
            assert " 0 m(xi)" not in verified.stdout, verified.stdout
    assert_as_on_one_machine(tmp_path / "one-machine", args, done, exported)


def test_a_fresh_host_in_place_of_one_that_lost_its_disk_fetches_its_part_and_the_run_continues(tmp_path):
    """Host 1 dies whole (its torchrun and its rank) and a host with an empty disk starts in its place with the same
    command, joining the job through torchrun's c10d rendezvous (a host that reboots with its disk joins the same way
    and resumes from its own part, as the restarted ranks above do from theirs): its rank fetches its
    checkpoint part from the copy host 2 keeps (--checkpoint-replicas 1 by default across hosts, sent in the
    background after each checkpoint), and the run finishes with the same losses and export as an uninterrupted run
    on one machine, bit for bit (fp32 links), no step trained twice past the checkpoint it continued from."""
    fp32 = (*RUN, "--fw", "fp32", "--bw", "fp32", "--stall-timeout", "120")  # (host 0's rank waits out the pause)
    with simulated_hosts(tmp_path / "hosts", 3, 1, 200_000_000) as hosts:
        run, command, procs, metrics = start_job(hosts, fp32)
        with paused_with_copies_under_way(hosts, procs, run):  # (a run this short might end before they arrive)
            kept = until(lambda: all(list(hosts.on_disk(h, run / "checkpoints").glob("step-*/REPLICATED"))
                                     for h in range(3)), hosts, procs, 180, lambda: hosts.hurry_copies(procs))
            assert kept, logs(hosts)
            # (each rank's copies' process forked from it, named for its work: no second import of torch per rank)
            assert [forked for proc in procs for _, forked in copies_processes(proc)] == [True] * 3
            assert len(records(metrics)) < 16, logs(hosts)
            copied = hosts.on_disk(2, run / "checkpoints")
            assert [p.name for p in copied.glob("step-*/rank-1.pt")], "host 2 keeps a copy of rank 1's part"
            replicated = max(int(p.parent.name[len("step-"):]) for p in copied.glob("step-*/REPLICATED"))
            hosts.kill(procs[1])
            wipe(hosts.disk(1))
        procs[1] = hosts.start(1, *command, env=ENV, max_restarts=3)
        assert wait_all(procs, 240) == [0, 0, 0], logs(hosts)
        said = (hosts.disk(1) / "torchrun.log").read_text(errors="replace")
        assert re.search(r"rank 1 on host1: fetched its part of the checkpoint of step \d+ from rank 2's host", said)
        said = (hosts.disk(0) / "torchrun.log").read_text(errors="replace")
        resumed = [int(step) for step in re.findall(r"holds this run: it continues after step (\d+)", said)]
        assert len(resumed) == 1 and resumed[0] >= replicated, (resumed, replicated, logs(hosts))
        trained = [int(step) for step in re.findall(r"^step (\d+)/16 ", said, flags=re.M)]  # (host 0's progress)
        assert sorted(set(trained)) == list(range(1, 17))
        assert all(trained.count(step) == 1 for step in range(1, resumed[0] + 1)), trained
        assert all(trained.count(step) <= 2 for step in range(1, 17)), trained  # only those after it, again
        done = records(metrics)
        assert [r["step"] for r in done] == list(range(1, 17))
        summary = json.loads(hosts.on_disk(0, run / "summary.json").read_text())
        # the copies' bytes, a traffic class of their own (in the step records as they travel, the rest after them)
        assert summary["traffic"]["checkpoint"] >= max(1, sum(r["checkpoint_bytes"] for r in done))
        assert summary["steps"] == 16 and summary["restarts"] == 1  # (one restart: the new host joined the job)
        exported = load_file(next(hosts.on_disk(0, run / "export").glob("*.safetensors")))
    assert_as_on_one_machine(tmp_path / "one-machine", fp32, done, exported)
