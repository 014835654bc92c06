"""Resuming (aqpipe.runtime.checkpoints.resume): the ranks agree on the newest checkpoint complete and sound on every host, each
reading only its own host's files, and each reads its file as few times as that takes."""

from pathlib import Path

import pytest
import torch

from aqpipe.runtime.checkpoints import parts as ck
from tests.distributed import run_ranks

SETTINGS = {"model": "gpt2-tiny", "seq_len": 16}


def _save(run: Path, step: int, world: int = 2) -> None:
    for rank in range(world):
        ck.save_rank(run, step, rank, {"model": {"w": torch.full((4,), float(10 * step + rank))}}, SETTINGS)
    ck.mark_complete(run, step, world, SETTINGS)


def _load_counting_reads(rank: int, world: int, run: str, launcher_checked: bool = False):
    """On a rank: the step it resumes from, the value it loaded, and every checkpoint file it hashed."""
    from aqpipe.runtime.checkpoints import resume

    hashed: list[str] = []
    original = ck._sha256_of

    def counting(file):
        hashed.append(Path(file.name).relative_to(run).as_posix())
        return original(file)

    ck._sha256_of = counting
    step, state = resume.load_agreed(run, rank, SETTINGS, launcher_checked)
    return step, float(state["model"]["w"][0]), hashed


def test_each_rank_hashes_only_the_checkpoint_it_resumes_from_once(tmp_path):
    """Each rank checked every kept checkpoint of its own (two), then the one it resumed from once more as it loaded
    it: three reads of a state that may be gigabytes (an in-memory m(ξ) store) before the first step. Now one check
    of the newest, and the load trusts it."""
    for step in (4, 8):
        _save(tmp_path, step)
    results = run_ranks(_load_counting_reads, 2, str(tmp_path))
    for rank, (status, value) in enumerate(results):
        assert status == "ok", value
        step, loaded, hashed = value
        assert (step, loaded) == (8, 80.0 + rank)
        assert hashed == [f"checkpoints/step-00000008/rank-{rank}.pt"], hashed


def test_a_rank_whose_launcher_checked_the_newest_checkpoint_hashes_nothing(tmp_path):
    """`aqpipe launch` checks every rank's file of the newest checkpoint before it starts the ranks (and holds the run
    directory meanwhile): the ranks it starts load that one and read it once, as they load it."""
    for step in (4, 8):
        _save(tmp_path, step)
    results = run_ranks(_load_counting_reads, 2, str(tmp_path), True)
    assert [value for _, value in results] == [(8, 80.0, []), (8, 81.0, [])], results


@pytest.mark.parametrize("trouble", ["damaged", "missing", "incomplete"])
def test_the_ranks_fall_back_together_to_the_newest_checkpoint_sound_everywhere(tmp_path, trouble):
    """Rank 1's newest file damaged or missing, or the newest step never marked complete: every rank resumes from
    the older one."""
    for step in (4, 8):
        _save(tmp_path, step)
    newest = ck.rank_file(ck.step_dir(tmp_path, 8), 1)
    if trouble == "damaged":
        newest.write_bytes(newest.read_bytes()[:-10])
    elif trouble == "missing":
        newest.unlink()
    else:
        (ck.step_dir(tmp_path, 8) / "COMPLETE").unlink()
    results = run_ranks(_load_counting_reads, 2, str(tmp_path))
    for rank, (status, value) in enumerate(results):
        assert status == "ok", value
        step, loaded, hashed = value
        assert (step, loaded) == (4, 40.0 + rank)
        assert hashed[-1] == f"checkpoints/step-00000004/rank-{rank}.pt" and len(hashed) <= 2, hashed


def test_no_checkpoint_sound_on_every_host_is_an_error_naming_what_each_holds(tmp_path):
    _save(tmp_path, 4)
    damaged = ck.rank_file(ck.step_dir(tmp_path, 4), 0)
    damaged.write_bytes(b"not a checkpoint")
    results = run_ranks(_load_counting_reads, 2, str(tmp_path))
    for status, text in results:
        assert status == "error" and "no checkpoint is complete and sound on every host" in text, text
        assert "rank 0 on" in text and "4 (damaged)" in text, text


def test_a_rank_that_cannot_load_its_file_stops_every_rank_with_its_reason(tmp_path):
    """A file that passed its check but fails to load (damaged since the launcher hashed it) failed that rank alone;
    the others went on into the resume's collectives and waited there for the time-out."""
    _save(tmp_path, 4)
    victim = ck.rank_file(ck.step_dir(tmp_path, 4), 1)
    victim.write_bytes(victim.read_bytes()[:200])
    results = run_ranks(_load_counting_reads, 2, str(tmp_path), True)
    for status, text in results:
        assert status == "error" and "rank 1 cannot resume" in text and "rank-1.pt cannot be loaded" in text, text
