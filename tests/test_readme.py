"""The README stays true: its Quick start, the Python API page's example, and the ways it says to start a job."""

import json
import re
import subprocess
import sys
from pathlib import Path

from tests import warm

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_quick_start_holds_two_commands_and_ci_runs_exactly_them():
    section = README.split("## Quick start", 1)[1]
    first_block = re.search(r"```\w*\n(.*?)```", section, flags=re.S).group(1)
    commands = [line for line in first_block.splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[0].endswith("aqpipe launch") and commands[1].endswith("python -m pytest")
    ci = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--commands"], capture_output=True, text=True, timeout=60)
    assert ci.returncode == 0, ci.stderr
    assert ci.stdout.splitlines() == commands


def test_python_api_example_is_the_example_file():
    page = (ROOT / "docs" / "python-api.md").read_text()
    (example,) = [b for b in code_blocks("python", page) if "aqpipe.train" in b]
    assert example == (ROOT / "examples" / "custom_model.py").read_text()


def test_python_api_example_trains(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_model.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = (tmp_path / "runs").iterdir()
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 30 and records[-1]["loss"] < records[0]["loss"]
    assert json.loads((run / "config.json").read_text())["pp"] == 3


def test_module_function_model_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    proc = warm.run("launch", "--model", "examples.custom_model:tiny_lm", "--pp", "2", "--steps", "3", "--seq-len", "16",
                    "--out", str(out), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    # the default links compress from the first step: rotated 4-bit first sights forward, 8-bit gradients back
    assert summary["bytes_per_element"]["fwd"] < 0.6 and summary["bytes_per_element"]["bwd"] < 1.2  # fp32: 4


def test_torchrun_runs_aqpipe_launch_as_its_ranks(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "aqpipe", "launch", "--pp", "2", "--steps", "4", "--seq-len", "16",
                           "--max-samples", "64", "--eval-samples", "16", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["link_bytes"]["fwd"] > 0
    assert sorted(p.name for p in (out / "checkpoints" / "final").iterdir()) == ["stage-0.pt", "stage-1.pt"]
