"""Ranks on different hosts agree, before any collective, on what they must share; gloo listens where the other
hosts can reach it; a local launch's rendezvous stays on loopback."""

import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from aqpipe.launch.local import reserved_port
from aqpipe.pipeline.links.rendezvous import HostDisagreement, agree, interface_of, pin_socket_interface
from tests.distributed import run_forked

FACTS = {"device": "cuda", "backend": "nccl", "world": [2, 1, 2], "config": {"lr": 0.001, "pp": 2}}


def on_threads(world: int, call) -> list:
    """`call(store, rank)` for every rank of one store, each on a thread: what each returned."""
    store = dist.HashStore()
    results: list = [None] * world

    def one(rank: int) -> None:
        results[rank] = call(store, rank)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def agree_all(facts_by_rank: list[dict]) -> list[str | None]:
    """Every rank of one store agreeing on its facts, each on a thread: the error text each got (None: agreed)."""
    def one(store, rank: int) -> str | None:
        try:
            agree(store, rank, len(facts_by_rank), facts_by_rank[rank])
        except HostDisagreement as e:
            return str(e)
        return None

    return on_threads(len(facts_by_rank), one)


def test_ranks_that_resolved_the_same_agree():
    assert agree_all([FACTS, FACTS, FACTS]) == [None, None, None]


def test_a_host_without_a_gpu_is_named_on_every_rank():
    cpu = {**FACTS, "device": "cpu", "backend": "gloo"}
    results = agree_all([FACTS, FACTS, cpu])
    host = socket.gethostname()
    for text in results:
        assert text is not None and text.startswith("the ranks disagree on backend (rank 0 on ")
        assert f"rank 0 on {host}: \"nccl\"; rank 2 on {host}: \"gloo\"" in text
        assert "give --device explicitly" in text and "rank 1" not in text


def test_powersgd_replicas_on_different_gpu_models_are_refused_before_they_diverge(monkeypatch):
    """PowerSGD's QR and P·Qᵀ agree bit for bit only on one GPU model; replicas on an H100 and an A100 would fail
    the replica digest at the first checkpoint. The hosts say so before any collective."""
    import torch

    from aqpipe.pipeline.links.rendezvous import replica_gpu_facts

    cuda = torch.device("cuda", 0)
    GPU_MODEL = "GPU model (--grad-sync powersgd computes on every replica)"
    assert replica_gpu_facts("powersgd:4", 1, cuda) == {} and replica_gpu_facts("signsgd", 2, cuda) == {}
    assert replica_gpu_facts("powersgd:4", 2, torch.device("cpu")) == {}
    models = iter(["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: next(models))
    facts = [{**FACTS, **replica_gpu_facts("powersgd:4", 2, cuda)} for _ in range(2)]
    assert facts[0][GPU_MODEL].startswith("NVIDIA H100 80GB HBM3, CUDA ")
    text = agree_all(facts)[1]
    assert text is not None and text.startswith(f"the ranks disagree on {GPU_MODEL}")
    assert "A100" in text and "use one GPU model for every replica, or another --grad-sync" in text


def test_fft_replicas_on_different_gpu_models_are_refused_too(monkeypatch):
    """`fft` sends each replica's sparse spectrum and every replica inverts the mean with its own cuFFT, whose
    algorithms differ between GPU models: the replicas' weights would drift apart bit by bit."""
    import torch

    from aqpipe.pipeline.links.rendezvous import replica_gpu_facts

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA L4")
    facts = replica_gpu_facts("fft:0.1:10", 2, cuda)
    assert facts["GPU model (--grad-sync fft computes on every replica)"].startswith("NVIDIA L4, CUDA ")
    assert replica_gpu_facts("fft:0.1:10", 1, cuda) == {}


def test_hosts_given_two_methods_are_told_the_flag_not_the_gpu_fact_it_names(monkeypatch):
    """Two hosts given different --grad-sync methods whose replicas compute the result publish GPU facts of two names;
    the refusal names the flag that differs, not a GPU fact one of them lacks."""
    import torch

    from aqpipe.pipeline.links.rendezvous import replica_gpu_facts

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA L4")
    cuda = torch.device("cuda", 0)
    facts = [{**FACTS, "config": {**FACTS["config"], "grad_sync": method}, **replica_gpu_facts(method, 2, cuda)}
             for method in ("powersgd:4", "fft:0.1:10")]
    text = agree_all(facts)[0]
    assert text is not None and text.startswith("the ranks disagree on config grad_sync ("), text


def test_a_method_whose_replicas_compute_named_in_the_gpu_fact_from_its_row_alone(monkeypatch):
    """A grad-sync method added as one row of the table (here after the package was imported) whose every replica
    computes the result is named in the GPU fact the hosts compare, as the built-in ones are."""
    import dataclasses

    import torch

    from aqpipe.compress.grad import methods
    from aqpipe.pipeline.links.rendezvous import replica_gpu_facts

    monkeypatch.setitem(methods.METHODS, "widget", dataclasses.replace(methods.METHODS["fft"], params=()))
    models = iter(["NVIDIA H100 80GB HBM3", "NVIDIA L4"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: next(models))
    facts = [{**FACTS, **replica_gpu_facts("widget", 2, torch.device("cuda", 0))} for _ in range(2)]
    assert list(facts[0])[-1] == "GPU model (--grad-sync widget computes on every replica)"
    text = agree_all(facts)[1]
    assert text is not None and "use one GPU model for every replica, or another --grad-sync" in text


def test_a_flag_given_differently_is_named():
    other = {**FACTS, "config": {"lr": 0.002, "pp": 2}}
    text = agree_all([FACTS, other])[0]
    assert text is not None and text.startswith("the ranks disagree on config lr (rank 0 on ") and ": 0.002)" in text


@pytest.mark.parametrize("backend, variable, value", [("gloo", "GLOO_SOCKET_IFNAME", "eth7"),
                                                      ("nccl", "NCCL_SOCKET_IFNAME", "=eth7")])
def test_the_backend_is_pinned_to_the_interface_that_reaches_the_master(monkeypatch, backend, variable, value):
    """Across hosts gloo would advertise the address the host's name resolves to (often 127.0.0.1), and NCCL picks
    its first interface that is neither loopback nor docker's — a bridge such as virbr0 or cni0, which the other
    hosts cannot reach, hangs its first collective. Both take the interface that reaches MASTER_ADDR (NCCL: that
    name exactly, not every interface it begins), unless the user chose one."""
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "AQPIPE_LOOPBACK", "AQPIPE_LINK_ADDR"):
        # (set first, so that monkeypatch restores the variable even where it was unset: pin_socket_interface below
        # sets the backend's variable itself, and a leftover eth7 broke every later gloo group in the worker process)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert pin_socket_interface(backend) is None  # loopback: nothing to choose
    assert interface_of("127.0.0.1") == "lo" and interface_of("203.0.113.250") is None
    monkeypatch.setattr("aqpipe.pipeline.links.streams.local_address", lambda: "10.9.9.9")
    monkeypatch.setattr("aqpipe.pipeline.links.rendezvous.interface_of", lambda address: "eth7")
    assert pin_socket_interface(backend) == value and os.environ[variable] == value
    assert [v for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if v in os.environ] == [variable]  # its own only
    monkeypatch.setenv(variable, "mine")
    assert pin_socket_interface(backend) is None and os.environ[variable] == "mine"  # the user's choice stands


def test_two_torchrun_hosts_given_different_flags_stop_with_one_line_each(tmp_path):
    """Two `torchrun --nnodes 2` on this machine (two "hosts" on loopback), the second given another --lr: both
    ranks exit 2 naming the setting before any collective, instead of training two different runs together."""
    with reserved_port() as port:  # held until both hosts have ended: no other process takes it meanwhile
        procs = []
        for node, lr in ((0, "1e-3"), (1, "2e-3")):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
                   str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "aqpipe", "launch",
                   "--model", "gpt2-tiny", "--pp", "2", "--steps", "1", "--lr", lr, "--out", str(tmp_path / f"host{node}"),
                   "--no-progress"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env={**os.environ, "HF_HUB_OFFLINE": "1"}))
        outputs = [p.communicate(timeout=240) for p in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode != 0, err[-2000:]
        lines = [line for line in err.splitlines() if line.startswith("aqpipe: error:")]
        assert len(lines) == 1 and "the ranks disagree on config lr" in lines[0] and ": 0.002)" in lines[0], err[-2000:]
        assert "exitcode  : 2" in err
    assert not (tmp_path / "host0" / "metrics.jsonl").exists()


@pytest.mark.parametrize("variables, size", [({"LOCAL_WORLD_SIZE": "2"}, 2), ({"LOCAL_SIZE": "3"}, 3), ({}, 8)])
def test_the_ranks_of_a_host_are_counted_under_torchrun_and_deepspeed(monkeypatch, variables, size):
    from aqpipe.pipeline.world.grid import local_world_size

    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert local_world_size(8) == size


def _backends(gpus: list) -> list[str]:
    """Every rank of one store choosing its collective backend, each on a thread, rank r on GPU `gpus[r]`."""
    from aqpipe.pipeline.links.rendezvous import collective_backend

    return on_threads(len(gpus), lambda store, rank: collective_backend(store, rank, len(gpus), gpus[rank]))


def test_nccl_only_where_every_rank_has_a_gpu_no_other_rank_uses():
    """NCCL refuses two ranks of a communicator on one GPU, so ranks that share one use gloo (collectives staged
    through the host). Which GPU a rank has is its identity (`gpu_identity`), not its index on the host: ranks each
    given their own GPU through CUDA_VISIBLE_DEVICES (SLURM's --gpus-per-task=1, a Kubernetes pod per rank) all see
    cuda:0 and a host of one GPU, which a rule of local ranks ≤ GPUs the host shows would put on gloo. Every rank
    chooses alike."""
    assert _backends(["GPU-1a", "GPU-2b", "GPU-3c", "GPU-4d"]) == ["nccl"] * 4
    assert _backends(["GPU-1a", "GPU-1a", "GPU-3c", "GPU-4d"]) == ["gloo"] * 4  # two ranks on one GPU (MPS, say)
    assert _backends([None, None]) == ["gloo"] * 2  # on the host
    assert _backends(["GPU-1a", None]) == ["gloo"] * 2  # (the device fact then names the mismatch)


def test_a_gpu_is_known_as_nccl_knows_it_by_its_host_and_pci_address(monkeypatch):
    """Two MIG slices of one GPU have UUIDs of their own but one PCI address, and NCCL refuses two ranks on them
    ("duplicate GPU"): they count as one GPU, so their ranks use gloo. Without a PCI address from torch, the UUID."""
    import socket
    from types import SimpleNamespace

    import torch

    from aqpipe.pipeline.links.rendezvous import gpu_identity

    slices = iter([SimpleNamespace(uuid="MIG-1", pci_domain_id=0, pci_bus_id=0x41, pci_device_id=0),
                   SimpleNamespace(uuid="MIG-2", pci_domain_id=0, pci_bus_id=0x41, pci_device_id=0)])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: next(slices))
    mig = [gpu_identity(torch.device("cuda", 0)) for _ in range(2)]
    assert mig[0] == mig[1] == f"{socket.gethostname()} pci 0000:41:00" and _backends(mig) == ["gloo"] * 2
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-0a1b"))
    assert gpu_identity(torch.device("cuda", 0)) == "uuid GPU-0a1b"
    assert gpu_identity(torch.device("cpu")) is None


# Two ranks of a `pp x dp` grid of 2 meet as a run's ranks do: under the start-up time-out, then (phase "training")
# under the stall time-out from `begin_training` on, or (phase "late to training") after rank 1 came to
# `begin_training` `late` seconds after rank 0. Rank 0 reports how its all-reduce on each named group ended. In the
# start-up phase rank 1 reaches each collective `late` seconds after rank 0; in the training phase it never joins,
# and stays until rank 0 has seen its collective end (a peer's exit would end it otherwise).
def _late_rank_main(rank: int, port: int, pp: int, dp: int, phase: str, names: tuple[str, ...], out: str) -> None:
    """One of the two ranks (a fork of the test ranks' warm server, `tests.distributed`); rank 0 writes how each
    all-reduce ended to `out`, a line per group."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from aqpipe.pipeline.links.rendezvous import begin_training, startup_timeout
    from aqpipe.pipeline.world.grid import Grid, create_groups

    stall, late = 1.5, 3.0  # (late: twice the stall time-out)
    timeout = startup_timeout(stall)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout)
    dist.init_process_group("gloo", rank=rank, world_size=2, store=store, timeout=timeout)
    groups = create_groups(Grid(pp, dp, rank), "gloo", timeout)
    chosen = {"world": None, "pipeline": groups.pipeline, "data parallel": groups.data_parallel}
    if phase == "late to training":  # rank 1's replica still loading while rank 0's is ready to train
        if rank == 1:
            time.sleep(late)
        begin_training(store, groups, stall)
        phase = "trains"
    if phase == "training":
        begin_training(store, groups, stall)
    lines = []
    for name in names:
        if rank == 1 and phase == "training":
            store.wait(["ended"], timedelta(seconds=60))
            break
        if rank == 1 and phase == "start-up":
            time.sleep(late)
        try:
            dist.all_reduce(torch.ones(1), group=chosen[name])
            lines.append(f"{name} joined")
        except RuntimeError as e:
            lines.append(f"{name} failed: {str(e).splitlines()[0][:160]}")
        if rank == 0:
            store.set("ended", "1")
    if rank == 0:
        Path(out).write_text("\n".join(lines))
    os._exit(0)  # (no teardown of the groups: see tests.distributed._entry)


def _late_rank(pp: int, dp: int, phase: str, *groups: str) -> list[str]:
    """What rank 0 saw, one line per group, after rank 1 came late to each (`_late_rank_main`)."""
    with tempfile.TemporaryDirectory(prefix="aqpipe-late-") as folder, reserved_port() as port:
        out = Path(folder) / "rank-0.txt"
        run_forked(_late_rank_main, [(rank, port, pp, dp, phase, groups, str(out)) for rank in (0, 1)], 120)
        return out.read_text().splitlines() if out.exists() else []


@pytest.mark.parametrize("pp, dp, groups", [(2, 1, ("world", "pipeline")), (1, 2, ("data parallel",))])
def test_until_training_begins_a_rank_may_reach_a_collective_long_after_the_stall_timeout(pp, dp, groups):
    """Start-up (a host downloading its weights, rank 0 profiling a time partition, a resume's checks) may hold one
    rank far longer than a step may take: its collectives must wait for it (they timed out after --stall-timeout)."""
    assert _late_rank(pp, dp, "start-up", *groups) == [f"{name} joined" for name in groups]


@pytest.mark.parametrize("pp, dp, group", [(2, 1, "world"), (2, 1, "pipeline"), (1, 2, "data parallel")])
def test_once_training_begins_every_group_times_out_after_the_stall_timeout(pp, dp, group):
    """--stall-timeout is every collective's time-out while training; the pipeline and data-parallel groups had
    torch's defaults (30 min under gloo, 10 under NCCL, whatever the setting said)."""
    lines = _late_rank(pp, dp, "training", group)
    # gloo: "Timed out waiting 1500ms for recv operation …" (not "Connection closed by peer" once rank 1 gave up)
    assert len(lines) == 1 and lines[0].startswith(f"{group} failed:") and "Timed out waiting 1500ms" in lines[0], lines


def test_a_replica_ready_to_train_waits_for_one_still_starting_up():
    """Only a pipeline's ranks meet while they start up: a replica whose host loads fast must not begin training (and
    its short time-outs) while another replica's host is still loading, or its first gradient sync times out."""
    assert _late_rank(1, 2, "late to training", "data parallel") == ["data parallel joined"]


def _store() -> dist.TCPStore:
    from datetime import timedelta

    return dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5))


@pytest.mark.parametrize("max_restarts", ["0", "3"])
def test_each_start_of_a_torchrun_job_keys_its_entries_apart(monkeypatch, max_restarts):
    """torchrun keeps one store for every start of a job: the static rendezvous its agents' (where their role records
    lie), and under c10d unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. A restart's ranks would read the dead start's
    gloo addresses there and hang: the static one's keys are the start's, and c10d's shared store is refused where a
    restart may come."""
    from aqpipe.pipeline.links.rendezvous import RendezvousConflict, elastic_attempt

    store = _store()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", max_restarts)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # c10d with a store of its own per round
    assert elastic_attempt(store) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    if max_restarts == "0":
        assert elastic_attempt(store) is None
    else:
        with pytest.raises(RendezvousConflict, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
            elastic_attempt(store)
    store.set("job/torchelastic/role_info/0", b"agent")  # what the static rendezvous's agent records
    assert elastic_attempt(store) == "attempt-2"
