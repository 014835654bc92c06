"""tests/cpu_profile.py: a test run under the plugin leaves one line per test with its wall and CPU seconds."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_each_test_run_under_the_plugin_records_its_wall_and_cpu_seconds(tmp_path):
    (tmp_path / "test_busy.py").write_text(
        "import time\n"
        "def test_busy():\n"
        "    end = time.process_time() + 0.3\n"
        "    while time.process_time() < end:\n"
        "        pass\n"
        "def test_idle():\n"
        "    time.sleep(0.3)\n")
    log = tmp_path / "cpu.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_profile", "-p", "no:cacheprovider",
                           "-n", "0", "-c", "/dev/null", str(tmp_path / "test_busy.py")], cwd=ROOT,
                          env={**os.environ, "AQPIPE_TEST_CPU_LOG": str(log)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r["test"].split("::")[-1]: r for r in map(json.loads, log.read_text().splitlines())}
    assert set(records) == {"test_busy", "test_idle"}
    # (the machine's CPU: at least the busy test's own, whatever else runs beside it)
    assert records["test_busy"]["wall_s"] >= 0.3 and records["test_busy"]["cpu_s"] >= 0.25
    assert records["test_idle"]["wall_s"] >= 0.3
    assert all(r["cpu_s"] >= r["kernel_s"] >= 0 for r in records.values())
