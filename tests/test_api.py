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
