"""The --grad-sync methods' table (aqpipe.compress.grad.methods): the fp32 copies of the trained parameters the
capacity plan counts for a replica's grad sync are what each method's code holds — measured here on gloo ranks with
every storage its ops make counted, from the op that makes it to the death of its last tensor."""

import gc

import pytest
import torch

from aqpipe.compress.grad.registry import sync_copies
from tests.distributed import run_ranks

METHODS = ["none", "fp16", "bf16", "powersgd:4", "ef:4", "qadam:4", "topk:0.01", "sidco:exp:0.01", "fft:0.5:8",
           "fft:0.1:32", "signsgd", "marsit:0"]
VALUES = 1024 * 256 + 1024  # a weight matrix and its bias
SEEN_IN_PART = ("powersgd",)  # part of its work runs on another thread (see below)


def _held(rank: int, world: int, methods: list[str]) -> dict[str, tuple[float, float]]:
    """Per method, over four steps (the compressors warm up, calibrate and start compressing in their first steps):
    the most copies its state kept after a step, and the most its sync held at once (qadam's momentum exchange,
    which its optimizer's step runs, included, from its second step: the first makes the optimizer's moments)."""
    from torch.utils._pytree import tree_leaves

    from aqpipe.compress.gpu.graph_memory import LiveBytes
    from aqpipe.compress.grad import DPGroup
    from aqpipe.compress.grad.qadam import QuantizedAdam
    from aqpipe.compress.grad.registry import build_grad_sync

    sent = _hold_what_collectives_send()
    held = {}
    for method in methods:
        sync = build_grad_sync(method, DPGroup(None, tuple(range(world)), rank), seed=0, freeze_after=1)
        params = [torch.nn.Parameter(torch.zeros(1024, 256)), torch.nn.Parameter(torch.zeros(1024))]
        # qadam's exchange runs in its optimizer's step (whose moments, made in the first step, the plan counts apart)
        step_of = QuantizedAdam(params, sync).step if method.startswith("qadam") else lambda: None
        kept = peak = 0.0
        # a storage a call's ops leave in a cycle counts until the collector runs, which it may at any allocation:
        # never during a method's steps here
        gc.collect()
        gc.disable()
        for step in range(4):
            generator = torch.Generator().manual_seed(10 * step + rank)
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            if step == 0 and method.startswith("qadam"):  # (its optimizer makes its moments: counted apart)
                sync.synchronize(params)
                step_of()
                continue
            meter = LiveBytes(tuple(p.grad for p in params))
            with meter:
                sync.synchronize(params)
                step_of()
                sent.clear()
            state = [t for t in tree_leaves(sync.state_dict()) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            kept = max(kept, sum(t.numel() for t in state) / VALUES)
            peak = max(peak, meter.peak / (4 * VALUES))
        gc.enable()
        held[method] = (kept, peak)
    return held


def _hold_what_collectives_send() -> list:
    """From now on in this process, keep what each collective sends alive until the list returned is cleared. gloo's
    thread lets go of a send buffer a few milliseconds after the call returns, and whether that is before the sync's
    peak depends on timing: held, the count is always the most it can be."""
    import torch.distributed as dist

    sent: list = []

    def holding(fn, of):
        def call(*args, **kwargs):
            sent.append(of(*args, **kwargs))
            return fn(*args, **kwargs)
        return call

    dist.all_gather = holding(dist.all_gather, lambda out, tensor, *a, **k: tensor)
    dist.all_reduce = holding(dist.all_reduce, lambda tensor, *a, **k: tensor)
    dist.batch_isend_irecv = holding(dist.batch_isend_irecv,
                                     lambda ops: [op.tensor for op in ops if op.op is dist.isend])
    return sent


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_the_plan_counts_what_each_grad_sync_holds(dp):
    """The plan's count is at least what the code held, and within about one copy of it (a count far above would
    refuse runs that fit). At dp 1 only the sign-based methods and qadam, which run on one replica too, hold
    anything. torch's PowerSGD hook finishes its all-reduces in futures' callbacks, which run on gloo's thread when
    the work has not completed yet, out of the meter's sight: what it sees of PowerSGD depends on timing (4.02
    copies when it sees every op, 3.03 in most runs here), so PowerSGD's count is only required to be at least
    what the meter saw."""
    results = run_ranks(_held, dp, METHODS)
    for status, held in results:
        assert status == "ok", held
        for method, (kept, peak) in held.items():
            planned_kept, planned_peak = sync_copies(method, dp)
            assert planned_kept >= kept - 1e-3, (method, dp, planned_kept, kept)
            assert peak <= planned_peak, (method, dp, planned_peak, peak)
            if not method.startswith(SEEN_IN_PART):
                assert planned_peak <= peak + 1.0, (method, dp, planned_peak, peak)


WIRE_METHODS = METHODS + ["marsit:3", "marsit:1"]
SHAPES = ([(1024, 256), (1024,)], [(300, 200), (50,), (64, 8, 3), (7, 5)])


def _sent_per_step(rank: int, world: int, methods: list[str], shapes: list[tuple[int, ...]]) -> dict[str, list[int]]:
    """Per method, the bytes its grad sync counted in each of 7 steps (qadam's momentum exchange included)."""
    from aqpipe.compress.grad import DPGroup
    from aqpipe.compress.grad.qadam import QuantizedAdam
    from aqpipe.compress.grad.registry import build_grad_sync

    sent = {}
    for method in methods:
        sync = build_grad_sync(method, DPGroup(None, tuple(range(world)), rank), seed=0, freeze_after=1)
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        step_of = QuantizedAdam(params, sync).step if method.startswith("qadam") else lambda: None
        steps = []
        for step in range(7):
            generator = torch.Generator().manual_seed(10 * step + rank)
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            before = sync.bytes_sent
            sync.synchronize(params)
            step_of()
            steps.append(sync.bytes_sent - before)
        sent[method] = steps
    return sent


@pytest.mark.parametrize("dp", [2, 3])
@pytest.mark.parametrize("shapes", SHAPES, ids=["matrix-and-bias", "mixed"])
def test_the_plan_counts_what_each_grad_sync_sends(dp, shapes):
    """The bytes per step the capacity plan counts for a replica's grad sync (its step-time bound at --bandwidth) are
    what the code sends, once compressing and in its costliest step (fp32 first steps, Marsit's full-precision
    steps), within 1% (qadam's server chunks round apart from its estimate); sidco at most its target fraction's."""
    from aqpipe.compress.grad.registry import sync_step_bytes
    from aqpipe.compress.grad.wire import FIRST_STEPS, PERIODIC

    results = run_ranks(_sent_per_step, dp, WIRE_METHODS, shapes)
    assert all(status == "ok" for status, _ in results), results
    for method, steps in results[0][1].items():
        planned = sync_step_bytes(method, dp, shapes)  # (qadam here: v freezes after 1 step)
        if method.startswith("sidco"):
            assert 0 < steps[-1] <= planned.steady and max(steps) <= planned.costliest, (method, steps, planned)
            continue
        assert min(steps) == pytest.approx(planned.steady, rel=0.01), (method, steps, planned)
        assert max(steps) == pytest.approx(planned.costliest, rel=0.01), (method, steps, planned)
        costly = [i for i, sent in enumerate(steps) if sent > 1.01 * planned.steady]
        if planned.costliest_when == FIRST_STEPS:
            assert costly == list(range(planned.costly_steps)), (method, steps, planned)
        elif planned.costliest_when == PERIODIC and planned.costliest > planned.steady:
            period = int(method.split(":")[1])
            assert costly == list(range(0, len(steps), period)), (method, steps, planned)
        else:
            assert costly == [], (method, steps, planned)


def test_one_replica_sends_nothing():
    from aqpipe.compress.grad.registry import sync_step_bytes

    assert all(sync_step_bytes(method, 1, SHAPES[1]).costliest == 0 for method in WIRE_METHODS)
