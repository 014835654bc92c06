"""The Python API started plainly (`python script.py`): the script checks the run, then its ranks are forks of one
more run of the script, which stopped at `aqpipe.train` with the ranks' modules imported (one import for all ranks,
not one each). Where that run cannot fork them soundly, or ends without reaching `aqpipe.train`, each rank runs the
script afresh, as the ranks of torchrun do (tests/test_forkserver.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


# In the run of the script that is to fork the ranks, a thread: a fork of it would not be sound.
THREAD_IN_THE_SERVER_RUN = """
if "AQPIPE_SCRIPT_SERVER" in os.environ:
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
"""

TWO_CALLS = """
import json, os, sys, threading, time
{thread}
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


@pytest.mark.parametrize("thread", ["", THREAD_IN_THE_SERVER_RUN], ids=["forked", "afresh"])
def test_a_script_that_calls_train_twice_trains_each_calls_model_in_its_run(tmp_path, thread):
    """Ranks run the script again to get its spec factory (forked from one more run of it, or each running it
    afresh): those of the second call must get the second call's."""
    script = tmp_path / "script.py"
    script.write_text(TWO_CALLS.format(examples=str(ROOT / "examples"), thread=thread))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("ranks start as fresh processes" in proc.stderr) == bool(thread), proc.stderr[-3000:]
    assert proc.stdout.splitlines().count("between the calls: 0") == 1, proc.stdout  # (the command's own line)
    built = sorted(set((tmp_path / "built.txt").read_text().splitlines()))
    assert built == ["first run1", "second run2"], built
    for run in ("run1", "run2"):
        assert json.loads((tmp_path / run / "summary.json").read_text())["steps"] == 1
