"""Tied parameters under a compressing grad sync: the copies' gradients are summed before the sync sees them, and
the copies stay one tensor after it."""

import torch
from torch import nn

from tests.distributed import run_ranks, worker_step


class Copy(nn.Module):
    """A layer holding its own copy of a tied table (as each DeBERTa layer holds the relative-position table)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(4, 3))

    def tied_parameters(self) -> dict:
        return {"table": [self.table]}


def _step(rank: int, world: int, method: str):
    """One stage (pp=1) of `world` replicas whose module holds two copies of a tied table; run the worker's grad
    reduction and optimizer step with per-copy gradients that differ, and return both copies after the step."""
    from aqpipe.pipeline.grid import Grid
    from aqpipe.pipeline.tied import TiedGroup

    module = nn.Sequential(Copy(), Copy())
    generator = torch.Generator().manual_seed(rank)
    grads = [torch.randn(4, 3, generator=generator) for _ in range(2)]
    for layer, g in zip(module, grads):
        layer.table.grad = g.clone()
    worker_step(Grid(1, world, rank), module, method, tied=[TiedGroup("table", ((4, 3),), 2)])
    return grads, [layer.table.detach().clone() for layer in module]


def test_a_sign_sync_votes_on_the_summed_tied_gradient_once():
    """The sync ran before the copies were summed, so signSGD added one vote per copy (updates of 2, 0, -2)."""
    results = run_ranks(_step, 3, "signsgd")
    assert all(status == "ok" for status, _ in results), results
    summed = [sum(value[0]) for _, value in results]  # each replica's true gradient of the one tensor
    votes = sum((g > 0).int() for g in summed)
    expected = -torch.where(2 * votes > 3, 1.0, -1.0)  # lr 1, plain SGD: the parameter moves by -sign
    for _, (_, copies) in results:
        assert torch.equal(copies[0], copies[1]) and torch.equal(copies[0], expected)


def test_a_randomized_sync_leaves_the_copies_one_tensor():
    results = run_ranks(_step, 2, "marsit:0")
    assert all(status == "ok" for status, _ in results), results
    first = results[0][1][1][0]
    for _, (_, copies) in results:
        assert torch.equal(copies[0], copies[1]) and torch.equal(copies[0], first)


def _two_stages(rank: int, world: int):
    """pp=2: stage 0 holds both copies of a tied table, stage 1 (a custom stage) has no parameters at all; both run
    the grad reduction and the optimizer step; returns stage 0's copies (None on stage 1)."""
    from aqpipe.pipeline.grid import Grid
    from aqpipe.pipeline.tied import TiedGroup

    module = nn.Sequential(Copy(), Copy()) if rank == 0 else nn.Sequential(nn.ReLU())
    for k, layer in enumerate(module if rank == 0 else []):
        layer.table.grad = torch.full((4, 3), float(k + 1))
    worker_step(Grid(world, 1, rank), module, "none", clip=1e9, tied=[TiedGroup("table", ((4, 3),), 2)])
    return [layer.table.detach().clone() for layer in module] if rank == 0 else None


def test_a_stage_without_parameters_takes_part_in_the_tied_sum():
    """A custom stage with no parameters, in a model whose other stage holds tied copies, once died on
    `next(module.parameters())` (StopIteration) while picking the device for the tied sum."""
    results = run_ranks(_two_stages, 2)
    assert all(status == "ok" for status, _ in results), results
    copies = results[0][1]
    assert torch.equal(copies[0], torch.full((4, 3), -3.0)) and torch.equal(copies[1], copies[0])  # -(1 + 2)
