"""A rank's checkpoints as one store (aqpipe.runtime.checkpoints.store): a checkpoint never waits for the previous
one's copies, the step being copied is never removed under them, the run's last checkpoint is copied all the same,
and rank 0's run log travels inside its part and comes back to a host that lost it."""

import json
from pathlib import Path

from aqpipe.runtime.checkpoints.restart import RESTARTS_FILE
from aqpipe.runtime.checkpoints.store import restored_records, run_log
from tests.distributed import run_ranks

SETTINGS = {"model": "llama-tiny", "seed": 0}


def _checkpoints_while_copies_travel(rank: int, world: int, root: str):
    import socket
    import time
    from types import SimpleNamespace

    import torch

    from aqpipe.config import RunConfig
    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.checkpoints import parts
    from aqpipe.runtime.checkpoints.store import Checkpoints

    socket.gethostname = lambda: f"host-{rank}"  # (one host each, as the copies see them)
    out = Path(root) / f"host-{rank}"
    cfg = SimpleNamespace(out=str(out), stall_timeout=30.0, fixed_settings=lambda: SETTINGS, checkpoint_replicas=None,
                          checkpoint_share=RunConfig.checkpoint_share)
    store = Checkpoints(cfg, Grid(world, 1, rank))
    state = {"model": {"w": torch.randn(250_000)}}  # 1 MB: ~4 s at the pace of a link nobody measured
    seconds = {}
    for step in (4, 8, 12):
        start = time.monotonic()
        store.save(step, lambda: state)
        seconds[step] = time.monotonic() - start
    busy_after_12 = store.copier.busy
    store.save(16, lambda: state, last=True)
    store.finish()
    names = {p.name: sorted(f.name for f in p.iterdir()) for p in sorted(parts.root(out).glob("step-*"))}
    return seconds, busy_after_12, names


def test_a_checkpoint_never_waits_for_copies_and_the_step_in_flight_stays(tmp_path):
    """Step 4's copies take seconds; the checkpoints of steps 8 and 12 are written meanwhile without waiting, marked
    COPYING and never copied (every rank alike); step 4 stays on disk though KEEP would remove it, until its copies
    are kept; the run's last checkpoint (16) waits for them and is copied."""
    results = run_ranks(_checkpoints_while_copies_travel, 2, str(tmp_path))
    for rank, (status, value) in enumerate(results):
        assert status == "ok", value
        seconds, busy_after_12, names = value
        other = 1 - rank
        assert busy_after_12 and seconds[8] < 2.0 and seconds[12] < 2.0, seconds
        own = [f"rank-{rank}.pt", f"rank-{rank}.sha256"]
        copy = [f"rank-{other}.pt", f"rank-{other}.sha256"]
        assert names["step-00000004"] == sorted(["COMPLETE", "COPYING", "REPLICATED", "run.json", *own, *copy])
        assert names["step-00000012"] == sorted(["COMPLETE", "COPYING", "run.json", *own])
        assert names["step-00000016"] == sorted(["COMPLETE", "COPYING", "REPLICATED", "run.json", *own, *copy])
        assert "step-00000008" not in names  # (older than the newest two and not the newest copied one)


def test_rank_0s_run_log_comes_back_to_a_host_that_lost_it(tmp_path):
    records = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3, 4)]
    (tmp_path / RESTARTS_FILE).write_text('{"from_step": 2}\n')
    saved = run_log(tmp_path, records)
    # the host lost its disk: the restart it is in now has written the only line there
    (tmp_path / RESTARTS_FILE).write_text('{"from_step": 4}\n')
    assert restored_records(tmp_path, saved, 4, []) == records
    assert (tmp_path / RESTARTS_FILE).read_text() == '{"from_step": 2}\n{"from_step": 4}\n'
    # a host that kept its log keeps its own records (and its restarts are not repeated)
    assert restored_records(tmp_path, saved, 4, records[:4]) == records
    assert restored_records(tmp_path, saved, 3, records[:3]) == records[:3]
    assert (tmp_path / RESTARTS_FILE).read_text() == '{"from_step": 2}\n{"from_step": 4}\n'
    # a part written before the log travelled in it
    assert restored_records(tmp_path, None, 3, records[:2]) == records[:2]
    assert json.loads(saved["metrics"].splitlines()[0]) == records[0]
