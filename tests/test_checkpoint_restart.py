"""Where a start over a run directory begins (aqpipe.runtime.checkpoints.restart): a restart continues this run from its newest
checkpoint complete everywhere, starts it again where it completed none, and never trains over another run's state
or over a checkpoint newer than the one it would start from."""

import json
import re
from pathlib import Path

import pytest
import torch

from aqpipe.runtime.checkpoints import parts as ck
from aqpipe.runtime.checkpoints.parts import CheckpointError
from aqpipe.runtime.checkpoints.restart import Holding, choose_start, clear_run_state, holding, record_restart, restarts
from tests.distributed import run_ranks

SETTINGS = {"model": "gpt2-tiny", "seq_len": 16, "seed": 0, "stage_bounds": [0, 3, 6]}


def _save(run: Path, step: int, ranks=(0, 1), mark: bool = True, settings: dict = SETTINGS) -> None:
    for rank in ranks:
        ck.save_rank(run, step, rank, {"model": {"w": torch.full((4,), float(10 * step + rank))}}, settings)
    if mark:
        ck.mark_complete(run, step, 2, settings)


def _holdings(*runs: Path, settings: dict = SETTINGS) -> list[Holding]:
    """Rank r's holding of run directory runs[r] (one host each)."""
    return [holding(run, rank, settings) for rank, run in enumerate(runs)]


def test_an_empty_directory_starts_afresh(tmp_path):
    start = choose_start(_holdings(tmp_path / "a", tmp_path / "b"), tmp_path, explicit=False)
    assert start.fresh and not start.clear and start.note is None
    with pytest.raises(CheckpointError, match="no run there"):
        choose_start(_holdings(tmp_path / "a", tmp_path / "b"), tmp_path, explicit=True)


def test_this_runs_state_without_a_checkpoint_starts_again_and_is_cleared(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({**SETTINGS, "epochs": 3, "out": str(run)}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "store" / "rank-0.lmdb").mkdir(parents=True)
    _save(run, 2, mark=False)  # killed while writing its first checkpoint
    start = choose_start(_holdings(run, run), run, explicit=False)
    assert start.fresh and start.clear and "no complete checkpoint" in start.note
    assert sorted(clear_run_state(run)) == ["checkpoints", "config.json", "metrics.jsonl", "store"]
    assert sorted(p.name for p in run.iterdir()) == ["logs"]  # (a launcher's logs of every attempt are kept)


@pytest.mark.parametrize("where", ["config.json", "checkpoint"])
def test_another_runs_state_is_refused_naming_the_setting_that_differs(tmp_path, where):
    run = tmp_path / "run"
    other = {**SETTINGS, "seed": 1}
    if where == "config.json":
        run.mkdir()
        (run / "config.json").write_text(json.dumps(other))
    else:
        _save(run, 4, settings=other)
    for explicit in (False, True):
        with pytest.raises(CheckpointError, match=r"holds another run.*seed = 1, this run has 0.*--overwrite"):
            choose_start(_holdings(tmp_path / "empty", run), run, explicit=explicit)


def test_the_stage_boundaries_count_only_once_known(tmp_path):
    """A local launch compares before it has planned (its boundaries unknown: None); the ranks compare after."""
    _save(tmp_path, 4)
    unplanned = {**SETTINGS, "stage_bounds": None}
    assert holding(tmp_path, 0, unplanned).other_run is None
    assert "stage_bounds" in holding(tmp_path, 0, {**SETTINGS, "stage_bounds": [0, 2, 6]}).other_run


def test_a_restart_continues_from_the_newest_checkpoint_complete_everywhere(tmp_path):
    hosts = [tmp_path / "host-0", tmp_path / "host-1"]
    for step in (4, 8):
        _save(hosts[0], step, ranks=(0,))
        _save(hosts[1], step, ranks=(1,))
    start = choose_start(_holdings(*hosts), tmp_path, explicit=False)
    assert start.candidates == [8, 4] and start.strict and "continues after step 8" in start.note


def test_a_checkpoint_one_host_marked_counts_where_every_rank_holds_its_file(tmp_path):
    """Host 1 died after the barrier that follows every rank's write, before it marked step 8 complete: host 0's
    mark proves every file was written, and host 1's is there."""
    hosts = [tmp_path / "host-0", tmp_path / "host-1"]
    _save(hosts[0], 8, ranks=(0,))
    _save(hosts[1], 8, ranks=(1,), mark=False)
    assert choose_start(_holdings(*hosts), tmp_path, explicit=False).candidates == [8]


def test_a_newest_checkpoint_a_rank_no_longer_holds_is_never_trained_over(tmp_path):
    """Host 1 came back with an empty disk (or lost step 8): starting it from scratch, or from step 4, would train
    over host 0's newer checkpoint. Automatically: refused, naming the rank and what to do; `--resume` chooses."""
    hosts = [tmp_path / "host-0", tmp_path / "host-1"]
    for step in (4, 8):
        _save(hosts[0], step, ranks=(0,))
    for explicit in (False, True):
        with pytest.raises(CheckpointError, match=r"step 8 is complete, but rank 1 on \S+ no longer holds its part"):
            choose_start(_holdings(*hosts), tmp_path, explicit=explicit)
    _save(hosts[1], 4, ranks=(1,))
    with pytest.raises(CheckpointError, match=r"step 8 .* rank 1 .* or continue from step 4 with --resume"):
        choose_start(_holdings(*hosts), tmp_path, explicit=False)
    chosen = choose_start(_holdings(*hosts), tmp_path, explicit=True)
    assert chosen.candidates == [4] and not chosen.strict and "not held by rank 1" in chosen.note


def test_a_restart_past_a_lost_checkpoint_that_had_no_copies_says_what_is_trained_again(tmp_path):
    """Step 4's parts were copied to the other host (REPLICATED); step 8 came while copies travelled, so it was kept
    without copies (COPYING alone), and host 1 has since lost its part of it: the restart continues after step 4 and
    says that steps 5–8 are trained again, not only "continues after step 4"."""
    hosts = [tmp_path / "host-0", tmp_path / "host-1"]
    for host, rank in zip(hosts, (0, 1)):
        _save(host, 4, ranks=(0, 1))  # (its own part and the copy of the other's)
        for marker in ("COPYING", "REPLICATED"):
            (ck.step_dir(host, 4) / marker).write_bytes(b"")
    _save(hosts[0], 8, ranks=(0,))
    (ck.step_dir(hosts[0], 8) / "COPYING").write_bytes(b"")
    start = choose_start(_holdings(*hosts), tmp_path, explicit=False)
    assert start.candidates == [4] and start.strict
    assert re.search(r"continues after step 4.*step 8 had no copies on other hosts and rank 1 on \S+ no longer "
                     r"holds its part: steps 5–8 are trained again", start.note), start.note


def test_each_start_over_the_runs_own_state_is_counted(tmp_path):
    assert restarts(tmp_path) == 0
    record_restart(tmp_path, 8)
    record_restart(tmp_path, None)
    assert restarts(tmp_path) == 2
    assert [json.loads(line)["from_step"] for line in (tmp_path / "restarts.jsonl").read_text().splitlines()] == [8, 0]


def _agreed(rank: int, world: int, runs: list[str], explicit: bool):
    from aqpipe.runtime.checkpoints import resume

    return resume.agreed_step(runs[rank], rank, SETTINGS, explicit)


def test_the_ranks_refuse_together_when_the_newest_checkpoint_is_damaged_on_a_restart(tmp_path):
    """Automatically only the newest checkpoint is taken; damaged on one rank, every rank stops with the same line
    (and `--resume` continues from the older one, as it says)."""
    for step in (4, 8):
        _save(tmp_path, step)
    newest = ck.rank_file(ck.step_dir(tmp_path, 8), 1)
    newest.write_bytes(newest.read_bytes()[:-10])
    results = run_ranks(_agreed, 2, [str(tmp_path)] * 2, False)
    for status, text in results:
        assert status == "error" and "step 8 is damaged (rank 1 on" in text
        assert f"continue from step 4 with --resume {tmp_path}" in text  # (the run directory itself, to paste)
    assert [value for _, value in run_ranks(_agreed, 2, [str(tmp_path)] * 2, True)] == [4, 4]
    # the checkpoint passed over is set aside, never resumed from (an unreadable file may be a passing fault)
    assert sorted(p.name for p in ck.root(tmp_path).iterdir()) == ["latest", "step-00000004", "unsound-step-00000008"]
    assert (ck.root(tmp_path) / "latest").read_text().strip() == "step-00000004"


def test_the_ranks_clear_this_runs_state_without_a_checkpoint_on_every_host(tmp_path):
    hosts = [tmp_path / "host-0", tmp_path / "host-1"]
    for host in hosts:
        host.mkdir()
        (host / "config.json").write_text(json.dumps(SETTINGS))
        _save(host, 2, mark=False)
    results = run_ranks(_agreed, 2, [str(h) for h in hosts], False)
    assert [value for _, value in results] == [None, None], results
    assert [sorted(p.name for p in h.iterdir()) for h in hosts] == [["restarts.jsonl"], []]  # (rank 0's counts it)


def test_a_clear_cut_short_leaves_config_json_beside_the_state_that_remains(tmp_path, monkeypatch):
    """A start afresh clears the run's state; cut short (a kill, a failing disk) it must leave config.json while any
    of it remains: run files without their config.json are no run's to continue, and every later start would be
    refused (as an export found without its config.json is)."""
    import shutil

    from aqpipe.runtime.checkpoints import restart

    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        (out / name).write_text("{}\n")

    def cut_short(path, *args, **kwargs):
        raise OSError("cut short")

    monkeypatch.setattr(shutil, "rmtree", cut_short)
    with pytest.raises(OSError, match="cut short"):
        restart.clear_run_state(out)
    assert (out / "export").is_dir() and (out / "config.json").is_file()


def test_under_torchrun_another_runs_state_is_refused_without_advising_overwrite(tmp_path):
    """--overwrite is refused under torchrun (each restart would delete the run): the ranks' refusal of another run's
    state says what to do there instead."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**SETTINGS, "seed": 7}))
    holdings = [holding(run, rank, SETTINGS) for rank in range(2)]
    with pytest.raises(CheckpointError) as local:
        choose_start(holdings, run, explicit=False)
    assert str(local.value).endswith("or add --overwrite to delete it first")
    with pytest.raises(CheckpointError) as ranks:
        choose_start(holdings, run, explicit=False, local=False)
    assert "--overwrite" not in str(ranks.value)
    assert str(ranks.value).endswith("choose another --out, or delete it on every host first")
