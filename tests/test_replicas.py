"""The replicas of a stage compare parameter digests; a mismatch names the stage, the step and the replicas."""

import pytest
import torch

from aqpipe.runtime.rank.replicas import parameter_digest
from tests.distributed import run_ranks


def test_the_digest_sees_every_bit_and_every_name():
    a = torch.nn.Linear(3, 2)
    b = torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert parameter_digest(a) == parameter_digest(b)
    with torch.no_grad():
        b.weight[0, 0] = torch.nextafter(b.weight[0, 0], torch.tensor(10.0))  # one ulp
    assert parameter_digest(a) != parameter_digest(b)


def _check(rank: int, world: int, drift: bool):
    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.rank.replicas import ReplicaDivergence, check_replicas

    grid = Grid(2, world // 2, rank)
    torch.manual_seed(grid.stage)
    module = torch.nn.Linear(4, 4)
    if drift and grid.stage == 1 and grid.replica == 1:
        with torch.no_grad():
            module.bias[2] += 1e-6
    try:
        check_replicas(module, grid, 17, torch.device("cpu"))
    except ReplicaDivergence as e:
        return str(e)
    return None


@pytest.mark.parametrize("drift", [False, True])
def test_replicas_that_drift_apart_are_named(drift):
    results = run_ranks(_check, 4, drift)
    assert all(status == "ok" for status, _ in results), results
    messages = [value for _, value in results]
    if not drift:
        assert messages == [None] * 4
    else:  # ranks 1 and 3 hold stage 1 of replicas 0 and 1; stage 0's ranks stop too, rather than go on and wait
        # in the next collective for ranks that left (up to the 30-minute barrier after a checkpoint's writes)
        assert messages == ["the data-parallel replicas of stage 1 hold different parameters after step 17: "
                            "replica(s) 1 differ from replica 0"] * 4
