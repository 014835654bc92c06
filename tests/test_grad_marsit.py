"""Marsit: unbiased 1-bit aggregation on a ring, global compensation, and the K-periodic full-precision round."""

import math

import pytest
import torch

from aqpipe.compress.grad import DPGroup
from aqpipe.compress.grad.marsit import Marsit, fold
from tests.distributed import run_ranks


@pytest.mark.parametrize("bits", [[1, 0], [0, 1, 1], [1, 0, 0, 0], [0, 1, 0, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 1, 1, 1]])
def test_folded_bit_is_one_with_the_fraction_of_replicas_whose_bit_is_one(bits):
    n, coords = len(bits), 200_000
    generator = torch.Generator().manual_seed(len(bits))
    v = torch.full((coords,), bits[0], dtype=torch.uint8)
    for m, b in enumerate(bits[1:], start=2):
        v = fold(v, torch.full((coords,), b, dtype=torch.uint8), m, generator)
    p = sum(bits) / n
    sigma = math.sqrt(p * (1 - p) / coords)
    assert abs(v.float().mean().item() - p) <= 5 * sigma + 1e-9


def test_fold_keeps_agreeing_bits():
    generator = torch.Generator().manual_seed(0)
    a = torch.tensor([0, 1, 0, 1], dtype=torch.uint8)
    assert fold(a, a, 5, generator).tolist() == a.tolist()


PATTERN = [0.3, -0.2, -0.5, 0.7]  # replica r's gradient sign pattern per block of coordinates


def _ring_mean_bits(rank: int, world: int):
    """Replica r has gradient +1 on a coordinate iff the coordinate's pattern bit for r is 1."""
    coords = 40_000
    patterns = torch.tensor([[(j >> r) & 1 for r in range(world)] for j in range(1 << world)], dtype=torch.float32)
    mine = patterns[:, rank].repeat_interleave(coords // (1 << world)) * 2 - 1
    param = torch.nn.Parameter(torch.zeros(mine.numel()))
    param.grad = mine.clone()
    sync = Marsit(DPGroup(None, tuple(range(world)), rank), period=0, seed=3)
    sync.synchronize([param])
    bits = (param.grad > 0).float().view(1 << world, -1)
    return bits.mean(dim=1), patterns.mean(dim=1)


def test_ring_aggregation_is_unbiased_across_replicas():
    results = run_ranks(_ring_mean_bits, 4)
    assert all(status == "ok" for status, _ in results), results
    got, want = results[0][1]
    per_pattern = 40_000 // 16
    for g, w in zip(got.tolist(), want.tolist()):
        sigma = math.sqrt(max(w * (1 - w), 1e-12) / per_pattern)
        assert abs(g - w) <= 5 * sigma + 1e-9, (g, w)


def _steps(rank: int, world: int, period: int, steps: int):
    generator = torch.Generator().manual_seed(10 + rank)
    params = [torch.nn.Parameter(torch.zeros(6, 5)), torch.nn.Parameter(torch.zeros(7))]
    sync = Marsit(DPGroup(None, tuple(range(world)), rank), period=period, seed=0)
    log = []
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        before = sync.compensation.clone() if sync.compensation is not None else torch.zeros(37)
        full = sync.full_precision_now()
        sync.synchronize(params)
        u = torch.cat([g.reshape(-1) for g in grads]) + before
        out = torch.cat([p.grad.reshape(-1) for p in params])
        log.append((full, u, out, sync.compensation.clone()))
    return log


def test_compensation_and_the_periodic_full_precision_round_follow_algorithm_1():
    results = run_ranks(_steps, 2, 3, 7)
    assert all(status == "ok" for status, _ in results), results
    logs = [log for _, log in results]
    assert [full for full, *_ in logs[0]] == [True, False, False, True, False, False, True]
    for t, entries in enumerate(zip(*logs)):
        full = entries[0][0]
        outs = [out for _, _, out, _ in entries]
        assert torch.equal(outs[0], outs[1])  # every replica applies the same g_t
        if full:  # line 14-15: the average of u, and c reset to 0
            assert torch.allclose(outs[0], (entries[0][1] + entries[1][1]) / 2, atol=1e-6)
            assert all(float(c.abs().max()) == 0 for *_, c in entries)
        else:  # line 10-11: g_t = eta_s * sign, and c = u - g_t
            for _, u, out, c in entries:
                assert torch.allclose(c, u - out, atol=1e-6)
            eta = [outs[0][:30].abs().unique(), outs[0][30:].abs().unique()]
            assert all(e.numel() == 1 for e in eta)  # one step size per tensor
            mean_abs = sum(e[1][:30].abs().mean() for e in entries) / 2
            assert torch.allclose(eta[0], mean_abs.reshape(1), atol=1e-6)


def test_k_zero_never_runs_a_full_precision_round():
    sync = Marsit(DPGroup(None, (0,), 0), period=0)
    rounds = []
    for calls in range(50):
        sync.calls = calls
        rounds.append(sync.full_precision_now())
    assert not any(rounds)


def test_state_survives_a_checkpoint_round_trip(tmp_path):
    def make():
        sync = Marsit(DPGroup(None, (0,), 0), period=4, seed=5)
        return sync, [torch.nn.Parameter(torch.zeros(50))]

    def step(sync, params, seed):
        params[0].grad = torch.randn(50, generator=torch.Generator().manual_seed(seed))
        sync.synchronize(params)
        return params[0].grad.clone()

    a, pa = make()
    for s in range(3):
        step(a, pa, s)
    torch.save(a.state_dict(), tmp_path / "m.pt")
    b, pb = make()
    b.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    assert torch.equal(a.compensation, b.compensation) and b.calls == 3
    assert torch.equal(step(a, pa, 9), step(b, pb, 9))


def test_compensation_is_kept_in_update_units_across_a_learning_rate_change():
    """Algorithm 2 hands Marsit η_l·g: u = η_l·g + c, the parameter moves by exactly η_s·sign(u), c = u − that. The
    compensation lives in parameter units, so a learning-rate schedule does not rescale old compensation."""
    sync = Marsit(DPGroup(None, (0,), 0), period=0)
    param = torch.nn.Parameter(torch.zeros(6))
    compensation = torch.zeros(6)
    for step, lr in enumerate([0.5, 0.25, 0.1]):
        g = torch.randn(6, generator=torch.Generator().manual_seed(step))
        param.grad = g.clone()
        sync.lr = lr
        sync.synchronize([param])
        u = lr * g + compensation
        applied = u.abs().mean() * torch.where(u > 0, 1.0, -1.0)
        assert torch.allclose(param.grad * lr, applied, atol=1e-6)  # SGD's lr·grad is exactly the Marsit update
        compensation = u - applied
        assert torch.allclose(sync.compensation, compensation, atol=1e-6)


def _unused_rows(rank: int, world: int, steps: int):
    torch.manual_seed(0)
    embedding = torch.nn.Parameter(torch.randn(12, 3))
    start = embedding.detach().clone()
    sync = Marsit(DPGroup(None, tuple(range(world)), rank), period=4, seed=2)
    optimizer = torch.optim.SGD([embedding], lr=0.1)
    for step in range(steps):
        grad = torch.randn(12, 3, generator=torch.Generator().manual_seed(10 * step + rank))
        grad[:5] = 0.0
        embedding.grad = grad
        sync.lr = 0.1
        sync.synchronize([embedding])
        optimizer.step()
    return start, embedding.detach().clone()


def test_rows_zero_on_every_replica_do_not_move():
    results = run_ranks(_unused_rows, 2, 6)
    assert all(status == "ok" for status, _ in results), results
    (start, end), (_, other) = [value for _, value in results]
    assert torch.equal(end[:5], start[:5]) and not torch.equal(end[5:], start[5:]) and torch.equal(end, other)
