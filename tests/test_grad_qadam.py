"""qadam:B — AdamW during the warm-up, then a frozen second moment and compressed momentum shared by all replicas."""

import torch

from aqpipe.compress.grad import DPGroup
from aqpipe.compress.grad.qadam import QAdamSync, QuantizedAdam, freeze_step
from tests.distributed import record_unbatched_point_to_point, run_ranks


def grads_for(step: int, rank: int, shapes) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=generator) for s in shapes]


def test_warm_up_steps_are_exactly_adamw():
    shapes = [(8, 5), (5,)]
    ours = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
    reference = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
    sync = QAdamSync(DPGroup(None, (0,), 0), bits=4, warmup_steps=5)
    opt = QuantizedAdam(ours, sync, lr=0.01, weight_decay=0.1)
    ref = torch.optim.AdamW(reference, lr=0.01, weight_decay=0.1)
    for step in range(5):
        for group, grads in ((ours, grads_for(step, 0, shapes)), (reference, grads_for(step, 0, shapes))):
            for p, g in zip(group, grads):
                p.grad = g
        sync.synchronize(ours)
        opt.step()
        ref.step()
    for a, b in zip(ours, reference):
        assert torch.allclose(a, b, atol=1e-6)


def test_after_the_warm_up_v_is_frozen_and_one_replica_keeps_its_exact_momentum():
    """At dp=1 nothing is exchanged, so nothing is compressed: m is AdamW's own momentum (the old code quantized it)."""
    shapes = [(300,)]
    params = [torch.nn.Parameter(torch.zeros(300))]
    sync = QAdamSync(DPGroup(None, (0,), 0), bits=2, warmup_steps=2)
    opt = QuantizedAdam(params, sync, lr=0.01)
    expected = torch.zeros(300)
    for step in range(6):
        params[0].grad = grads_for(step, 0, shapes)[0]
        expected = expected * 0.9 + params[0].grad * 0.1
        sync.synchronize(params)
        if step == 2:
            frozen_v = opt.state[params[0]]["exp_avg_sq"].clone()
        opt.step()
    assert torch.equal(opt.state[params[0]]["exp_avg_sq"], frozen_v)
    assert torch.allclose(opt.state[params[0]]["exp_avg"], expected, atol=1e-6)
    assert sync.bytes_sent == 0 and sync.worker_feedback.residual is None


def _one_bit_residual(rank: int, world: int, bits: int, steps: int):
    """The worker error feedback's size relative to a constant momentum, step by step, at `bits` bits."""
    sync = QAdamSync(DPGroup(None, tuple(range(world)), rank), bits=bits, warmup_steps=1)
    momentum = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    ratios, contractive = [], True
    for _ in range(steps):
        given = momentum + (sync.worker_feedback.residual if sync.worker_feedback.residual is not None else 0)
        sync.average_momentum(momentum.clone())
        contractive &= float(sync.worker_feedback.residual.norm()) < float(given.norm())
        ratios.append(float(sync.worker_feedback.residual.norm() / momentum.norm()))
    return ratios, contractive


def test_one_bit_momentum_error_feedback_stays_bounded():
    """Each step's code keeps less error than it was given, so the residual stays bounded; with ±max|x| 1-bit codes it
    was 2.6 ||m|| after one step and 99 ||m|| after 200."""
    results = run_ranks(_one_bit_residual, 2, 1, 200)
    assert all(status == "ok" for status, _ in results), results
    for _, (ratios, contractive) in results:
        assert contractive and ratios[0] < 1.0 and ratios[-1] < 20.0


def _replica(rank: int, world: int):
    shapes = [(40, 30), (30,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    sync = QAdamSync(DPGroup(None, tuple(range(world)), rank), bits=8, warmup_steps=3)
    opt = QuantizedAdam(params, sync, lr=0.01)
    locals_ = []
    for step in range(6):
        for p, g in zip(params, grads_for(step, rank, shapes)):
            p.grad = g
        sync.synchronize(params)
        if sync.momentum_round:
            locals_.append(torch.cat([(opt.state[p]["exp_avg"] * 0.9 + p.grad * 0.1).reshape(-1) for p in params]))
        opt.step()
    momentum = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params])
    return [p.detach().clone() for p in params], locals_[-1], momentum, sync.bytes_sent


def test_replicas_share_the_compressed_mean_momentum_and_stay_identical():
    results = run_ranks(_replica, 3)
    assert all(status == "ok" for status, _ in results), results
    (params0, _, m0, _), *_ = [value for _, value in results]
    mean_local = torch.stack([value[1] for _, value in results]).mean(0)
    for _, (params, _, m, sent) in results:
        assert all(torch.equal(a, b) for a, b in zip(params, params0))
        assert torch.equal(m, m0)
        assert sent > 0
    assert float((m0 - mean_local).abs().max()) < 0.05 * float(mean_local.abs().max())


def _unbatched_in_momentum_rounds(rank: int, world: int) -> list[str]:
    unbatched = record_unbatched_point_to_point()
    _replica(rank, world)  # three warm-up steps, then three momentum rounds with their phase-1 exchange
    return list(unbatched)


def test_the_momentum_exchange_posts_every_point_to_point_op_in_one_batch():
    """Phase 1 (chunk j to replica j, every replica's copy of mine back) as separate isend/irecv calls can deadlock
    on NCCL; gloo does not, so the test records point-to-point calls made outside `batch_isend_irecv`."""
    results = run_ranks(_unbatched_in_momentum_rounds, 3)
    assert results == [("ok", [])] * 3


def test_error_feedback_survives_a_checkpoint_round_trip(tmp_path):
    sync = QAdamSync(DPGroup(None, (0,), 0), bits=3, warmup_steps=1)
    sync.worker_feedback.residual = torch.arange(6.0)
    sync.server_feedback.residual = -torch.arange(6.0)
    sync.calls = 9
    torch.save(sync.state_dict(), tmp_path / "q.pt")
    other = QAdamSync(DPGroup(None, (0,), 0), bits=3, warmup_steps=1)
    other.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    assert torch.equal(other.worker_feedback.residual, torch.arange(6.0))
    assert torch.equal(other.server_feedback.residual, -torch.arange(6.0)) and other.calls == 9


def test_freeze_comes_after_the_lr_warm_up_and_a_tenth_of_the_run():
    assert freeze_step(1000, 10) == 100
    assert freeze_step(100, 30) == 30
    assert freeze_step(3, 0) == 1


def _a_parameter_unused_on_one_replica(rank: int, world: int):
    """Replica 1 never gives the second parameter a gradient (a branch it did not take): after the warm-up the
    momentum exchange must still line up, so every replica treats the missing gradient as zeros."""
    shapes = [(20, 6), (6,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    sync = QAdamSync(DPGroup(None, tuple(range(world)), rank), bits=8, warmup_steps=2)
    opt = QuantizedAdam(params, sync, lr=0.01)
    for step in range(5):
        for p, g in zip(params, grads_for(step, rank, shapes)):
            p.grad = None if (rank == 1 and p is params[1]) else g
        sync.synchronize(params)
        opt.step()
    return [p.detach().clone() for p in params]


def test_a_parameter_without_a_gradient_on_one_replica_keeps_the_exchange_aligned():
    """The old momentum rounds left it out on that replica only: the replicas' momentum vectors differed in length
    and the exchange failed (or, under NCCL, hung)."""
    results = run_ranks(_a_parameter_unused_on_one_replica, 2)
    assert all(status == "ok" for status, _ in results), results
    replica0, replica1 = (value for _, value in results)
    assert all(torch.equal(a, b) for a, b in zip(replica0, replica1))  # and the replicas stay identical
    assert float(replica0[1].abs().sum()) > 0  # the parameter replica 0 trained moved on both


def test_a_run_resumed_after_the_freeze_steps_as_one_never_stopped(tmp_path):
    """The frozen second moment's bias correction survives a checkpoint exactly: torch's optimizer load casts every
    state tensor but `step` to its parameter's dtype, and the correction, kept as a float64 tensor, came back in
    float32. (The steps kept their bits even so — a float32 tensor divided by a Python float rounds it to float32 —
    but what a checkpoint restores is what the run had.)"""
    shapes = [(40,)]

    def make():
        params = [torch.nn.Parameter(torch.zeros(40))]
        sync = QAdamSync(DPGroup(None, (0,), 0), bits=4, warmup_steps=3)
        return params, sync, QuantizedAdam(params, sync, lr=0.01)

    def step(link, k):
        params, sync, opt = link
        params[0].grad = grads_for(k, 0, shapes)[0]
        sync.synchronize(params)
        opt.step()

    unbroken = make()
    for k in range(5):  # past the freeze (after step 3)
        step(unbroken, k)
    torch.save({"opt": unbroken[2].state_dict(), "sync": unbroken[1].state_dict(),
                "param": unbroken[0][0].detach().clone()}, tmp_path / "checkpoint.pt")
    correction = float(unbroken[2].state[unbroken[0][0]]["frozen_correction"])
    for k in range(5, 9):
        step(unbroken, k)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    resumed = make()
    with torch.no_grad():
        resumed[0][0].copy_(saved["param"])
    resumed[2].load_state_dict(saved["opt"])
    resumed[1].load_state_dict(saved["sync"])
    assert float(resumed[2].state[resumed[0][0]]["frozen_correction"]) == correction
    for k in range(5, 9):
        step(resumed, k)
    assert torch.equal(resumed[0][0], unbroken[0][0])
