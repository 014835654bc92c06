"""Real multi-host runs on simulated hosts (tests/hosts.py): each host its own network namespace behind a throttled
link and its own disk at the same path, one torchrun per host. Nothing may assume a shared filesystem."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from aqpipe.launch import netns
from tests import warm
from tests.hosts import simulated_hosts, verify_stores, wait_all

CANNOT = netns.can_throttle()
pytestmark = [pytest.mark.xdist_group("netns"),
              pytest.mark.skipif(CANNOT is not None, reason=f"cannot build namespaces here: {CANNOT}")]
ENV = {"OMP_NUM_THREADS": "1"}  # the same arithmetic as the one-machine run's ranks (one thread each)
SMALL = ("--model", "llama-tiny", "--seq-len", "32", "--max-samples", "64", "--micro-batch-size", "2",
         "--micro-batches", "3", "--eval-every", "0", "--no-progress", "--stall-timeout", "60")


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def host_log(hosts, host: int) -> str:
    return (hosts.disk(host) / "torchrun.log").read_text(errors="replace")[-3000:]


def test_two_hosts_with_private_disks_survive_a_dead_host_resume_each_from_its_own_disk_and_export(tmp_path):
    """2 hosts x 1 rank, the tied llama-tiny, AQ-SGD links, LMDB m(xi) stores: host 1 is SIGKILLed mid-run; both hosts
    --resume from their own disks and finish; host 0's export is the two hosts' final stages; the m(xi) copies across
    the link between the hosts agree (`aqpipe store verify` with host 1's digest file). (Where a host lost its part,
    the start is refused instead: tests/test_checkpoint_copies.py.)"""
    with simulated_hosts(tmp_path, 2, 1, 200_000_000) as hosts:
        run = hosts.mount / "run"
        args = ("launch", *SMALL, "--pp", "2", "--steps", "16", "--checkpoint-every", "4", "--warmup-epochs", "0",
                "--store", "lmdb", "--checkpoint-replicas", "0", "--out", str(run))  # (each part on its host alone)
        procs = [hosts.start(h, *args, env=ENV) for h in range(2)]
        metrics = hosts.on_disk(0, run / "metrics.jsonl")
        deadline = time.monotonic() + 120
        while len(records(metrics)) < 6 and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.2)
        assert len(records(metrics)) >= 6, host_log(hosts, 0)
        hosts.kill(procs[1])  # the machine dies: torchrun and its rank, at once
        codes = wait_all(procs[:1], 90)
        assert codes[0] != 0, host_log(hosts, 0)  # host 0 noticed and stopped
        for host in range(2):  # every host keeps its own complete checkpoint
            assert (hosts.on_disk(host, run / "checkpoints" / "step-00000004" / "COMPLETE")).is_file()
            assert (hosts.on_disk(host, run / "config.json")).is_file()
        assert not (hosts.on_disk(0, run / "checkpoints" / "step-00000004" / "rank-1.pt")).exists()  # not shared

        procs = [hosts.start(h, "launch", "--resume", str(run), "--no-progress", env=ENV) for h in range(2)]
        assert wait_all(procs, 180) == [0, 0], host_log(hosts, 0) + host_log(hosts, 1)
        done = records(metrics)
        assert [r["step"] for r in done] == list(range(1, 17))
        summary = json.loads(hosts.on_disk(0, run / "summary.json").read_text())
        assert summary["steps"] == 16 and summary["final_weights_bytes"] > 0
        assert not hosts.on_disk(1, run / "summary.json").exists()

        export = load_file(next(hosts.on_disk(0, run / "export").glob("*.safetensors")))
        stage0 = torch.load(hosts.on_disk(0, run / "checkpoints" / "final" / "stage-0.pt"), weights_only=True)
        stage1 = torch.load(hosts.on_disk(1, run / "checkpoints" / "final" / "stage-1.pt"), weights_only=True)
        assert not hosts.on_disk(0, run / "checkpoints" / "final" / "stage-1.pt").exists()
        assert torch.equal(export["model.embed_tokens.weight"], stage0["0.embed_tokens.weight"])
        assert torch.equal(export["model.norm.weight"], next(v for k, v in stage1.items() if k.split(".", 1)[1] == "norm.weight"))

        alone = subprocess.run(hosts.command(0, [sys.executable, "-m", "aqpipe", "store", "verify", str(run)]),
                               capture_output=True, text=True, timeout=120)
        assert alone.returncode == 2 and "aqpipe store digest" in alone.stderr, alone.stderr
        verified = verify_stores(hosts, run)  # (with host 1's digest file, copied to host 0 as a user would)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert verified.stdout.strip().startswith("0 mismatch(es) in") and " 0 m(xi)" not in verified.stdout


def test_two_hosts_of_two_ranks_train_the_one_machine_model(tmp_path):
    """--pp 4 over 2 hosts x 2 ranks (stages 0-1 on one, 2-3 on the other), fp32 links: the losses and the export
    equal a one-machine run's bit for bit; each host keeps its own stages' checkpoints; the links inside a host run
    at memory speed, the one between them at the throttled rate (summary.json). (Runs resumed across hosts after a
    host's death: the test above and tests/test_hosts_restarts.py.)"""
    rate = 20_000_000
    big = ("--model", "llama-tiny", "--seq-len", "64", "--max-samples", "64", "--micro-batch-size", "4",
           "--micro-batches", "2", "--eval-every", "0", "--no-progress", "--pp", "4", "--steps", "12",
           "--checkpoint-every", "4", "--fw", "fp32", "--bw", "fp32", "--stall-timeout", "60",
           "--checkpoint-replicas", "0")  # (no copies: each host holds its own ranks' parts alone)
    with simulated_hosts(tmp_path / "hosts", 2, 2, rate) as hosts:
        run = hosts.mount / "run"
        procs = [hosts.start(h, "launch", *big, "--out", str(run), env=ENV) for h in range(2)]
        metrics = hosts.on_disk(0, run / "metrics.jsonl")
        assert wait_all(procs, 240) == [0, 0], host_log(hosts, 0) + host_log(hosts, 1)
        for host, ranks in ((0, (0, 1)), (1, (2, 3))):  # each host's first rank marked it
            step = hosts.on_disk(host, run / "checkpoints" / "step-00000012")
            assert (step / "COMPLETE").is_file()
            assert {p.name.split(".")[0] for p in step.glob("rank-*")} == {f"rank-{r}" for r in ranks}
        summary = json.loads(hosts.on_disk(0, run / "summary.json").read_text())
        rates = [8 * r for r in summary["link_rate"]["fwd_bytes_per_second"]]
        assert rates[1] < 1.5 * rate, rates  # between the hosts: the shaped rate
        assert min(rates[0], rates[2]) > 5 * rate, rates  # inside a host: unshaped
        assert (hosts.on_disk(1, run / "checkpoints" / "final" / "stage-3.pt")).is_file()
        assert not (hosts.on_disk(0, run / "checkpoints" / "final" / "stage-3.pt")).exists()
        losses = [r["loss"] for r in records(metrics)]
        exported = load_file(next(hosts.on_disk(0, run / "export").glob("*.safetensors")))
    local = tmp_path / "one-machine"
    proc = warm.run("launch", *big, "--out", str(local), env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(losses) == 12 and [r["loss"] for r in records(local / "metrics.jsonl")] == losses
    reference = load_file(next((local / "export").glob("*.safetensors")))
    assert reference.keys() == exported.keys()
    assert all(torch.equal(reference[k], exported[k]) for k in reference)


FRAME_HEADERS = 14 + 20 + 32  # Ethernet, IPv4 and TCP (with timestamps) headers of each packet


def interface_bytes(hosts, host: int) -> int:
    """What host `host`'s network interface has transmitted, its packets' Ethernet/IP/TCP headers aside."""
    def read(counter: str) -> int:
        path = f"/sys/class/net/{netns.INTERFACE}/statistics/{counter}"
        return int(subprocess.run([*hosts.topology.exec_prefix(host), "cat", path], capture_output=True, text=True,
                                  check=True).stdout)

    return read("tx_bytes") - FRAME_HEADERS * read("tx_packets")


def test_every_byte_on_the_wire_is_in_the_metrics(tmp_path):
    """A throttled tied llama-tiny run over 2 hosts, 3 epochs: what the hosts' interfaces transmitted (TCP/IP headers
    aside) is at least what metrics.jsonl and summary.json claim, and within 1.3x of it (everything is in the claim:
    link payload and framing, tied rows, control, the final weights, the checkpoints' copies on the other host;
    outside it only the start-up rendezvous and connections)."""
    with simulated_hosts(tmp_path, 2, 1, 100_000_000) as hosts:
        run = hosts.mount / "run"
        before = [interface_bytes(hosts, h) for h in range(2)]
        procs = [hosts.start(h, "launch", *SMALL, "--pp", "2", "--epochs", "3", "--seq-len", "64", "--out", str(run),
                             env=ENV) for h in range(2)]
        assert wait_all(procs, 240) == [0, 0], host_log(hosts, 0) + host_log(hosts, 1)
        per_host = [interface_bytes(hosts, h) - before[h] for h in range(2)]
        wire = sum(per_host)
        summary = json.loads(hosts.on_disk(0, run / "summary.json").read_text())
    traffic = summary["traffic"]
    steps = records(hosts.on_disk(0, run / "metrics.jsonl"))
    assert summary["epochs"] == 3 and traffic["tied"] > 0 and traffic["control"] > 0 and traffic["link_framing"] > 0
    assert traffic["link_payload"] == sum(r["fwd_bytes"] + r["bwd_bytes"] for r in steps)
    assert traffic["total"] == sum(v for k, v in traffic.items() if k != "total")
    assert traffic["total"] <= wire <= 1.3 * traffic["total"], (wire, traffic)
    # each host's own: stage 0 sends the activations and its tied gradient rows, stage 1 the gradients, the tied
    # rows and the final weights; control, setup, evaluation and the checkpoints' copies (each host sends its own
    # part to the other) are claimed for the run, not per rank
    assert traffic["checkpoint"] > 0
    shared = traffic["control"] + traffic["setup"] + traffic["evaluation"] + traffic["checkpoint"]
    claims = [sum(r["fwd_bytes"] + r["fwd_framing_bytes"] + r["stage_tied_bytes"][0] for r in steps),
              sum(r["bwd_bytes"] + r["bwd_framing_bytes"] + r["stage_tied_bytes"][1] for r in steps)
              + traffic["final_weights"]]
    for host, (claim, sent) in enumerate(zip(claims, per_host)):
        assert claim <= sent <= 1.3 * (claim + shared), (host, sent, claim, shared)
