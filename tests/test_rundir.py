"""A run directory holds one run: a launch into another run's directory is refused (or replaces it with
--overwrite), the same command typed again continues its run, a second launch into a running one gets exit 2 naming
the holder, and workers never read another run's config."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from aqpipe.config import ConfigError
from aqpipe.launch.rundir import LOCK_NAME, RunDirectory, lock_holder
from tests import warm
from tests.processes import finish, none_left, start_run, tagged_processes

QUICK = ["--pp", "2", "--seq-len", "16", "--max-samples", "64", "--eval-samples", "16", "--no-progress"]


def launch(*args, timeout=300) -> subprocess.CompletedProcess:
    return warm.run("launch", *args, timeout=timeout)


def snapshot(run) -> dict[str, bytes]:
    """Every file of a run directory and its bytes (the lock file aside)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and p.name != LOCK_NAME}


def test_a_launch_into_another_runs_directory_is_refused_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    first = launch(*QUICK, "--steps", "4", "--checkpoint-every", "1", "--out", str(run))
    assert first.returncode == 0, first.stderr[-2000:]
    before = snapshot(run)
    again = launch(*QUICK, "--steps", "6", "--checkpoint-every", "2", "--seed", "1", "--out", str(run))
    assert again.returncode == 2
    assert again.stderr.strip().count("\n") == 0  # one line
    assert "holds another run" in again.stderr and "seed = 0, this run has 1" in again.stderr
    assert "--resume" in again.stderr and "--overwrite" in again.stderr
    assert snapshot(run) == before

    replaced = launch(*QUICK, "--steps", "2", "--seed", "1", "--overwrite", "--out", str(run))
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    steps = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert steps == ["step-00000002"]  # the old run's step-3/step-4 went with it, the new run's own stayed
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert json.loads((run / "config.json").read_text())["seed"] == 1


def test_the_same_command_typed_again_continues_the_run_from_its_newest_checkpoint(tmp_path):
    """A launch into a directory holding the same run continues it, as --resume does (under torchrun too, not from
    step 1 over it): every step recorded once, the checkpoints before it kept."""
    run = tmp_path / "run"
    first = launch(*QUICK, "--steps", "4", "--checkpoint-every", "2", "--out", str(run))
    assert first.returncode == 0, first.stderr[-2000:]
    kept = ck_bytes(run, 4)
    again = launch(*QUICK, "--steps", "6", "--checkpoint-every", "2", "--out", str(run))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "holds this run: it continues after step 4" in again.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["restarts"] == 1
    assert ck_bytes(run, 4) == kept  # (trained from it, not over it)


def test_a_run_whose_log_was_lost_gets_it_back_from_rank_0s_checkpoint_part(tmp_path):
    """Rank 0's host lost metrics.jsonl and restarts.jsonl (a new machine in its place holds only the checkpoint
    part fetched from a copy): the run continues with every step recorded once and every restart counted, from the
    log rank 0's part carries. (Not a log restarted at the checkpoint: steps 7–8 alone, one restart.)"""
    run = tmp_path / "run"
    for steps in (4, 6):
        done = launch(*QUICK, "--steps", str(steps), "--checkpoint-every", "2", "--out", str(run))
        assert done.returncode == 0, done.stderr[-2000:]
    (run / "metrics.jsonl").unlink()
    (run / "restarts.jsonl").unlink()
    again = launch(*QUICK, "--steps", "8", "--checkpoint-every", "2", "--out", str(run))
    assert again.returncode == 0, again.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert json.loads((run / "summary.json").read_text())["restarts"] == 2


def test_a_part_without_its_m_xi_resumes_and_the_samples_are_re_seeded_on_both_sides(tmp_path):
    """An in-memory m(ξ) is kept in a file of its own that no copy carries: a rank whose part came from a copy (here:
    its store file gone) resumes with an empty store, and the samples are re-seeded on both sides of its links —
    counted, and with both copies identical again (every AQ-SGD message is checked against m(ξ)'s checksum; a
    mismatch would stop the run); such a part is not refused for having no m(xi) store."""
    run = tmp_path / "run"
    args = (*QUICK, "--pp", "3", "--fw", "aqsgd:4", "--warmup-epochs", "0", "--checkpoint-every", "2", "--out", str(run))
    first = launch(*args, "--steps", "4")
    assert first.returncode == 0, first.stderr[-2000:]
    step4 = run / "checkpoints" / "step-00000004"
    assert sorted(p.name for p in step4.glob("rank-1*")) == ["rank-1.pt", "rank-1.sha256", "rank-1.store.pt",
                                                             "rank-1.store.sha256"]
    before = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]["store_reseeded"]
    for name in ("rank-1.store.pt", "rank-1.store.sha256"):
        (step4 / name).unlink()
    again = launch(*args, "--steps", "6")
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["store"]["reseeded"] > before, summary["store"]


def test_a_start_that_would_train_over_a_newer_checkpoint_than_its_own_is_refused_and_changes_nothing(tmp_path):
    """The newest checkpoint lacks rank 1's part (a lost or restored disk): continuing from the older one would
    train over it, starting afresh over both. Refused with one line saying what to do."""
    run = tmp_path / "run"
    first = launch(*QUICK, "--steps", "4", "--checkpoint-every", "2", "--out", str(run))
    assert first.returncode == 0, first.stderr[-2000:]
    (run / "checkpoints" / "step-00000004" / "rank-1.pt").unlink()
    before = snapshot(run)
    again = launch(*QUICK, "--steps", "6", "--checkpoint-every", "2", "--out", str(run))
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0, again.stderr
    assert "the checkpoint of step 4 is complete, but rank 1" in again.stderr
    assert "or continue from step 2 with --resume" in again.stderr
    assert snapshot(run) == before


def test_the_same_command_over_its_run_without_a_checkpoint_starts_it_again_keeping_logs_and_count(tmp_path):
    """A run stopped before its first checkpoint: the same command starts it again from the first step, clearing
    its state but not its logs, and counts the restart."""
    run = tmp_path / "run"
    first = launch(*QUICK, "--steps", "2", "--out", str(run))
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(run / "checkpoints")
    (run / "summary.json").unlink()
    logged = [(run / "logs" / f"rank-{r}.log").stat().st_size for r in range(2)]
    again = launch(*QUICK, "--steps", "2", "--out", str(run))
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count("holds this run with no complete checkpoint yet: it starts again") == 1
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert all((run / "logs" / f"rank-{r}.log").stat().st_size > logged[r] for r in range(2))  # (appended to)
    assert json.loads((run / "summary.json").read_text())["restarts"] == 1


def test_a_directory_holding_run_files_but_no_config_json_is_refused_and_changes_nothing(tmp_path):
    """An export and a metrics log with no config.json beside them (which a launcher writes before any rank starts):
    not known to be this run's, so a launch into them is refused in one line and they stay. They are not taken for
    this run stopped before its first checkpoint, deleted, and trained over."""
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "model.safetensors").write_bytes(b"someone's weights")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    before = snapshot(run)
    proc = launch(*QUICK, "--steps", "1", "--out", str(run))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr[-2000:]
    assert (f"--out {run} holds another run (metrics.jsonl, export, without a config.json): choose another --out, or "
            "add --overwrite to delete it first") in proc.stderr  # (no --resume: no config.json, nothing to resume)
    assert snapshot(run) == before


def ck_bytes(run, step: int) -> bytes:
    return (run / "checkpoints" / f"step-{step:08d}" / "rank-0.pt").read_bytes()


def test_a_refused_launch_leaves_no_directory_behind(tmp_path):
    proc = launch(*QUICK, "--steps", "2", "--fw", "nonsense", "--out", str(tmp_path / "new"))
    assert proc.returncode == 2
    assert not (tmp_path / "new").exists()


def test_a_second_launch_into_a_running_directory_gets_exit_2_naming_the_holder(tmp_path):
    proc, tag = start_run(tmp_path)
    run = tmp_path / "run"
    config_before = (run / "config.json").read_bytes()
    try:
        second = launch(*QUICK, "--steps", "3", "--seed", "7", "--out", str(run))
        assert second.returncode == 2
        assert f"in use by another aqpipe launch (pid {proc.pid})" in second.stderr
        assert second.stderr.strip().count("\n") == 0
        overwrite = launch(*QUICK, "--steps", "3", "--overwrite", "--out", str(run))
        assert overwrite.returncode == 2 and f"pid {proc.pid}" in overwrite.stderr
        resume = launch("--resume", str(run), "--no-progress")
        assert resume.returncode == 2 and f"pid {proc.pid}" in resume.stderr
        assert (run / "config.json").read_bytes() == config_before
        assert proc.poll() is None  # the first run goes on
    finally:
        proc.terminate()
        finish(proc, timeout=60)
    assert none_left(tag)


def test_the_lock_dies_with_its_holder(tmp_path):
    """A killed launcher leaves no stale lock: the kernel drops it with the process."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from aqpipe.launch.rundir import RunDirectory; "
                               f"RunDirectory({str(tmp_path)!r}).claim(False, False); print('locked', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
        RunDirectory(tmp_path).claim(False, False)
    holder.kill()
    holder.wait()
    claim = RunDirectory(tmp_path)
    claim.claim(False, False)
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    claim.release()


def test_a_directory_in_use_is_refused_before_the_launch_imports_its_model(tmp_path):
    """The launch imports torch and the model code before it plans (seconds); a directory another launch holds is
    refused first, from the kernel's lock table, without taking the lock (a launch claiming it at that instant must
    not be refused in turn)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from aqpipe.launch.rundir import RunDirectory; "
                               f"RunDirectory({str(tmp_path)!r}).claim(False, False); print('locked', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert lock_holder(tmp_path / LOCK_NAME) == str(holder.pid)
        with pytest.raises(ConfigError, match=f"in use by another aqpipe launch \\(pid {holder.pid}\\)"):
            RunDirectory(tmp_path).precheck(resuming=False, overwrite=True)
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "aqpipe", "launch", "--steps", "1", "--out",
                               str(tmp_path)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and f"in use by another aqpipe launch (pid {holder.pid})" in proc.stderr
        assert "transformers" not in proc.stderr  # -X importtime lists every module imported
    finally:
        holder.kill()
        holder.wait()
    assert lock_holder(tmp_path / LOCK_NAME) is None
    RunDirectory(tmp_path).precheck(resuming=False, overwrite=False)  # free, and it holds no run
    claim = RunDirectory(tmp_path)
    claim.claim(False, False)  # the precheck left no lock behind
    claim.release()


def test_workers_take_their_configuration_from_the_launcher_not_from_the_run_directory(tmp_path, monkeypatch):
    """The rank reads the configuration its launcher handed it; a config.json rewritten meanwhile (another
    launch, an editor) changes nothing."""
    from aqpipe.config import RunConfig, resolve
    from aqpipe.launch import worker_entry
    from aqpipe.launch.env import CONFIG_ENV

    cfg = resolve(RunConfig(out=str(tmp_path), seed=3, device="cpu"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "seed": 99}))
    seen = {}
    monkeypatch.setenv(CONFIG_ENV, json.dumps(cfg.to_dict()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr("aqpipe.runtime.rank.train.run_worker", lambda c, *a, **k: seen.update(seed=c.seed))
    assert worker_entry.run_rank() == 0
    assert seen == {"seed": 3}


def test_a_local_launch_listens_on_loopback_only(tmp_path):
    proc, tag = start_run(tmp_path)
    try:
        pids = set(tagged_processes(tag))
        listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
        ours = [line for line in listening if any(f"pid={pid}," in line for pid in pids)]
        assert ours, listening  # the rendezvous store and gloo listen somewhere
        local = [line.split()[3] for line in ours]
        assert all(addr.startswith(("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:")) for addr in local), local
    finally:
        proc.terminate()
        finish(proc, timeout=60)
