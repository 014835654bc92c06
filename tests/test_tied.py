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
    from aqpipe.pipeline.numerics.tied import TiedGroup
    from aqpipe.pipeline.world.grid import Grid

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
    from aqpipe.pipeline.numerics.tied import TiedGroup
    from aqpipe.pipeline.world.grid import Grid

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


def _replicas_reduce_in_orders_of_their_own(rank: int, world: int):
    """pp=3, dp=2: each stage holds a copy of a tied table, whose gradient the sync leaves one value a stage (as
    top-k may leave two copies differently), equal across replicas, with a float32 sum over the stages that depends
    on the order its terms are added in; and a plain weight whose squared norms' float64 sum does too. The backend is made to add a group's terms in an order of the replica's
    own — replica 1 in reverse — as NCCL may (it picks its algorithm and ring per communicator, from each one's
    topology). Returns this rank's stage, replica, table after one step, the step's gradient norm and the tied bytes
    it sent."""
    import torch.distributed as dist

    from aqpipe.pipeline.numerics.tied import TiedGroup
    from aqpipe.pipeline.world.grid import Grid

    grid = Grid(3, 2, rank)
    original = dist.all_reduce

    def reduce_in_own_order(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.SUM or dist.get_world_size(group) < 3:  # (two terms add alike in either order)
            return original(tensor, op=op, group=group, async_op=async_op)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        total = torch.zeros_like(tensor)
        for part in (reversed(parts) if grid.replica == 1 else parts):
            total += part
        tensor.copy_(total)

    dist.all_reduce = reduce_in_own_order

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.copy = Copy()
            self.weight = nn.Parameter(torch.zeros(1))

    module = Stage()
    module.copy.table.grad = torch.zeros(4, 3)
    module.weight.grad = torch.tensor([[1.0, 1.0, 1e8][grid.stage]])  # squares in float64: (1 + 1) + 1e16 ≠ (1e16 + 1) + 1

    def before_sync(params):  # float32: (1 + 1e8) - 1e8 = 0, but (-1e8 + 1e8) + 1 = 1
        module.copy.table.grad.fill_([1.0, 1e8, -1e8][grid.stage])

    from aqpipe.pipeline.world import comm

    before = comm.TRAFFIC.snapshot()[comm.TIED]
    stats = worker_step(grid, module, "none", tied=[TiedGroup("table", ((4, 3),), 3)], before_sync=before_sync)
    return (grid.stage, grid.replica, module.copy.table.detach().clone(), stats.grad_norm,
            comm.TRAFFIC.snapshot()[comm.TIED] - before)


def test_replicas_keep_one_tied_table_and_one_norm_whatever_order_the_backend_adds_a_pipelines_terms_in():
    """The copies re-agree after the sync on the mean of their gradients, a sum over the pipeline's stages: each
    replica must add its terms in the same order, or the replicas' tables part in their last bits (and the digest
    check at the next checkpoint ends the run). The clip's norm is such a sum too: every replica must clip on the
    same number (a last bit apart rarely reaches the float32 coefficient — no case in 2 million random ones — but
    the replicas then report different norms)."""
    from aqpipe.pipeline.numerics.tied import TiedGroup, added_in_order
    from aqpipe.runtime.capacity.plan import dense_tied_bytes

    results = run_ranks(_replicas_reduce_in_orders_of_their_own, 6)
    assert all(status == "ok" for status, _ in results), results
    tables: dict[int, list] = {}
    for _, (stage, replica, table, _, _) in results:
        tables.setdefault(stage, []).append(table)
    assert all(len(pair) == 2 and torch.equal(*pair) for pair in tables.values()), tables
    norms = {value[3] for _, value in results}
    assert len(norms) == 1, norms
    # each rank sent a ring all-reduce of the 48-byte table (2·2/3 of it) and an all-gather (twice it), as planned
    sent = [value[4] for _, value in results]
    assert sent == [64 + 96] * 6 and dense_tied_bytes(48, 3, 2, added_in_order(TiedGroup("table", ((4, 3),), 3))) == 3 * 160
