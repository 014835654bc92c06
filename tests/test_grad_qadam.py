"""qadam:B — AdamW during the warm-up, then a frozen second moment and compressed momentum shared by all replicas."""

import torch

from aqpipe.compress.grad import DPGroup
from aqpipe.compress.grad.qadam import QAdamSync, QuantizedAdam, freeze_step
from tests.distributed import run_ranks


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


def test_after_the_warm_up_v_is_frozen_and_m_goes_through_the_quantizer():
    shapes = [(300,)]
    params = [torch.nn.Parameter(torch.zeros(300))]
    sync = QAdamSync(DPGroup(None, (0,), 0), bits=2, warmup_steps=2)
    opt = QuantizedAdam(params, sync, lr=0.01)
    for step in range(6):
        params[0].grad = grads_for(step, 0, shapes)[0]
        sync.synchronize(params)
        if step == 2:
            frozen_v = opt.state[params[0]]["exp_avg_sq"].clone()
        opt.step()
    assert torch.equal(opt.state[params[0]]["exp_avg_sq"], frozen_v)
    m = opt.state[params[0]]["exp_avg"]
    assert m.unique().numel() <= 4 * ((300 + 511) // 512)  # 2-bit codes: 4 levels per 512-value chunk
    assert sync.worker_feedback.residual is not None and float(sync.worker_feedback.residual.abs().sum()) > 0


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
