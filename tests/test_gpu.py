"""The GPU checks (`pytest -m gpu`): codecs computing on the GPU, several ranks sharing one GPU, NCCL or staged
collectives. They skip where CUDA is absent (CI never has a GPU); benchmarks/README.md says when they last ran on a
GPU (or that they have not yet); tests/test_gpu_codecs.py holds the codecs' CUDA graphs and fused kernels,
tests/test_gpu_cuda_graphs.py CUDA graphs themselves.
`AQPIPE_TEST_DEVICE=cpu pytest -m gpu tests/test_gpu.py tests/test_gpu_codecs.py` runs the same checks on the host,
which checks the checks themselves on a machine without a GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aqpipe.compress.link.checksum import store_checksum
from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.pipeline.links.transport import Header
from aqpipe.storage import MemoryStore, StoreView, memory_store

DEVICE = os.environ.get("AQPIPE_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (run pytest -m gpu on a machine with one)")]
TINY = ["--seq-len", "32", "--max-samples", "64", "--micro-batch-size", "4", "--micro-batches", "4", "--seed", "3",
        "--no-progress", "--device", DEVICE]


def launch(out: Path, *flags: str, env: dict | None = None) -> list[dict]:
    """Run `aqpipe launch` (every rank on this machine's one GPU); returns the metrics records."""
    proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", *TINY, *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "launch-stderr.txt").write_text(proc.stderr)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="a check of CUDA itself (no host equivalent)")


# Where a training step may make the host wait for the GPU (file, function), each for a reason: the one read of an
# AQ-SGD message's verdicts and checksum sums; the step's gradient norm, which crosses to the host for the
# collectives staged through it and for the clipping decision; whether a tied table's gradient rows are finite,
# which decides their message's form (coded, or exact); transformers reading a padded batch's mask as it builds the
# attention mask (whether it may be dropped), once a micro-batch and stage. (A message's new m(ξ) reaches a store in
# host RAM or on disk as a queued copy, which the store's next call waits for on its event: no synchronizing call.)
EXPECTED_SYNCS = {("aqpipe/compress/link/aqsgd_rows.py", "read_all"),
                  ("aqpipe/pipeline/execution/optimizer_phase.py", "_clip"),
                  ("aqpipe/pipeline/links/tied_deltas.py", "encode_grads")}
PADDED_BATCH_SYNCS = {("aqpipe/stages/llama.py", "_attention_mask")}


@pytest.mark.parametrize("spec,direction,per", [("fp32", "fw", "channel"), ("fp16", "fw", "channel"),
                                                ("bf16", "bw", "channel"), ("directq:4", "fw", "channel"),
                                                ("directq:2", "bw", "token"), ("topk:0.1:8", "bw", "channel"),
                                                ("rtq:4", "fw", "channel"), ("rtq:6", "bw", "channel"),
                                                ("rtqo:4", "fw", "channel"), ("rtqo:6", "bw", "channel")])
def test_a_codec_encodes_on_the_device_and_only_bytes_reach_the_host(spec, direction, per):
    options = QuantOptions(per=per)
    x = torch.randn(4, 24, 40, device=DEVICE)
    ids = torch.arange(4)
    on_device = build_codec(spec, direction, options=options, device=DEVICE)
    encoded = on_device.encode(x, ids)
    assert encoded.payload.device.type == "cpu" and encoded.payload.dtype == torch.uint8
    header = _header(encoded, on_device)
    decoded = on_device.decode(header, encoded.payload, ids)
    assert decoded.device.type == torch.device(DEVICE).type
    on_host = build_codec(spec, direction, options=options).decode(header, encoded.payload, ids)
    assert torch.equal(decoded.cpu(), on_host)  # a table lookup and one multiply: the same bits on every device
    if spec == "fp32":
        assert torch.equal(decoded.cpu(), x.cpu())


def _header(encoded, codec):
    return Header.for_encoded(encoded, codec.code)


def test_aqsgd_copies_stay_identical_across_devices_and_the_checksum_is_device_free():
    """A sender on the GPU (m(ξ) in GPU memory), one receiver on the GPU and one on the host: after several visits
    all three copies of m(ξ) are bit-identical, and every message's checksum passed on both receivers."""
    options = QuantOptions()
    stores = [memory_store(torch.float16, DEVICE), memory_store(torch.float16, DEVICE), MemoryStore(torch.float16)]
    sender = build_codec("aqsgd:3", "fw", StoreView(stores[0], 0, "send"), options, device=DEVICE)
    receivers = [build_codec("aqsgd:3", "fw", StoreView(stores[1], 0, "recv"), options, device=DEVICE),
                 build_codec("aqsgd:3", "fw", StoreView(stores[2], 0, "recv"), options)]
    ids = torch.tensor([3, 1, 4, 5])
    x = torch.randn(4, 16, 32, device=DEVICE)
    for visit in range(4):
        x = x + 0.1 * torch.randn_like(x)
        encoded = sender.encode(x, ids, compress=True)
        for receiver in receivers:
            receiver.decode(_header(encoded, sender), encoded.payload, ids)  # raises if its copy fails the checksum
    for i in ids.tolist():
        values = [s.get(0, side, [i])[0].cpu() for s, side in zip(stores, ("send", "recv", "recv"))]
        assert torch.equal(values[0], values[1]) and torch.equal(values[0], values[2])
    sample = [torch.randn(5, 7).half(), None, torch.randn(5, 7).half()]
    assert store_checksum([v if v is None else v.to(DEVICE) for v in sample]) == store_checksum(sample)


def test_aqsgd_on_the_gpu_with_m_in_host_ram_keeps_both_copies_identical():
    """Both ends compute on the GPU and keep m(ξ) in host RAM (the default store): each message's new m(ξ) crosses to
    the host as a queued copy that the next message lands; the copies agree, and every checksum passed."""
    options = QuantOptions()
    stores = [MemoryStore(torch.float16), MemoryStore(torch.float16)]
    sender = build_codec("aqsgd:3", "fw", StoreView(stores[0], 0, "send"), options, device=DEVICE)
    receiver = build_codec("aqsgd:3", "fw", StoreView(stores[1], 0, "recv"), options, device=DEVICE)
    x = torch.randn(8, 16, 32, device=DEVICE)
    for visit in range(5):
        ids = torch.tensor([3, 1, 4, 5] if visit % 2 == 0 else [0, 2, 6, 7])
        rows = slice(0, 4) if visit % 2 == 0 else slice(4, 8)
        x[rows] += 0.1 * torch.randn_like(x[rows])
        encoded = sender.encode(x[rows], ids, compress=True)
        receiver.decode(_header(encoded, sender), encoded.payload, ids)  # raises if its copy fails the checksum
    for i in range(8):
        sent, received = (s.get(0, side, [i])[0] for s, side in zip(stores, ("send", "recv")))
        assert sent.device.type == "cpu" and torch.equal(sent, received)
        assert not sent.is_pinned() and not received.is_pinned()  # landed: pageable storage of their own


@pytest.mark.parametrize("spec", ["fp32", "directq:3", "rtq:4", "rtqo:3", "aqsgd:3"])
@pytest.mark.parametrize("store_on", ["gpu", "host"])
def test_real_rows_are_coded_on_the_gpu_and_rebuilt_with_zeros_where_nothing_was_sent(spec, store_on):
    """A padded batch's real rows, grouped by length, through a codec on the GPU: what arrives at a real position is
    what the host makes of the same bytes (AQ-SGD: all three copies of m(ξ) identical, each its sample's real rows,
    in GPU slabs grown per length or in host RAM), padded positions are zeros, and stateless codecs send each
    sample's real rows as that sample alone would be coded."""
    from aqpipe.pipeline.links import real_rows
    from aqpipe.pipeline.links.real_rows import RealRows
    from aqpipe.pipeline.links.transport import KIND_ACTIVATION, SIDE_MASK

    options = QuantOptions(per="token")
    aqsgd = spec.startswith("aqsgd")
    stores = ([memory_store(torch.float16, DEVICE) if store_on == "gpu" else MemoryStore(torch.float16)
               for _ in range(2)] + [MemoryStore(torch.float16)]) if aqsgd else [None] * 3
    sides = ("send", "recv", "recv")

    def codec(i, device):
        view = StoreView(stores[i], 0, sides[i]) if aqsgd else None
        return build_codec(spec, "fw", view, options, device=device, first_sight="rtqo:3")

    sender, on_gpu, on_host = codec(0, DEVICE), codec(1, DEVICE), codec(2, "cpu")
    mask = torch.tensor([[1] * 12, [1] * 7 + [0] * 5, [0] * 12, [1] * 7 + [0] * 5, [0] * 3 + [1] * 9],
                        dtype=torch.uint8)
    ids = torch.tensor([10, 11, 12, 13, 14])
    rows = RealRows.of(mask, (5, 12, 48))
    assert [len(index) for index, _ in rows.groups] == [1, 2, 1]
    x = torch.randn(5, 12, 48, device=DEVICE)
    for visit in range(3):  # (AQ-SGD: first sights, then deltas)
        x = x + 0.05 * torch.randn_like(x)
        grouped = real_rows.encode(sender, x, ids, True, rows)
        header = real_rows.header_of(grouped, sender, KIND_ACTIVATION, visit, 0, (5, 12, 48), 5, SIDE_MASK)
        payload = torch.cat([grouped.directory, *(part.payload for part in grouped.parts)])  # (its copies landed)
        got = real_rows.decode(on_gpu, header, payload, ids, mask, "stage 0")
        host = real_rows.decode(on_host, header, payload, ids, mask, "stage 0")
        assert got.device.type == torch.device(DEVICE).type and torch.equal(got.cpu(), host)
        assert not got[mask.to(got.device) == 0].any()
        real = mask != 0
        error = (host - x.cpu())[real].norm() / x.cpu()[real].norm()
        assert error < (1e-6 if spec == "fp32" else 0.3), error
        if not aqsgd:
            for i in (0, 1, 4):
                alone = sender.encode(x[i][real[i].to(x.device)][None], ids[i:i + 1])
                coded = on_host.decode(_header(alone, sender), alone.payload, ids[i:i + 1])
                assert torch.equal(host[i][real[i]], coded[0]), i
    if aqsgd:
        for i, sample in enumerate(ids.tolist()):
            kept = [s.get(0, side, [sample])[0] if s.contains(0, side, [sample])[0] else None
                    for s, side in zip(stores, sides)]
            if not mask[i].any():
                assert kept == [None, None, None]
                continue
            assert kept[0].shape == (int(mask[i].sum()), 48)
            assert torch.equal(kept[0].cpu(), kept[1].cpu()) and torch.equal(kept[0].cpu(), kept[2])


def test_real_rows_on_the_gpu_train_the_padded_links_model_with_fp32_links(tmp_path):
    """Llama on instruction data (right padding), every rank on the GPU: with lossless links, sending only the real
    rows trains what sending every position trains, step for step, and sends fewer bytes both ways."""
    flags = ["--model", "llama-tiny", "--data", "builtin-instruct", "--seq-len", "64", "--max-samples", "48",
             "--pp", "3", "--steps", "4", "--fw", "fp32", "--bw", "fp32"]
    real = launch(tmp_path / "real", *flags, "--link-rows", "real")
    padded = launch(tmp_path / "padded", *flags, "--link-rows", "padded")
    assert [r["loss"] for r in real] == [r["loss"] for r in padded]
    for direction in ("fwd_bytes", "bwd_bytes"):
        assert sum(r[direction] for r in real) < 0.9 * sum(r[direction] for r in padded), direction


def test_the_pipeline_on_one_gpu_computes_what_one_process_computes(tmp_path):
    one = launch(tmp_path / "one", "--model", "gpt2-tiny", "--pp", "1", "--steps", "4", "--fw", "fp32", "--bw", "fp32")
    four = launch(tmp_path / "four", "--model", "gpt2-tiny", "--pp", "4", "--steps", "4", "--fw", "fp32",
                  "--bw", "fp32")
    for a, b in zip(one, four):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a["loss"], b["loss"])


def test_aqsgd_on_the_gpu_keeps_both_copies_identical(tmp_path):
    run = tmp_path / "lmdb"
    launch(run, "--model", "gpt2-tiny", "--pp", "4", "--epochs", "3", "--warmup-epochs", "1", "--fw", "aqsgd:3",
           "--bw", "directq:6", "--store", "lmdb")
    verify = subprocess.run([sys.executable, "-m", "aqpipe", "store", "verify", str(run)], capture_output=True,
                            text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    if DEVICE == "cuda":  # m(ξ) in GPU memory: every message's checksum compares the two copies
        records = launch(tmp_path / "on-gpu", "--model", "gpt2-tiny", "--pp", "4", "--epochs", "3", "--fw", "aqsgd:3",
                         "--bw", "directq:6", "--store-device", "cuda")
        assert records[-1]["store_hits"] > 0


@pytest.mark.parametrize("method,optimizer", [("none", "adamw"), ("qadam:4", "adamw"), ("marsit:4", "sgd")])
def test_replicas_on_one_gpu_stay_identical(tmp_path, method, optimizer):
    """pp 2 x dp 2 on one GPU (gloo, collectives staged through the host, since NCCL refuses two ranks on one
    device); the run checks the replicas' parameters bit for bit and fails if they differ."""
    records = launch(tmp_path / "run", "--model", "gpt2-tiny", "--pp", "2", "--dp", "2", "--steps", "6",
                     "--grad-sync", method, "--optimizer", optimizer, "--fw", "aqsgd:4", "--bw", "directq:8")
    assert records[-1]["grad_sync_bytes"] > 0


# NCCL refuses two ranks of one communicator on one GPU: its paths need a GPU per rank, so a machine with four.
needs_a_gpu_per_rank = pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.device_count() < 4,
                                          reason="needs 4 GPUs: NCCL, a GPU per rank")


@needs_a_gpu_per_rank
@pytest.mark.parametrize("method,optimizer", [("powersgd:2", "adamw"), ("qadam:4", "adamw"), ("signsgd", "sgd")])
def test_replicas_with_a_gpu_each_stay_identical_over_nccl(tmp_path, method, optimizer):
    """pp 2 x dp 2, a GPU per rank: NCCL on device tensors for the grad sync (torch's PowerSGD hook, the batched
    point-to-point of QuantizedAdam and the signSGD ring), the control collectives, the replicas' digests at a
    checkpoint and at the end (which fail the run if they differ), and the final weights' pieces to rank 0."""
    run = tmp_path / "run"
    records = launch(run, "--model", "gpt2-tiny", "--pp", "2", "--dp", "2", "--steps", "6", "--grad-sync", method,
                     "--optimizer", optimizer, "--fw", "aqsgd:4", "--bw", "directq:8", "--checkpoint-every", "3",
                     env={"NCCL_DEBUG": "INFO"})
    assert records[-1]["grad_sync_bytes"] > 0
    assert all("NCCL INFO" in (run / "logs" / f"rank-{r}.log").read_text() for r in range(4))  # NCCL, not gloo
    assert (run / "export" / "model.safetensors").stat().st_size > 0  # stage 1's weights reached rank 0


@needs_cuda
def test_what_a_runs_codec_graphs_hold_is_reported_and_within_the_capacity_plans_count(tmp_path):
    """Each step's record says what each stage's codec graphs hold on the GPU (`stage_codec_graph_bytes`); after a
    first epoch of first sights and two of deltas it is positive, and at most what the capacity plan counted for the
    stage, with the allocator's headroom and 2 MiB a graph."""
    import dataclasses

    from aqpipe.runtime.capacity.plan import ALLOCATOR_HEADROOM, plan_capacity
    from aqpipe.runtime.plan import make_plan
    from tests.test_capacity import flags_to_config

    flags = [*TINY, "--model", "gpt2-tiny", "--pp", "2", "--epochs", "3", "--fw", "aqsgd:3", "--bw", "directq:6"]
    records = launch(tmp_path / "run", *flags[len(TINY):])
    held = records[-1]["stage_codec_graph_bytes"]
    cfg = dataclasses.replace(flags_to_config(flags, tmp_path / "plan"), device="cuda")
    planned = [s.codec_bytes for s in plan_capacity(make_plan(cfg)).stages]
    assert all(h > 0 for h in held), held
    for got, counted in zip(held, planned):
        assert got <= counted * ALLOCATOR_HEADROOM + 8 * (2 << 20), (held, planned)


@pytest.mark.needs("peft")
def test_bf16_recompute_and_lora_train_on_the_gpu(tmp_path):
    records = launch(tmp_path / "run", "--model", "llama-tiny", "--pp", "2", "--epochs", "4", "--precision", "bf16",
                     "--recompute", "--lora", "8", "--lr", "3e-3", "--fw", "aqsgd:3", "--bw", "directq:6")
    assert records[-1]["loss"] < records[0]["loss"] - 0.1
    assert all(b > 0 for b in records[-1]["stage_peak_memory_bytes"])
    # a GPU's forward and backward times come from its events (in seconds): positive, and within the step's time
    step_seconds = records[-1]["elapsed_seconds"] - records[-2]["elapsed_seconds"]
    for forward, backward in zip(records[-1]["stage_forward_seconds"], records[-1]["stage_backward_seconds"]):
        assert 0 < forward and 0 < backward and forward + backward < step_seconds


def test_the_capacity_plan_reads_the_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", *TINY, "--model", "gpt2-tiny", "--pp", "4",
                           "--dry-run", "--out", str(tmp_path / "plan")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert ("cuda:0" if DEVICE == "cuda" else "RAM") in proc.stdout and "fits" in proc.stdout


@pytest.mark.parametrize("method", ["none", "powersgd:2", "ef:4", "qadam:4", "topk:0.1", "sidco:exp:0.1", "fft:0.5:10",
                                    "signsgd", "marsit:10"])
def test_a_grad_sync_state_moved_to_the_collectives_device_loads_back(method):
    """A resume hands every grad-sync state its DP group's device (the GPU under NCCL); random-generator states must
    still load: a generator's state is host bytes, and numpy reads only host tensors."""
    from aqpipe.compress.grad.base import DPGroup
    from aqpipe.compress.grad.registry import build_grad_sync
    from aqpipe.runtime.checkpoints.resume import to_device

    dp = DPGroup(None, (0,), 0, torch.device(DEVICE))
    saved = build_grad_sync(method, dp, seed=5).state_dict()
    fresh = build_grad_sync(method, dp, seed=6)
    fresh.load_state_dict(to_device(saved, dp.device))
    again = fresh.state_dict()
    for key, value in saved.items():
        pairs = zip(again[key], value) if isinstance(value, (list, tuple)) else [(again[key], value)]
        for got, want in pairs:
            if isinstance(want, torch.Tensor):
                assert torch.equal(got.cpu(), want.cpu()), key


@needs_cuda
def test_the_fork_servers_driver_probe_sees_cuinit_and_nothing_before():
    """`import torch` (a CUDA build) maps libcuda.so; the probe must call that uninitialised, and initialised once
    torch has initialised CUDA."""
    code = ("import torch\n"
            "from aqpipe.launch.fork_safety import cuda_driver_initialised\n"
            "before = cuda_driver_initialised()\n"
            "torch.cuda.init()\n"
            "print(before, cuda_driver_initialised())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]


@needs_cuda
def test_a_launch_on_the_gpu_forks_its_ranks(tmp_path):
    launch(tmp_path / "run", "--model", "gpt2-tiny", "--pp", "2", "--steps", "2")
    assert "fresh processes" not in (tmp_path / "run" / "launch-stderr.txt").read_text()


@needs_cuda
@pytest.mark.parametrize("store", ["host", "gpu", "lmdb", "gpu-real-rows"])
def test_a_training_step_waits_for_the_gpu_only_where_expected(tmp_path, store):
    """Every step from the third under torch.cuda.set_sync_debug_mode (AQPIPE_CUDA_SYNC_AUDIT): each place that
    made the host wait is one of EXPECTED_SYNCS, once per AQ-SGD message (with real rows, once per group of a
    message: at most a micro-batch's samples). m(ξ) in host RAM: GPT-2 in fp32; on the GPU: Llama (its embedding
    tied to its head: the row exchange) in bf16, also on padded instruction data; on disk (LMDB, whose puts waited
    for the GPU until their copy was queued): GPT-2 in fp32."""
    llama_on_gpu = ["--model", "llama-tiny", "--precision", "bf16", "--store-device", "cuda"]
    model = {"host": ["--model", "gpt2-tiny"], "lmdb": ["--model", "gpt2-tiny", "--store", "lmdb"],
             "gpu": llama_on_gpu, "gpu-real-rows": [*llama_on_gpu, "--data", "builtin-instruct", "--seq-len", "64",
                                                    "--max-samples", "48"]}[store]
    reads = 4 if store == "gpu-real-rows" else 1  # (per message)
    flags = ["--pp", "4", "--epochs", "3", "--fw", "aqsgd:3", "--bw", "directq:6"]
    launch(tmp_path / "run", *model, *flags, env={"AQPIPE_CUDA_SYNC_AUDIT": "1"})
    places, steps = {}, 0
    for log in (tmp_path / "run" / "logs").glob("rank-*.log"):
        for line in log.read_text().splitlines():
            if "synchronizing calls" in line:
                steps += 1
                # a middle stage codes 2 AQ-SGD messages per micro-batch (4 per step), each read once; plus the
                # gradient norm
                assert int(line.split(":")[2].split()[0]) <= 4 * 2 * reads + 1, line
            elif "cuda sync audit:" in line:
                count, where, function = line.split("cuda sync audit:")[1].split()
                place = (where.rsplit(":", 1)[0], function)
                places[place] = places.get(place, 0) + int(count)
    assert steps > 0
    assert set(places) <= EXPECTED_SYNCS | (PADDED_BATCH_SYNCS if store == "gpu-real-rows" else set()), places


def test_the_schedules_agree_bit_for_bit_on_the_gpu_with_evaluations(tmp_path):
    """GPipe, 1F1B and eager 1F1B accumulate gradients in the same order: the same losses, bit for bit, on a model
    whose embedding is tied to its head (GPT-2), evaluations included."""
    runs = {schedule: launch(tmp_path / schedule, "--model", "gpt2-tiny", "--pp", "4", "--steps", "4",
                             "--eval-every", "2", "--schedule", schedule)
            for schedule in ("gpipe", "1f1b", "eager-1f1b")}
    losses = {schedule: [(r["loss"], r.get("eval_loss")) for r in records] for schedule, records in runs.items()}
    assert losses["gpipe"] == losses["1f1b"] == losses["eager-1f1b"]
    assert sum(r.get("eval_loss") is not None for r in runs["gpipe"]) == 2


def test_fp16_with_loss_scaling_trains_on_the_gpu(tmp_path):
    records = launch(tmp_path / "run", "--model", "gpt2-tiny", "--pp", "2", "--epochs", "3", "--precision", "fp16",
                     "--lr", "3e-3", "--fw", "aqsgd:3", "--bw", "directq:6")
    assert all(r["loss"] == r["loss"] for r in records)  # finite where a step was not skipped for an overflow
    assert records[-1]["loss"] < records[0]["loss"]


def test_powersgd_with_collectives_staged_through_the_host(tmp_path):
    """pp 2 x dp 2 on one GPU: gloo, the DP group's collectives on the host, where torch's PowerSGD hook once
    crashed asking CUDA to synchronize a host device; the run checks the replicas bit for bit."""
    records = launch(tmp_path / "run", "--model", "gpt2-tiny", "--pp", "2", "--dp", "2", "--steps", "4",
                     "--grad-sync", "powersgd:2")
    assert records[-1]["grad_sync_bytes"] > 0



@needs_cuda
def test_a_run_moves_between_the_host_and_the_gpu_on_resume(tmp_path):
    """Epoch 1 on the host, epoch 2 resumed on the GPU, epoch 3 resumed on the host again: every resume loads the
    other device's checkpoint (optimizer, codec generators, grad-sync state) and m(ξ) from disk, and both copies of
    m(ξ) still agree at the end."""
    run = tmp_path / "run"
    launch(run, "--model", "gpt2-tiny", "--pp", "2", "--epochs", "1", "--warmup-epochs", "1", "--fw", "aqsgd:3",
           "--bw", "directq:6", "--store", "lmdb", "--device", "cpu")
    for epochs, device in (("2", "cuda"), ("3", "cpu")):
        proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", "--resume", str(run), "--epochs", epochs,
                               "--device", device, "--no-progress"], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and records[-1]["epoch"] >= 2
    assert records[-1]["store_hits"] > 0
    verify = subprocess.run([sys.executable, "-m", "aqpipe", "store", "verify", str(run)], capture_output=True,
                            text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.needs("peft")
@needs_cuda
def test_the_fork_servers_imports_start_no_thread_on_a_gpu_machine():
    """The fork server's imports on a GPU machine start no thread that is unsafe to fork beside (jemalloc's background
    thread, where an image preloads jemalloc, is safe). Imported one module at a time, as the server does: which
    module started which other thread (by name), if any."""
    from aqpipe.launch.worker_entry import rank_imports

    modules = sorted(set(rank_imports(model="gpt2-tiny")) | set(rank_imports(model="llama-tiny", lora=True)))
    probe = ("from aqpipe.launch.fork_safety import fork_safe, other_threads\n"
             "from aqpipe.launch.forkserver import SERVER_ENV\n"
             "from aqpipe.launch.rank_server import import_for_ranks\n"
             "import os\n"
             "os.environ.update(SERVER_ENV)\n"
             f"for module in {modules!r}:\n"
             "    import_for_ranks([module])\n"
             "    unsafe = [name for name, is_python in other_threads() if not fork_safe(name, is_python)]\n"
             "    if unsafe:\n"
             "        print(module, unsafe)\n"
             "        break\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "", f"an import started a thread: {out.stdout.strip()}"
