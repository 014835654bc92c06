"""All-reducible signSGD: the exact majority vote of the replicas' signs, at the paper's bits per element."""

import math

import pytest
import torch

from aqpipe.compress.bitpack import packed_bytes
from aqpipe.compress.grad import DPGroup
from aqpipe.compress.grad.ring import chunk_size
from aqpipe.compress.grad.signsgd import SignSGD, bits_per_element, count_bits, majority
from aqpipe.compress.grad.wire import ring_all_reduce_bytes
from tests.distributed import record_unbatched_point_to_point, run_ranks

SHAPES = [(13, 31), (701,), (5,)]


@pytest.mark.parametrize("hop, bits", [(1, 1), (2, 2), (3, 2), (4, 3), (7, 3), (8, 4), (15, 4), (16, 5)])
def test_a_count_over_hop_replicas_takes_ceil_log2_hop_plus_1_bits(hop, bits):
    assert count_bits(hop) == bits == math.ceil(math.log2(hop + 1))


def test_bits_per_element_follow_the_ring_formula():
    assert bits_per_element(2) == 1.0  # 1 bit of count + 1 bit of majority, each over half the vector
    assert bits_per_element(4) == (1 + 2 + 2 + 3) / 4
    assert bits_per_element(8) == (1 + 2 + 2 + 3 + 3 + 3 + 3 + 7) / 8


def test_majority_is_exact_away_from_ties_and_a_fair_coin_at_them():
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([0, 1, 3, 4], dtype=torch.uint8)
    assert majority(counts, 3, generator).tolist() == [0, 0, 1, 1]
    ties = majority(torch.full((40_000,), 2, dtype=torch.uint8), 4, generator).float()
    assert abs(ties.mean().item() - 0.5) < 4 * 0.5 / math.sqrt(40_000)


def _gradients(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _sync(rank: int, world: int):
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p, g in zip(params, _gradients(rank)):
        p.grad = g.clone()
    sync = SignSGD(DPGroup(None, tuple(range(world)), rank), seed=1)
    sync.synchronize(params)
    return [p.grad for p in params], sync.bytes_sent


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_result_is_the_exact_majority_of_every_replica(world):
    results = run_ranks(_sync, world)
    assert all(status == "ok" for status, _ in results), results
    votes = torch.stack([torch.cat([g.reshape(-1) for g in _gradients(r)]) > 0 for r in range(world)]).sum(0)
    expected = torch.where(2 * votes > world, 1.0, -1.0)
    tie = 2 * votes == world
    first = torch.cat([g.reshape(-1) for g in results[0][1][0]])
    assert set(first.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(first[~tie], expected[~tie])
    for _, (grads, _) in results[1:]:  # every replica applies the same update, ties included
        assert torch.equal(torch.cat([g.reshape(-1) for g in grads]), first)
    d = first.numel()
    c = chunk_size(d, world)
    wire = sum(packed_bytes(c, count_bits(i)) for i in range(1, world)) + (world - 1) * packed_bytes(c, 1)
    rows = ring_all_reduce_bytes(13 + 701 + 5, world)  # one byte per row agrees which rows are active
    for _, (_, sent) in results:
        assert sent == wire + rows
        assert abs(8 * wire / d - bits_per_element(world)) < 0.05 * bits_per_element(world) + 8 * world / d


def _unbatched_in_a_sync(rank: int, world: int) -> list[str]:
    unbatched = record_unbatched_point_to_point()
    _sync(rank, world)
    return list(unbatched)


@pytest.mark.parametrize("world", [2, 3])
def test_the_ring_posts_every_point_to_point_op_in_one_paired_batch(world):
    """NCCL deadlocks on an isend to the next member followed by a recv from the previous one (at dp=2 the same
    peer); gloo does not, so the test records point-to-point calls made outside `batch_isend_irecv`."""
    results = run_ranks(_unbatched_in_a_sync, world)
    assert results == [("ok", [])] * world


def _sync_with_unused_rows(rank: int, world: int, steps: int):
    """An embedding whose rows 0-9 no replica uses (gradient exactly 0), row 10 only replica 0 uses, and a parameter
    that gets no gradient at all; SGD with momentum 0.9 (weight decay would shrink any row, used or not)."""
    torch.manual_seed(0)
    embedding = torch.nn.Parameter(torch.randn(20, 4))
    unused = torch.nn.Parameter(torch.randn(3))
    start = [embedding.detach().clone(), unused.detach().clone()]
    sync = SignSGD(DPGroup(None, tuple(range(world)), rank), seed=1)
    optimizer = torch.optim.SGD([embedding, unused], lr=0.1, momentum=0.9)
    for step in range(steps):
        grad = torch.randn(20, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        grad[:10] = 0.0
        if rank != 0:
            grad[10] = 0.0
        embedding.grad, unused.grad = grad, None
        sync.synchronize([embedding, unused])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return start, [embedding.detach().clone(), unused.detach().clone()], sync.bytes_sent


def test_rows_zero_on_every_replica_and_parameters_without_a_gradient_do_not_move():
    """A zero gradient voted -1, so unused rows drifted by lr every step (about 10 lr with momentum 0.9)."""
    results = run_ranks(_sync_with_unused_rows, 2, 5)
    assert all(status == "ok" for status, _ in results), results
    (start, end, _), (_, other, _) = [value for _, value in results]
    assert torch.equal(end[0][:10], start[0][:10]) and torch.equal(end[1], start[1])
    assert not torch.equal(end[0][10], start[0][10])  # used by one replica: it votes
    assert all(torch.equal(a, b) for a, b in zip(end, other))


def test_one_replica_leaves_zero_rows_alone():
    params = [torch.nn.Parameter(torch.zeros(3, 2))]
    params[0].grad = torch.tensor([[0.5, -2.0], [0.0, 0.0], [3.0, 0.0]])
    SignSGD(DPGroup(None, (0,), 0)).synchronize(params)
    assert params[0].grad.tolist() == [[1.0, -1.0], [0.0, 0.0], [1.0, -1.0]]


def test_one_replica_still_takes_the_sign():
    params = [torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.tensor([0.5, -2.0, 3.0, -0.1])
    SignSGD(DPGroup(None, (0,), 0)).synchronize(params)
    assert params[0].grad.tolist() == [1.0, -1.0, 1.0, -1.0]
