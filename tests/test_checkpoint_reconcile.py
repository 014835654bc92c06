"""After a restart both copies of every m(ξ) agree: differing or one-sided entries are dropped on both sides."""

import torch

from aqpipe.pipeline.world.grid import Grid
from aqpipe.runtime.checkpoints.reconcile import checksum, disagreeing, reconcile
from aqpipe.storage import MemoryStore
from tests.distributed import run_ranks


def test_disagreeing_ids_are_the_differing_and_the_one_sided():
    assert disagreeing({1: 10, 2: 20, 3: 30}, {1: 10, 2: 21, 4: 40}) == [2, 3, 4]
    assert disagreeing({}, {}) == []


def test_checksum_sees_one_bit():
    a = torch.zeros(4, 8, dtype=torch.float16)
    b = a.clone()
    b.view(torch.int16)[2, 3] ^= 1
    assert checksum(a) != checksum(b) and checksum(a) == checksum(a.clone())


def _three_stage_reconcile(rank, world):
    """Stage 0 sends on link 0 to stage 1, which sends on link 1 to stage 2; plant disagreements on both links."""
    import torch.distributed as dist

    grid = Grid(3, 1, rank)
    store = MemoryStore(torch.float16)
    value = lambda i: torch.full((2, 3), float(i), dtype=torch.float16)  # noqa: E731
    if rank == 0:
        store.put(0, "send", range(6), [value(i) for i in range(6)])
    if rank == 1:
        store.put(0, "recv", range(5), [value(i) if i != 2 else value(99) for i in range(5)])  # 2 differs, 5 missing
        store.put(1, "send", range(4), [value(i) for i in range(4)])
    if rank == 2:
        store.put(1, "recv", [0, 1, 2, 3, 7], [value(i) for i in (0, 1, 2, 3, 7)])  # 7 only here
    group = dist.new_group([0, 1, 2])
    deleted = reconcile(store, grid, group)
    return deleted, sorted(f"{l}/{s}/{i}" for (l, s, i), _ in store.items())


def test_reconcile_makes_both_sides_of_every_link_hold_the_same_samples():
    results = run_ranks(_three_stage_reconcile, 3)
    assert all(status == "ok" for status, _ in results), results
    (d0, keys0), (d1, keys1), (d2, keys2) = (value for _, value in results)
    assert keys0 == [f"0/send/{i}" for i in (0, 1, 3, 4)]
    assert keys1 == [f"0/recv/{i}" for i in (0, 1, 3, 4)] + [f"1/send/{i}" for i in (0, 1, 2, 3)]
    assert keys2 == [f"1/recv/{i}" for i in (0, 1, 2, 3)]
    assert (d0, d1, d2) == (2, 1, 1)  # sender of link 0 drops 2 and 5; its receiver 2; link 1's receiver 7
