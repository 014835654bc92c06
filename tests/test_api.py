"""The Python API started plainly (`python script.py`): the script checks the run, then its ranks are forks of one
more run of the script, which stopped at `aqpipe.train` with the ranks' modules imported (one import for all ranks,
not one each). Where that run cannot fork them soundly, or ends without reaching `aqpipe.train`, each rank runs the
script afresh, as the ranks of torchrun do (tests/test_forkserver.py)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, sys
sys.path.insert(0, {examples!r})
with open("executions.txt", "a") as f:  # one line each time the script runs, with the pid that ran it
    f.write(f"{{os.getpid()}}\\n")
import aqpipe
from custom_model import tiny_lm

if __name__ == "__main__":
    raise SystemExit(aqpipe.train(tiny_lm, pp=2, steps=2, seq_len=16, max_samples=32, eval_every=0, out="run"))
"""


def test_a_scripts_ranks_are_forks_of_one_run_of_it_that_reached_train(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(examples=str(ROOT / "examples")))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    assert json.loads((tmp_path / "run" / "config.json").read_text())["pp"] == 2
    executions = (tmp_path / "executions.txt").read_text().split()
    assert len(executions) == 2, executions  # the command itself, then the run its 2 ranks were forked from
    assert "start as fresh processes" not in proc.stderr


TWO_CALLS = """
import json, os, sys
sys.path.insert(0, {examples!r})
import aqpipe
from custom_model import tiny_lm


def factory(name, width):
    def build(vocab_size):
        config = json.loads(os.environ.get("AQPIPE_CONFIG_JSON", "{{}}"))
        if "RANK" in os.environ:  # a rank builds its stages: say which factory, for which run
            with open("built.txt", "a") as f:
                f.write(f"{{name}} {{os.path.basename(config.get('out', '?'))}}\\n")
        return tiny_lm(vocab_size, width)
    return build


if __name__ == "__main__":
    settings = dict(pp=2, steps=1, seq_len=16, max_samples=32, eval_every=0)
    first = aqpipe.train(factory("first", 32), out="run1", **settings)
    print("between the calls:", first)
    raise SystemExit(first or aqpipe.train(factory("second", 64), out="run2", **settings))
"""


def test_a_script_that_calls_train_twice_trains_each_calls_model_in_its_run(tmp_path):
    """Ranks run the script again to get its spec factory (here forked from one more run of it): those of the second
    call must get the second call's."""
    script = tmp_path / "script.py"
    script.write_text(TWO_CALLS.format(examples=str(ROOT / "examples")))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ranks start as fresh processes" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.splitlines().count("between the calls: 0") == 1, proc.stdout  # (the command's own line)
    built = sorted(set((tmp_path / "built.txt").read_text().splitlines()))
    assert built == ["first run1", "second run2"], built
    for run in ("run1", "run2"):
        assert json.loads((tmp_path / run / "summary.json").read_text())["steps"] == 1


def test_a_rank_running_the_script_afresh_trains_the_call_it_was_started_for(monkeypatch):
    """Where ranks run the script afresh (its run could not fork them), the launcher names the call in their
    environment (tests/test_forkserver.py): the calls before it and after it return 0 in the rank, untrained."""
    from aqpipe import api
    from aqpipe.launch import worker_entry
    from aqpipe.launch.env import CONFIG_ENV, TRAIN_CALL_ENV

    trained = []
    monkeypatch.setattr(worker_entry, "run_rank", lambda factory: trained.append(factory) or 7)
    monkeypatch.setattr(api, "_calls", 0)
    monkeypatch.setenv(CONFIG_ENV, "{}")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(TRAIN_CALL_ENV, "2")
    assert [api.train(factory) for factory in ("first", "second", "third")] == [0, 7, 0]
    assert trained == ["second"]
