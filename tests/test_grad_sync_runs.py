"""Every gradient compressor trains a pp=2 x dp=2 pipeline through `aqpipe launch`: the loss falls, the replicas end
bit-identical (and the run's own digest check passed), and the bytes per step follow the method's formula; and
every method keeps pp=1 x dp=3 replicas bit-identical over 15 steps of a model with unused vocabulary rows."""

import json
import math

import pytest
import torch

from aqpipe.compress.bitpack import packed_bytes
from aqpipe.compress.grad.fft import CALIBRATION, transform_length
from aqpipe.compress.grad.qadam import freeze_step
from aqpipe.compress.grad.quantized import CHUNK
from aqpipe.compress.grad.ring import chunk_size
from aqpipe.compress.grad.signsgd import count_bits
from aqpipe.compress.grad.wire import all_gather_bytes, ring_all_reduce_bytes
from tests import warm
from tests.distributed import run_ranks

RUN = ["--pp", "2", "--dp", "2", "--seq-len", "16", "--max-samples", "128", "--micro-batch-size", "4",
       "--micro-batches", "2", "--epochs", "2", "--eval-every", "0", "--no-progress"]
PP, DP = 2, 2
STEPS, WARMUP_STEPS = 16, 10  # 128 samples / (2 replicas × 2 micro-batches × 4) per epoch × 2; gpt2-tiny's warm-up
CHECKPOINT_EVERY = 8


def stage_shapes(out, stage: int) -> list[torch.Size]:
    state = torch.load(out / "checkpoints" / "final" / f"stage-{stage}.pt", weights_only=True)
    return [t.shape for t in state.values()]


def rows(shapes) -> int:
    return sum(s[0] if len(s) >= 2 else math.prod(s) for s in shapes)


def powersgd_elements(shapes, rank: int) -> int:
    """Elements a PowerSGD step all-reduces: P and Q of each matrix worth compressing (torch's rule: (rows + cols)
    · r, r = min(rows, cols, rank), at least 2× smaller than the matrix), every other tensor whole."""
    total = 0
    for shape in shapes:
        rows_, cols = shape[0], math.prod(shape[1:])
        r = min(rows_, cols, rank)
        total += (rows_ + cols) * r if 2 * (rows_ + cols) * r < rows_ * cols else rows_ * cols
    return total


def fft_payload(p: int, theta: float, bits: int, step: int) -> int:
    """One replica's FFT message for a gradient of p values: the bitmap of the bins of its zero-padded length, a flag
    byte, then the kept components' real and imaginary parts, as fp32 for the CALIBRATION first steps, as `bits`-bit
    floats after."""
    bins = transform_length(p) // 2 + 1
    k = max(1, min(bins, math.ceil((1.0 - theta) * bins)))
    if step <= CALIBRATION:
        values = 8 * k
    else:
        values = packed_bytes(2 * k, bits) if bits <= 8 else packed_bytes(2 * k, 8) + packed_bytes(2 * k, bits - 8)
    return packed_bytes(bins, 1) + 1 + values


def sidco_target(spec: str, p: int) -> int:
    """The bytes of a SIDCo message that selects exactly its target ratio of p values (as top-k would)."""
    return all_gather_bytes(8 + 8 * math.ceil(float(spec.split(":")[2]) * p), DP)


def expected_bytes(spec: str, shapes, step: int) -> tuple[int, int]:
    """(least, most) bytes one rank of a stage with parameters of `shapes` sends at `step` (1-based)."""
    p, n = sum(math.prod(s) for s in shapes), DP
    if spec == "none":
        exact = ring_all_reduce_bytes(4 * p, n)
    elif spec in ("fp16", "bf16"):
        exact = ring_all_reduce_bytes(2 * p, n)
    elif spec.startswith("ef:"):
        bits, chunks = int(spec[3:]), -(-p // CHUNK)
        exact = all_gather_bytes(8 + 2 * chunks + chunks * packed_bytes(CHUNK, bits), n)
    elif spec.startswith("topk:"):
        exact = all_gather_bytes(8 + 8 * math.ceil(float(spec[5:]) * p), n)
    elif spec == "signsgd":  # the row mask, then the ring over the active elements (at most all of them)
        c = chunk_size(p, n)
        most = sum(packed_bytes(c, count_bits(i)) for i in range(1, n)) + (n - 1) * packed_bytes(c, 1)
        return ring_all_reduce_bytes(rows(shapes), n) + 1, ring_all_reduce_bytes(rows(shapes), n) + most
    elif spec.startswith("marsit:"):  # the row mask, then a 1-bit ring plus step sizes, or a full-precision round
        tensors = len(shapes)
        most = max(2 * (n - 1) * packed_bytes(chunk_size(p, n), 1) + ring_all_reduce_bytes(4 * tensors, n),
                   ring_all_reduce_bytes(4 * p, n))
        return ring_all_reduce_bytes(rows(shapes), n) + 1, ring_all_reduce_bytes(rows(shapes), n) + most
    elif spec.startswith("powersgd:"):  # torch's hook all-reduces plainly for its first two steps
        elements = p if step <= 2 else powersgd_elements(shapes, int(spec.split(":")[1]))
        exact = ring_all_reduce_bytes(4 * elements, n)
    elif spec.startswith("qadam:"):  # fp32 all-reduce until v freezes, then the two-phase momentum exchange
        if step <= freeze_step(STEPS, WARMUP_STEPS):
            exact = ring_all_reduce_bytes(4 * p, n)
        else:
            chunk_rows = -(-chunk_size(p, n) // CHUNK)
            exact = 2 * (n - 1) * (2 * chunk_rows + chunk_rows * packed_bytes(CHUNK, int(spec.split(":")[1])))
    elif spec.startswith("fft:"):  # the message's length goes first in the gather; the 3rd step agrees the format
        _, theta, bits = spec.split(":")
        exact = all_gather_bytes(8 + fft_payload(p, float(theta), int(bits), step), n)
        if step == CALIBRATION:
            exact += ring_all_reduce_bytes(8, n) + ring_all_reduce_bytes(8 * min(23, int(bits) + 8), n)
    elif spec.startswith("sidco:"):  # a fitted threshold: the count selected moves around ratio · p
        return sidco_target(spec, p) // 4, 4 * sidco_target(spec, p)
    else:
        raise AssertionError(f"no byte formula for {spec}")
    return exact, exact


@pytest.mark.parametrize("spec, optimizer, lr", [
    ("none", "adamw", "1e-3"), ("fp16", "adamw", "1e-3"), ("bf16", "adamw", "1e-3"), ("powersgd:2", "adamw", "1e-3"),
    ("ef:4", "adamw", "1e-3"), ("topk:0.05", "adamw", "1e-3"), ("sidco:exp:0.05", "adamw", "1e-3"),
    ("fft:0.5:10", "adamw", "1e-3"), ("qadam:4", "adamw", "1e-3"), ("signsgd", "sgd", "2e-3"),
    ("marsit:10", "sgd", "0.2"),
])
def test_compressor_trains_through_launch(tmp_path, spec, optimizer, lr):
    out = tmp_path / "run"
    proc = warm.run("launch", *RUN, "--grad-sync", spec, "--optimizer", optimizer,
                           "--lr", lr, "--checkpoint-every", str(CHECKPOINT_EVERY), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in records[:3]) / 3
    last = json.loads((out / "summary.json").read_text())["final_loss"]
    assert last < first - 0.5, (first, last)
    # replicas bit-identical at the checkpoints kept (the two newest; each rank saves its own copy)
    for step in (STEPS - CHECKPOINT_EVERY, STEPS):
        directory = out / "checkpoints" / f"step-{step:08d}"
        for stage in range(PP):
            a, b = (torch.load(directory / f"rank-{stage + r * PP}.pt", weights_only=True)["model"] for r in range(DP))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (step, stage)
    # bytes per step: every rank of every stage, by the method's formula
    shapes = [stage_shapes(out, stage) for stage in range(PP)]
    assert len(records) == STEPS
    for r in records:
        bounds = [expected_bytes(spec, shapes[stage], r["step"]) for stage in range(PP)]
        least, most = DP * sum(b[0] for b in bounds), DP * sum(b[1] for b in bounds)
        assert least <= r["grad_sync_bytes"] <= most, (r["step"], r["grad_sync_bytes"], least, most)
    if spec.startswith("sidco:"):  # over the run, SIDCo's adaptive stages hold the mean count near the target
        target = DP * sum(sidco_target(spec, sum(math.prod(s) for s in shapes[stage])) for stage in range(PP))
        mean = sum(r["grad_sync_bytes"] for r in records) / len(records)
        assert 0.5 * target <= mean <= 2 * target, (mean, target)


METHODS = [("none", "adamw"), ("fp16", "adamw"), ("bf16", "adamw"), ("powersgd:2", "adamw"), ("ef:2", "adamw"),
           ("ef:1", "adamw"), ("qadam:2", "adamw"), ("topk:0.1", "adamw"), ("sidco:gamma:0.1", "adamw"),
           ("fft:0.5:8", "adamw"), ("signsgd", "sgd"), ("marsit:4", "sgd")]
VOCAB, USED = 64, 40


def _train_replicas(rank: int, world: int):
    """Each method in turn: 15 steps of a tiny LM whose vocabulary rows USED.. are never used, every replica on its
    own data; returns, per method, the final parameters and whether the unused rows kept their initial values."""
    from aqpipe.compress.grad import DPGroup, build_grad_sync
    from aqpipe.compress.grad.qadam import freeze_step
    from aqpipe.pipeline.numerics.optim import build_optimizer, momenta

    out = {}
    for method, optimizer_name in METHODS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
        start = model[0].weight.detach().clone()
        sign = method.split(":")[0] in ("signsgd", "marsit")
        optimizer_momentum, vote_momentum = momenta(None, sign)
        sync = build_grad_sync(method, DPGroup(None, tuple(range(world)), rank), seed=5,
                               freeze_after=freeze_step(15, 2), momentum=vote_momentum)
        optimizer, schedule = build_optimizer(model.parameters(), optimizer_name, 0.01, 0.0, 2, 15, grad_sync=sync,
                                              momentum=optimizer_momentum)
        generator = torch.Generator().manual_seed(100 + rank)
        for _ in range(15):
            tokens = torch.randint(0, USED, (8, 12), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
            sync.lr = schedule.get_last_lr()[0]
            sync.synchronize([p for p in model.parameters()])
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        out[method] = ([p.detach().clone() for p in model.parameters()],
                       torch.equal(model[0].weight[USED:].detach(), start[USED:]))
    return out


def test_every_method_keeps_three_replicas_bit_identical():
    results = run_ranks(_train_replicas, 3)
    assert all(status == "ok" for status, _ in results), results
    first = results[0][1]
    for method, _ in METHODS:
        for _, replica in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first[method][0], replica[method][0])), method
        if method in ("none", "fp16", "bf16", "signsgd", "marsit:4", "ef:2", "topk:0.1"):  # ef:1 has no zero code
            assert first[method][1], f"{method} moved vocabulary rows no replica used"
