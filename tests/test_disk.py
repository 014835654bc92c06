"""A full disk: every write names its file, the space it needed and the space free; nothing is left half-written;
the run ends with one line saying how to continue, and `--resume` continues once there is space."""

import errno
import json
import os
import subprocess
import sys

import pytest

from aqpipe.disk import DiskFullError, free_bytes, is_disk_full, size_text, write_atomic
from tests import warm
from tests.processes import small_disk

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


def fill(directory, leave: int) -> None:
    """Fill the filesystem of `directory` until about `leave` bytes are free."""
    with open(directory / "filler", "wb") as f:
        chunk = b"\0" * (1 << 20)
        while (free_bytes(directory) or 0) > leave + len(chunk):
            f.write(chunk)
            f.flush()
        f.write(b"\0" * max(0, (free_bytes(directory) or 0) - leave))


def test_disk_full_errors_are_recognised_through_their_causes():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    wrapped = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(wrapped)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("bad value"))
    assert size_text(512) == "512 B" and size_text(12_300_000) == "12.3 MB" and size_text(1_500_000_000) == "1.50 GB"


@needs_root
def test_a_write_on_a_full_disk_names_the_file_and_leaves_nothing(tmp_path):
    with small_disk(tmp_path / "disk", "2m") as disk:
        fill(disk, 100_000)
        target = disk / "state.bin"
        with pytest.raises(DiskFullError) as caught:
            write_atomic(target, b"x" * 500_000)
        message = str(caught.value)
        assert str(target) in message and "500.0 KB" in message and "free" in message
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # no temporary file left behind


@needs_root
def test_a_checkpoint_on_a_full_disk_names_about_what_it_needed(tmp_path):
    """A rank's checkpoint streams to its file (never whole in memory), so its size was unknown when the disk filled:
    the message said it "needed an unknown amount"; the state's tensors say about how much."""
    import torch

    from aqpipe.runtime.checkpoints.parts import save_rank

    with small_disk(tmp_path / "disk", "4m") as disk:
        fill(disk, 1_000_000)
        with pytest.raises(DiskFullError) as caught:
            save_rank(disk, 2, 0, {"store": {i: torch.zeros(64 * 1024) for i in range(8)}}, {"lr": 1.0})
        assert "it needed 2.1 MB" in str(caught.value), str(caught.value)


_LMDB_ON_FULL_DISK = """
import sys
from aqpipe.storage.lmdb_store import LMDBStore
import torch
store = LMDBStore(sys.argv[1], "fp32", initial_map_bytes=64 << 20)
try:
    for step in range(10_000):
        store.put(0, "send", list(range(step * 4, step * 4 + 4)), [torch.randn(64, 256) for _ in range(4)])
except Exception as e:
    print(type(e).__name__, e)
"""


@needs_root
def test_the_lmdb_store_on_a_full_disk_fails_with_a_message_not_a_crash(tmp_path):
    """On tmpfs LMDB died with SIGBUS once the disk filled (on ext4: `mdb_txn_commit: Input/output error`)."""
    with small_disk(tmp_path / "disk", "3m") as disk:
        done = subprocess.run([sys.executable, "-c", _LMDB_ON_FULL_DISK, str(disk / "store.lmdb")],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-1500:])
    assert done.stdout.startswith("DiskFullError disk full writing"), done.stdout
    assert "store.lmdb" in done.stdout


SMALL_RUN = ["--pp", "3", "--seq-len", "64", "--max-samples", "256", "--no-progress", "--checkpoint-every", "2"]


@needs_root
def test_a_run_that_fills_the_disk_says_where_and_how_to_continue(tmp_path):
    """A full disk ends the run with the file it could not write and how to continue, not a bare `OSError: [Errno 28]
    No space left on device`, and leaves no half-written checkpoint file on it."""
    with small_disk(tmp_path / "disk", "24m") as disk:
        run = disk / "run"
        env = dict(os.environ, AQPIPE_CACHE=str(tmp_path / "cache"))
        failed = warm.run("launch", *SMALL_RUN, "--steps", "6", "--out", str(run), env=env)
        assert failed.returncode == 1, failed.stderr[-2000:]
        last = failed.stderr.strip().splitlines()[-1]
        assert last.startswith("aqpipe: run failed:") and "disk full writing" in last, failed.stderr[-2000:]
        assert str(run / "checkpoints" / "step-00000004") in last and "needed" in last and "free" in last
        assert f"--resume {run}" in last and "after step 2" in last
        assert not [p for p in run.rglob("*.tmp")], "a half-written temporary file was left on the full disk"
        assert not [line for line in failed.stdout.splitlines() if line.strip() in ("[rank 0]", "[rank 1]", "[rank 2]")]
        subprocess.run(["mount", "-o", "remount,size=200m", str(disk)], check=True)
        resumed = warm.run("launch", "--resume", str(run), "--no-progress", env=env)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert f"removed {run / 'checkpoints' / 'step-00000004'}" in resumed.stderr  # the one it could not finish
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 6
