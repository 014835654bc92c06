"""The GPU checks (`pytest -m gpu`): codecs computing on the GPU, several ranks sharing one GPU, NCCL or staged
collectives. They skip where CUDA is absent (CI never has a GPU); benchmarks/README.md says when they last ran on a
GPU (or that they have not yet). `AQPIPE_TEST_DEVICE=cpu pytest -m gpu tests/test_gpu.py` runs the same checks on the host,
which checks the checks themselves on a machine without a GPU.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aqpipe.compress.link.aqsgd import store_checksum
from aqpipe.compress.link.codecs import QuantOptions, build_codec
from aqpipe.pipeline.transport import Header
from aqpipe.storage import MemoryStore, StoreView

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


def _has_triton() -> bool:
    from aqpipe.compress import fused

    return fused._kernels() is not None


needs_triton = pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.is_available() and not _has_triton(),
                                  reason="the fused codec kernels need Triton (a CUDA build of torch brings it)")

# Where a training step may make the host wait for the GPU (file, function), each for a reason: the one read of an
# AQ-SGD message's verdicts and checksum sums, the copy of its new m(ξ) into host RAM (none with --store-device
# cuda), and the step's gradient norm, which crosses to the host for the collectives staged through it and for
# the clipping decision.
EXPECTED_SYNCS = {("aqpipe/compress/link/aqsgd.py", "read_all"), ("aqpipe/storage/base.py", "on_device"),
                  ("aqpipe/pipeline/optimizer_phase.py", "_clip")}


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
    stores = [MemoryStore(torch.float16, DEVICE), MemoryStore(torch.float16, DEVICE), MemoryStore(torch.float16)]
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
    from aqpipe.runtime.resume import to_device

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
@pytest.mark.parametrize("store", ["host", "gpu"])
def test_a_training_step_waits_for_the_gpu_only_where_expected(tmp_path, store):
    """Every step from the third under torch.cuda.set_sync_debug_mode (AQPIPE_CUDA_SYNC_AUDIT): each place that
    made the host wait is one of EXPECTED_SYNCS, at most twice per AQ-SGD message. m(ξ) in host RAM: GPT-2 in fp32;
    on the GPU: Llama (its embedding tied to its head: the row exchange) in bf16."""
    model = ["--model", "gpt2-tiny"] if store == "host" else ["--model", "llama-tiny", "--precision", "bf16",
                                                               "--store-device", "cuda"]
    flags = ["--pp", "4", "--epochs", "3", "--fw", "aqsgd:3", "--bw", "directq:6"]
    launch(tmp_path / "run", *model, *flags, env={"AQPIPE_CUDA_SYNC_AUDIT": "1"})
    places, steps = {}, 0
    for log in (tmp_path / "run" / "logs").glob("rank-*.log"):
        for line in log.read_text().splitlines():
            if "synchronizing calls" in line:
                steps += 1
                # a middle stage codes 2 AQ-SGD messages per micro-batch (4 per step), each read once and, with a
                # host store, copied once; plus the gradient norm
                assert int(line.split(":")[2].split()[0]) <= 4 * 2 * (2 if store == "host" else 1) + 1, line
            elif "cuda sync audit:" in line:
                count, where, function = line.split("cuda sync audit:")[1].split()
                place = (where.rsplit(":", 1)[0], function)
                places[place] = places.get(place, 0) + int(count)
    assert steps > 0
    assert set(places) <= EXPECTED_SYNCS, places
    if store == "gpu":
        assert ("aqpipe/storage/base.py", "on_device") not in places


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


@needs_cuda
def test_the_fork_servers_imports_start_no_thread_on_a_gpu_machine():
    """On the H200 an import in the fork server started a thread (not on the CPU machines, even with the same CUDA
    build of torch), so the ranks there started as fresh processes: jemalloc's background thread (the image preloads
    jemalloc), which is sound to fork beside. Imported one module at a time, as the server does: which module
    started which other thread (by name), if any."""
    from aqpipe.launch.worker_entry import rank_imports

    modules = sorted(set(rank_imports(model="gpt2-tiny")) | set(rank_imports(model="llama-tiny", lora=True)))
    probe = ("from aqpipe.launch.fork_safety import fork_safe, other_threads\n"
             "from aqpipe.launch.forkserver import SERVER_ENV, _preload\n"
             "import os\n"
             "os.environ.update(SERVER_ENV)\n"
             f"for module in {modules!r}:\n"
             "    _preload([module])\n"
             "    unsafe = [name for name, is_python in other_threads() if not fork_safe(name, is_python)]\n"
             "    if unsafe:\n"
             "        print(module, unsafe)\n"
             "        break\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "", f"an import started a thread: {out.stdout.strip()}"


@needs_cuda
@pytest.mark.parametrize("spec,direction,per,grid", [("directq:4", "fw", "channel", "signed"),
                                                     ("directq:3", "bw", "token", "fit"),
                                                     ("directq:1", "fw", "channel", "signed"),
                                                     ("directq:8", "bw", "channel", "symmetric"),
                                                     ("rtq:4", "fw", "channel", "signed"),
                                                     ("rtq:3", "bw", "channel", "signed"),
                                                     ("rtqo:4", "fw", "channel", "signed")])
def test_a_codecs_cuda_graph_replays_the_bits_of_its_ops(monkeypatch, spec, direction, per, grid):
    """A stateless codec's encode and decode replayed from CUDA graphs (from the third call of a shape) give the
    bytes and values the same calls give op by op (AQPIPE_CUDA_GRAPHS=0), call after call."""
    from aqpipe.compress import cuda_graphs

    options = QuantOptions(per=per, grid=grid)
    codec = build_codec(spec, direction, options=options, device=DEVICE)
    ids = torch.arange(4)
    cuda_graphs.clear()
    before = cuda_graphs.captured()
    for call in range(5):
        x = torch.randn(4, 24, 40, device=DEVICE) * (call + 1)
        monkeypatch.setenv(cuda_graphs.SWITCH, "1")
        replayed = codec.encode(x, ids)
        decoded = codec.decode(_header(replayed, codec), replayed.payload, ids)
        monkeypatch.setenv(cuda_graphs.SWITCH, "0")
        op_by_op = codec.encode(x, ids)
        assert torch.equal(replayed.payload, op_by_op.payload), call
        assert torch.equal(decoded, codec.decode(_header(op_by_op, codec), op_by_op.payload, ids)), call
    assert cuda_graphs.captured() >= before + 2  # its encode and its decode


@needs_cuda
@pytest.mark.parametrize("spec,first_sight,dtype", [("aqsgd:3", "fp32", torch.float32),
                                                    ("aqsgd:4", "rtq:4", torch.float32),
                                                    ("aqsgd-rtq:3", "directq:6", torch.bfloat16),
                                                    ("aqsgd:3", "rtqo:4", torch.float32)])
def test_aqsgd_replayed_from_cuda_graphs_sends_and_keeps_the_bits_of_its_ops(monkeypatch, spec, first_sight, dtype):
    """Two AQ-SGD links fed the same activations, one replaying its kernels from CUDA graphs and one op by op: every
    message's bytes, every decoded activation and every m(ξ) agree bit for bit, first sights (three batches of new
    samples: the third replays) and deltas alike."""
    from aqpipe.compress import cuda_graphs

    cuda_graphs.clear()
    options = QuantOptions()
    links = []
    for _ in range(2):
        send, recv = MemoryStore(torch.float16, DEVICE), MemoryStore(torch.float16, DEVICE)
        links.append((build_codec(spec, "fw", StoreView(send, 0, "send"), options, device=DEVICE,
                                  first_sight=first_sight),
                      build_codec(spec, "fw", StoreView(recv, 0, "recv"), options, device=DEVICE,
                                  first_sight=first_sight), send, recv))
    x = torch.randn(12, 16, 32, device=DEVICE)
    for visit in range(7):
        ids = torch.tensor([[3, 1, 4, 5], [0, 2, 6, 7], [8, 9, 10, 11]][visit % 3])
        rows = slice(4 * (visit % 3), 4 * (visit % 3) + 4)
        x[rows] += 0.1 * torch.randn_like(x[rows])
        results = []
        for switch, (sender, receiver, _, _) in zip(("1", "0"), links):
            monkeypatch.setenv(cuda_graphs.SWITCH, switch)
            encoded = sender.encode(x[rows].to(dtype), ids, compress=True)
            results.append((encoded, receiver.decode(_header(encoded, sender), encoded.payload, ids)))
        (graphed, graphed_out), (op_by_op, op_by_op_out) = results
        assert torch.equal(graphed.payload, op_by_op.payload), visit
        assert torch.equal(graphed_out, op_by_op_out), visit
    for i in range(12):
        values = [store.get(0, side, [i])[0] for _, _, send, recv in links for store, side in ((send, "send"),
                                                                                           (recv, "recv"))]
        assert all(torch.equal(values[0], v) for v in values[1:])
    kinds = {signature[0][1] for signature in cuda_graphs._cache.graphs if isinstance(signature[0][0], str)
             and signature[0][0].startswith("aqsgd")}
    assert {"delta-encode", "delta-decode"} <= kinds and (first_sight == "fp32" or "first-encode" in kinds)


_FAILED_CAPTURE = """
import logging, torch
from aqpipe.compress.cuda_graphs import captured, graphed

def waits(x):
    return (x * float(x.sum()),)  # float() reads the GPU: not allowed inside a capture

warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("aqpipe.compress.cuda_graphs").addHandler(handler)
x = torch.randn(64, device="cuda")
results = [graphed("test-waits", waits, x)[0] for _ in range(4)]
doubled = [graphed("test-pure", lambda t: (t * 2,), x)[0] for _ in range(3)]
assert captured() == 0 and any("capture of test-waits failed" in w for w in warnings), warnings
assert all(torch.equal(r, x * float(x.sum())) for r in results)
assert all(torch.equal(d, x * 2) for d in doubled)
assert torch.equal((x + 1).cpu(), x.cpu() + 1)  # no error left behind on the device
torch.cuda.manual_seed(5)  # the default generator, which the capture registered, is out of capture mode
draws = torch.randn(8, device="cuda")
torch.cuda.manual_seed(5)
assert torch.equal(draws, torch.randn(8, device="cuda"))
print("recovered")
torch.cuda.empty_cache()
side = torch.cuda.Stream()
size = 7_341_056  # (an odd size: the freed block is the allocator's best fit for the next one)
block = torch.empty(size, dtype=torch.uint8, device="cuda")
pointer = block.data_ptr()
block.record_stream(side)
del block
torch.cuda.synchronize()
# with a capture still counted as underway the allocator defers that free for good, and hands out new memory
print("reused" if torch.empty(size, dtype=torch.uint8, device="cuda").data_ptr() == pointer else "not reused")
"""


@functools.cache
def _after_a_failed_capture() -> str:
    """Run a capture that fails in a process of its own (what torch leaves behind cannot spill into other tests)."""
    proc = subprocess.run([sys.executable, "-c", _FAILED_CAPTURE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@needs_cuda
def test_a_codec_graphs_capture_failure_falls_back_to_its_ops():
    """A function that makes the host wait cannot be captured: graphs are off from then on, with a warning, the
    results are right, and the GPU and its default random generator (which every capture registers) go on working."""
    assert "recovered" in _after_a_failed_capture()


@needs_cuda
@pytest.mark.xfail(strict=True, reason="torch 2.11-2.13 leave the allocator counting an abandoned capture as active, "
                   "which no Python call undoes (pytorch/pytorch#190308): stream-recorded frees wait for good (strict: "
                   "a torch that fixes it passes, and this mark is then to go)")
def test_after_a_failed_capture_a_freed_stream_recorded_block_is_reused():
    assert "not reused" not in _after_a_failed_capture()


@needs_cuda
@needs_triton
@pytest.mark.parametrize("bits", range(2, 9))
def test_the_fused_kernels_write_the_bits_of_the_torch_ops_on_the_gpu(bits):
    """DirectQ's fused kernels (aqpipe.compress.fused) against the torch ops on the same GPU — rows, the values AQ-SGD
    keeps as m(ξ) and decoded values bit for bit — and the host's decode of the GPU's rows against the GPU's: real-run
    shapes and ragged tiles, every grid they take, an all-zero channel, −0, values past fp16, fp16-subnormal scales."""
    from aqpipe.compress import fused
    from aqpipe.compress.link.directq import decode_samples, encode_samples
    from aqpipe.compress.quantize import dequantize, quantize
    from tests.fused_cases import edge_case_batch

    torch.manual_seed(bits)
    for shape in [(4, 128, 576), (8, 1024, 576), (4, 512, 1600), (3, 17, 40), (2, 3, 5, 16), (1, 1, 8)]:
        for grid in ("signed", "symmetric", "uniform"):
            x = edge_case_batch(shape, DEVICE)
            assert fused.encodable(x, bits, "channel", False, grid)
            q = quantize(x, bits, "channel", False, None, grid)
            rows, values = fused.encode(x, bits, grid, values=True)
            assert torch.equal(rows, encode_samples(q)), (shape, grid)
            assert torch.equal(values.view(torch.int32), dequantize(q, shape).view(torch.int32)), (shape, grid)
            decoded = fused.decode(rows, shape, bits, grid)
            assert torch.equal(decoded.view(torch.int32), values.view(torch.int32)), (shape, grid)
            on_host = decode_samples(rows.cpu(), shape, bits, "channel", grid)
            assert torch.equal(on_host.view(torch.int32), decoded.cpu().view(torch.int32)), (shape, grid)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("spec,first_sight,dtype,store", [("aqsgd:3", "fp32", torch.float32, torch.float16),
                                                          ("aqsgd:4", "directq:6", torch.bfloat16, torch.float16),
                                                          ("aqsgd:2", "fp32", torch.float32, torch.bfloat16),
                                                          ("aqsgd:8", "rtq:4", torch.float32, torch.float32)])
def test_aqsgd_through_the_fused_kernels_in_graphs_keeps_the_bits_of_the_torch_ops(monkeypatch, spec, first_sight,
                                                                                   dtype, store):
    """Two AQ-SGD links and two DirectQ codecs fed the same activations, one through the fused kernels replayed from
    CUDA graphs, one through the torch ops op by op: every message's bytes and checksum, decoded activation and m(ξ)
    agree (the fidelity norms, summed in another order, to float tolerance). m(ξ) in fp16, bf16 (both fused) and
    fp32 (the torch ops update it)."""
    from aqpipe.compress import cuda_graphs, fused

    cuda_graphs.clear()
    options = QuantOptions()
    links = []
    for _ in range(2):
        send, recv = MemoryStore(store, DEVICE), MemoryStore(store, DEVICE)
        links.append((build_codec(spec, "fw", StoreView(send, 0, "send"), options, device=DEVICE,
                                  first_sight=first_sight),
                      build_codec(spec, "fw", StoreView(recv, 0, "recv"), options, device=DEVICE,
                                  first_sight=first_sight), send, recv, build_codec("directq:6", "bw", device=DEVICE)))
    x = torch.randn(8, 64, 576, device=DEVICE)
    monkeypatch.setenv("AQPIPE_FUSED_KERNELS", "1")
    assert fused.encodable(x, 3, "channel", False, "signed")
    monkeypatch.setenv(fused.DELTA_SWITCH, "1")
    calls: list[str] = []

    def counting(name, kernel):
        def counted(*args, **kwargs):
            calls.append(name)
            return kernel(*args, **kwargs)
        return counted

    for name in ("encode", "decode", "delta_encode", "delta_decode"):
        monkeypatch.setattr(fused, name, counting(name, getattr(fused, name)))
    fidelity = []
    for visit in range(6):
        ids = torch.arange(4) + 4 * (visit % 2)
        x[ids] += 0.1 * torch.randn_like(x[ids])
        results = []
        for switch, (sender, receiver, _, _, directq) in zip(("1", "0"), links):
            monkeypatch.setenv(cuda_graphs.SWITCH, switch)
            monkeypatch.setenv("AQPIPE_FUSED_KERNELS", switch)
            monkeypatch.setenv(fused.DELTA_SWITCH, switch)
            encoded = sender.encode(x[ids].to(dtype), ids, compress=True)
            grads = directq.encode(x[ids] * 1e-3, ids)
            results.append((encoded.payload, receiver.decode(_header(encoded, sender), encoded.payload, ids),
                            torch.tensor(encoded.codec_check), grads.payload,
                            directq.decode(_header(grads, directq), grads.payload, ids)))
            fidelity.append(encoded.fidelity)
        for a, b in zip(*results):
            assert torch.equal(a, b), visit
        fused_fidelity, torch_fidelity = fidelity[-2:]
        assert (fused_fidelity is None) == (torch_fidelity is None) == (visit < 2)
        if fused_fidelity is not None:
            assert torch.allclose(fused_fidelity.squares, torch_fidelity.squares, rtol=1e-5)
    # the fused link ran its kernels (outside a graph only on a shape's first two calls: the rest replay them)
    fused_parts = {"encode", "decode"} | ({"delta_encode", "delta_decode"} if store != torch.float32 else set())
    assert set(calls) == fused_parts and not fused._failed, (calls, fused._failed)
    for i in range(8):
        values = [store.get(0, side, [i])[0] for _, _, send, recv, _ in links for store, side in ((send, "send"),
                                                                                              (recv, "recv"))]
        assert all(torch.equal(values[0], v) for v in values[1:])
