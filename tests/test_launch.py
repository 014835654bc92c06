"""The local launcher: failures end the run fast, naming the rank, and no process outlives it."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests import warm
from tests.processes import finish, none_left, start_run, tagged_processes


def test_killed_worker_ends_the_run_with_exit_1_naming_the_rank(tmp_path):
    proc, tag = start_run(tmp_path)
    victim = tagged_processes(tag, rank="1")
    assert len(victim) == 1
    os.kill(victim[0], signal.SIGKILL)
    code, err, seconds = finish(proc, timeout=60)
    assert code == 1
    assert seconds < 30
    assert "rank 1 (stage 1, replica 0) died: killed by signal SIGKILL" in err
    assert none_left(tag)


def test_stalled_worker_is_detected_and_everything_is_torn_down(tmp_path):
    proc, tag = start_run(tmp_path, "--stall-timeout", "6")
    victim = tagged_processes(tag, rank="2")
    os.kill(victim[0], signal.SIGSTOP)
    code, err, seconds = finish(proc, timeout=90)
    assert code == 1
    assert "rank 2 (stage 2, replica 0)" in err and ("stalled" in err or "within 6 s" in err)
    assert none_left(tag)


def test_sigint_stops_a_launcher_whose_parent_ignored_it(tmp_path):
    """A shell's background job (or nohup, or a CI runner) starts with SIGINT ignored, and Python keeps an inherited
    ignore; `kill -INT` must still stop the run and its ranks."""
    proc, tag = start_run(tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    proc.send_signal(signal.SIGINT)
    code, err, seconds = finish(proc, timeout=60)
    assert code == 1 and "interrupted" in err
    assert seconds < 30
    assert none_left(tag)


def test_workers_die_with_a_killed_launcher(tmp_path):
    proc, tag = start_run(tmp_path)
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 10
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tagged_processes(tag) == []


def _default_launch(tmp_path, *extra: str) -> tuple[Path, dict, list[dict]]:
    """`aqpipe launch` with nothing but `extra` given, in an empty directory: its run directory, summary and records."""
    proc = warm.run("launch", *extra, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = (tmp_path / "runs").iterdir()
    for name in ("config.json", "metrics.jsonl", "summary.json", "loss.png"):
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    required = {"step", "epoch", "loss", "lr", "samples_per_second", "fwd_bytes", "bwd_bytes", "grad_sync_bytes",
                "compute_seconds", "comm_wait_seconds"}
    assert required <= records[0].keys()
    assert {"final_loss", "steps", "epochs", "samples_per_second", "link_bytes", "grad_sync_bytes", "wall_seconds",
            "store"} <= summary.keys()
    assert summary["steps"] == len(records)
    config = json.loads((run / "config.json").read_text())
    assert config["pp"] == 4 and config["model"] == "gpt2-tiny" and config["stage_bounds"][-1] == 6
    return run, summary, records


def test_a_default_launch_cut_short_writes_the_run_directory_and_learns(tmp_path):
    """The embedded default (gpt2-tiny over 4 stages on the built-in corpus), stopped after 12 steps: every file
    of the run directory, and a loss already falling (8.33 to 7.47 here)."""
    _, summary, records = _default_launch(tmp_path, "--steps", "12")
    assert summary["steps"] == 12 and records[-1]["loss"] < records[0]["loss"] - 0.5


@pytest.mark.slow
def test_default_launch_completes_and_writes_the_run_directory(tmp_path):
    """`aqpipe launch` with no arguments: the embedded default, end to end (3 epochs, 1.5-3 minutes here)."""
    _, summary, records = _default_launch(tmp_path)
    assert summary["epochs"] == 3
    assert summary["final_loss"] < records[0]["loss"] - 2.0  # it learned something real


def test_an_interrupt_during_start_up_exits_1_with_one_line(tmp_path):
    """SIGTERM or Ctrl-C during start-up (torch loading, data preparation): exit 1, one line, no traceback."""
    import uuid

    for sig in (signal.SIGTERM, signal.SIGINT):
        tag = uuid.uuid4().hex
        proc = subprocess.Popen([sys.executable, "-m", "aqpipe", "launch", "--out", str(tmp_path / sig.name)],
                                env=dict(os.environ, AQPIPE_TEST_TAG=tag), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60  # start-up proper: aqpipe's code is loading torch (past interpreter start)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if "libtorch" in open(f"/proc/{proc.pid}/maps").read():
                    break
            except OSError:
                pass
            time.sleep(0.05)
        proc.send_signal(sig)
        code, err, _ = finish(proc, timeout=60)
        assert code == 1, (sig, code, err)
        assert "Traceback" not in err and "interrupted" in err
        assert len(err.strip().splitlines()) == 1, err
        assert none_left(tag)


def test_a_second_interrupt_during_cleanup_does_not_cut_it_short(tmp_path):
    proc, tag = start_run(tmp_path)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    code, err, seconds = finish(proc, timeout=60)
    assert code == 1 and "interrupted" in err and "Traceback" not in err, err
    assert none_left(tag)


def test_the_command_module_loads_without_torch():
    """`aqpipe` installs its Ctrl-C/SIGTERM handling in main(); anything the command module imports before that is
    start-up no signal handler covers, so it must not load torch (seconds on a small machine)."""
    probe = "import sys, aqpipe.cli; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_lossy_codec_that_never_leaves_the_fp32_warm_up_is_pointed_out():
    from aqpipe.config import RunConfig, resolve
    from aqpipe.launch.job import warmup_note
    from aqpipe.runtime.plan import RunPlan

    def note(cfg: RunConfig, total_steps: int, steps_per_epoch: int = 25):
        return warmup_note(RunPlan(resolve(cfg), None, None, [], steps_per_epoch, total_steps))

    lossy = RunConfig(fw="aqsgd:3", bw="directq:6", warmup_epochs=1)
    assert "never compress" in note(lossy, total_steps=25)
    assert "--fw aqsgd:3 --bw directq:6" in note(lossy, total_steps=10)
    assert note(lossy, total_steps=26) is None  # step 26 compresses
    assert note(RunConfig(fw="fp32", bw="fp32"), total_steps=5) is None
    assert note(RunConfig(fw="aqsgd:3", warmup_epochs=0), total_steps=5) is None


def test_max_restarts_restarts_every_rank_from_the_newest_checkpoint(tmp_path):
    """A rank killed mid-run: the launcher restarts every rank from the newest complete checkpoint, says so, and the
    run finishes with every step recorded once and the restart counted."""
    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "aqpipe", "launch", "--steps", "40", "--seq-len", "16",
                             "--max-samples", "64", "--eval-samples", "16", "--pp", "2", "--no-progress",
                             "--checkpoint-every", "2", "--max-restarts", "1", "--out", str(run)],
                            env=dict(os.environ, AQPIPE_TEST_TAG=tag), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not ((run / "checkpoints" / "latest").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    os.kill(tagged_processes(tag, rank="1")[0], signal.SIGKILL)
    code, err, _ = finish(proc, timeout=300)
    assert code == 0, err[-3000:]
    assert "rank 1 (stage 1, replica 0) died: killed by signal SIGKILL" in err
    assert re.search(r"; restart 1 of 1, every rank from the checkpoint of step \d+\n", err), err[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert json.loads((run / "summary.json").read_text())["restarts"] == 1
    assert none_left(tag)


def test_a_restart_rewinds_the_on_disk_stores_and_trains_as_if_nothing_failed(tmp_path):
    """m(ξ) on disk (LMDB) outlives a rank killed steps after a checkpoint in the second epoch, holding values written
    since (over the first epoch's) on both sides of its links. --max-restarts rewinds every rank's store to the
    checkpoint, so the run records the losses and exports the weights of a run that never failed, bit for bit (stores
    keeping the newer values would have the retrained steps send deltas against them, and the losses drift)."""
    from safetensors.torch import load_file

    common = ["--steps", "24", "--seq-len", "16", "--max-samples", "32", "--micro-batch-size", "2", "--micro-batches",
              "2", "--eval-every", "0", "--pp", "3", "--no-progress", "--store", "lmdb", "--checkpoint-every", "4"]
    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "aqpipe", "launch", *common, "--max-restarts", "1", "--out",
                             str(run)], env=dict(os.environ, AQPIPE_TEST_TAG=tag), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics, latest = run / "metrics.jsonl", run / "checkpoints" / "latest"

    def past_a_checkpoint_in_the_second_epoch() -> bool:  # (8 steps an epoch: values written over, not only new)
        checkpoint = int(latest.read_text().strip()[len("step-"):]) if latest.is_file() else 0
        return checkpoint >= 12 and metrics.read_text().count("\n") >= checkpoint + 2

    deadline = time.monotonic() + 120
    while not past_a_checkpoint_in_the_second_epoch():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    os.kill(tagged_processes(tag, rank="1")[0], signal.SIGKILL)
    code, err, _ = finish(proc, timeout=300)
    assert code == 0 and "restart 1 of 1" in err, err[-3000:]
    assert none_left(tag)
    reference = warm.run("launch", *common, "--out", str(tmp_path / "ref"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    losses = [[json.loads(line)["loss"] for line in (directory / "metrics.jsonl").read_text().splitlines()]
              for directory in (run, tmp_path / "ref")]
    assert losses[0] == losses[1]
    weights = [load_file(directory / "export" / "model.safetensors") for directory in (run, tmp_path / "ref")]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[1])
    verify = warm.run("store", "verify", str(run))
    assert verify.returncode == 0 and verify.stdout.startswith("0 mismatch(es)"), verify.stdout


def test_a_local_launch_refuses_copies_it_has_no_other_host_for():
    proc = warm.run("launch", "--pp", "2", "--steps", "2", "--checkpoint-replicas", "1", "--no-progress")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--checkpoint-replicas 1 keeps copies" in proc.stderr and "a local launch runs every rank on this one" \
        in proc.stderr
