"""All-reducible signSGD: the exact majority vote of the replicas' signs, at the paper's bits per element."""

import math

import pytest
import torch

from aqpipe.compress.bitpack import packed_bytes
from aqpipe.compress.grad import DPGroup
from aqpipe.compress.grad.ring import chunk_size
from aqpipe.compress.grad.signsgd import SignSGD, bits_per_element, count_bits, majority
from tests.distributed import run_ranks

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
    for _, (_, sent) in results:
        assert sent == wire
        assert abs(8 * sent / d - bits_per_element(world)) < 0.05 * bits_per_element(world) + 8 * world / d


def test_one_replica_still_takes_the_sign():
    params = [torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.tensor([0.5, -2.0, 3.0, -0.1])
    SignSGD(DPGroup(None, (0,), 0)).synchronize(params)
    assert params[0].grad.tolist() == [1.0, -1.0, 1.0, -1.0]
