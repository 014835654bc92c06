"""Every gradient compressor trains a pp=2 x dp=2 pipeline through `aqpipe launch` and lowers the loss."""

import json
import subprocess
import sys

import pytest

RUN = ["--pp", "2", "--dp", "2", "--seq-len", "32", "--max-samples", "256", "--micro-batch-size", "4",
       "--micro-batches", "2", "--epochs", "3", "--no-progress"]


@pytest.mark.parametrize("spec, optimizer, lr", [
    ("fp16", "adamw", "1e-3"), ("bf16", "adamw", "1e-3"), ("powersgd:2", "adamw", "1e-3"), ("ef:4", "adamw", "1e-3"),
    ("topk:0.05", "adamw", "1e-3"), ("sidco:exp:0.05", "adamw", "1e-3"), ("fft:0.5:10", "adamw", "1e-3"), ("qadam:4", "adamw", "1e-3"), ("signsgd", "sgd", "2e-3"), ("marsit:10", "sgd", "0.2"),
])
def test_compressor_trains_through_launch(tmp_path, spec, optimizer, lr):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", *RUN, "--grad-sync", spec, "--optimizer", optimizer,
                           "--lr", lr, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in records[:3]) / 3
    last = json.loads((out / "summary.json").read_text())["final_loss"]
    assert last < first - 0.5, (first, last)
    assert all(r["grad_sync_bytes"] > 0 for r in records)
