"""The run plan's estimates: what an m(ξ) store takes on its medium per byte of its values."""

import pytest

from aqpipe.config import RunConfig, resolve
from aqpipe.runtime.checkpoints.parts import KEEP
from aqpipe.runtime.plan import STORE_HEADROOM, store_headroom

SAMPLES = 64  # per replica: 16 steps an epoch at 2 x 2 samples a step


def headroom(**settings) -> float:
    cfg = resolve(RunConfig(model="gpt2-tiny", micro_batch_size=2, micro_batches=2, device="cpu", **settings))
    return store_headroom(cfg, SAMPLES)


def test_a_store_in_memory_takes_its_values_alone():
    assert headroom(store="memory", checkpoint_every=4) == 1.0


@pytest.mark.parametrize("every,journaled", [(None, 0.0), (4, 0.25), (8, 0.5), (16, 1.0), (40, 1.0)])
def test_an_on_disk_store_counts_a_journal_per_checkpoint_a_resume_can_start_from(every, journaled):
    """Each rewind journal holds the values written in its checkpoint interval: a quarter of the store for a
    checkpoint every quarter epoch, at most the whole store; the checkpoints kept, the newest copied, one being copied
    and the one trained past have one each, and a run checkpointed only at its end none worth counting."""
    want = STORE_HEADROOM * (1 + (KEEP + 3) * journaled)
    assert headroom(store="lmdb", checkpoint_every=every) == pytest.approx(want)
