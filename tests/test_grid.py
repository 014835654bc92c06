"""The rank grid: rank = replica·pp + stage."""

import pytest

from aqpipe.pipeline.world.grid import Grid
from aqpipe.storage.base import stage_holding


def test_rank_layout_and_neighbours():
    pp, dp = 3, 2
    for rank in range(pp * dp):
        g = Grid(pp, dp, rank)
        assert g.rank_of(g.stage, g.replica) == rank
        assert g.rank in g.pipeline_ranks(g.replica) and g.rank in g.dp_ranks(g.stage)
        assert g.prev_rank == (None if g.stage == 0 else rank - 1)
        assert g.next_rank == (None if g.stage == pp - 1 else rank + 1)
    assert Grid(pp, dp, 0).dp_ranks(1) == [1, 4]
    assert Grid(pp, dp, 0).pipeline_ranks(1) == [3, 4, 5]
    assert Grid(pp, dp, 4).describe() == "rank 4 (stage 1, replica 1)"


def test_each_side_of_each_link_is_owned_by_exactly_the_stage_holding_it():
    pp = 4
    owners: dict[tuple[int, str], list[int]] = {}
    for stage in range(pp):
        g = Grid(pp, 1, stage)
        assert (g.link_in, g.link_out) == (None if stage == 0 else stage - 1, None if stage == pp - 1 else stage)
        for pair in g.owned_sides():
            owners.setdefault(pair, []).append(stage)
    assert owners == {(link, side): [stage_holding(link, side)] for link in range(pp - 1) for side in ("send", "recv")}
    assert (stage_holding(2, "send"), stage_holding(2, "recv")) == (2, 3)
    with pytest.raises(ValueError, match="side must be one of"):
        stage_holding(0, "sender")


@pytest.mark.parametrize("pp,dp,rank", [(0, 1, 0), (2, 0, 0), (2, 2, 4), (2, 2, -1)])
def test_invalid_grids_are_rejected(pp, dp, rank):
    with pytest.raises(ValueError):
        Grid(pp, dp, rank)


def test_ranks_share_gpus_round_robin(monkeypatch):
    """A rank computes on GPU local rank mod the GPUs its host shows."""
    import torch

    from aqpipe.pipeline.world.grid import rank_device

    assert rank_device("cpu", 3) == torch.device("cpu")
    for gpus, local_world in ((1, 4), (2, 4), (4, 4), (8, 4)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        assert [rank_device("cuda", r).index for r in range(local_world)] == [r % gpus for r in range(local_world)]
