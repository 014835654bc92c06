"""A damaged LMDB m(ξ) store is found without crashing the reader: the store tools say so in one line (exit 1), and
a resume drops the store and re-seeds its samples at full precision."""

import json
import os
import shutil
import struct
import subprocess

import lmdb
import pytest

from aqpipe.storage.health import damage
from aqpipe.storage.lmdb_store import store_path
from tests import warm

PAGE = 4096


def _make(path, entries=600):
    env = lmdb.open(str(path), map_size=1 << 26, subdir=True)
    with env.begin(write=True) as txn:
        for i in range(entries):
            txn.put(b"k%08d" % i, os.urandom(100 if i % 7 else 6000))
    env.close()


def _truncate(path):
    data = path / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)


def _zero_meta(path):
    with open(path / "data.mdb", "r+b") as f:
        f.write(bytes(2 * PAGE))


def _damage_tree_pages(path):
    """Garble the body of every branch and leaf page (flags 0x01 / 0x02 at offset 10 of the page header)."""
    data = bytearray((path / "data.mdb").read_bytes())
    rng = __import__("random").Random(0)
    hit = 0
    for page in range(2, len(data) // PAGE):
        flags = struct.unpack_from("<H", data, page * PAGE + 10)[0]
        if flags in (0x01, 0x02):
            data[page * PAGE + 16:(page + 1) * PAGE] = bytes(rng.randrange(256) for _ in range(PAGE - 16))
            hit += 1
    assert hit
    (path / "data.mdb").write_bytes(bytes(data))


DAMAGE = {"truncated to half": _truncate, "zeroed meta pages": _zero_meta, "damaged tree pages": _damage_tree_pages}


def test_a_sound_store_passes(tmp_path):
    _make(tmp_path / "s")
    assert damage(tmp_path / "s") is None


def _journaled(path):
    """A store whose values changed since a checkpoint: its rewind journal holds their old values."""
    import torch

    from aqpipe.storage.lmdb_store import LMDBStore

    store = LMDBStore(path, "fp16")
    store.put(0, "send", list(range(200)), [torch.randn(8, 64) for _ in range(200)])
    store.checkpointed(4, kept={4})
    store.put(0, "send", list(range(200)), [torch.randn(8, 64) for _ in range(200)])
    assert store.journal_bytes() > 0
    store.close()


def _miscount_the_journal(path):
    """Change the entry count the store records for its journal (its database record, on every page that holds it)
    so that a walk of the journal finds another count; the values' database is untouched."""
    from aqpipe.storage.rewind import NAME

    data = bytearray((path / "data.mdb").read_bytes())
    at, found = data.find(NAME), 0
    while at >= 0:
        entries = at + len(NAME) + 32  # the record: pad, flags, depth, three page counts, entries, root
        struct.pack_into("<Q", data, entries, struct.unpack_from("<Q", data, entries)[0] + 5)
        found += 1
        at = data.find(NAME, at + 1)
    assert found
    (path / "data.mdb").write_bytes(bytes(data))


def test_a_sound_store_with_its_rewind_journal_passes_and_damage_to_the_journal_is_named(tmp_path):
    _journaled(tmp_path / "s")
    assert damage(tmp_path / "s") is None
    _miscount_the_journal(tmp_path / "s")
    problem = damage(tmp_path / "s")
    assert problem is not None and "rewind journal" in problem and "\n" not in problem, problem


@pytest.mark.parametrize("kind", DAMAGE)
def test_each_kind_of_damage_is_named_in_one_line(tmp_path, kind):
    _make(tmp_path / "s")
    DAMAGE[kind](tmp_path / "s")
    problem = damage(tmp_path / "s")
    assert problem is not None and str(tmp_path / "s" / "data.mdb") in problem
    assert "\n" not in problem


def test_a_missing_data_file_is_named(tmp_path):
    (tmp_path / "s").mkdir()
    assert "data.mdb is missing" in damage(tmp_path / "s")


def aqpipe(*args, timeout=300) -> subprocess.CompletedProcess:
    return warm.run(*args, timeout=timeout)


@pytest.fixture(scope="module")
def lmdb_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("lmdb") / "run"
    proc = aqpipe("launch", "--pp", "4", "--steps", "6", "--checkpoint-every", "6", "--seq-len", "16",
                  "--max-samples", "32", "--eval-samples", "16", "--fw", "aqsgd:3", "--store", "lmdb", "--warmup-epochs", "1",
                  "--no-progress", "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run


@pytest.mark.parametrize("kind", DAMAGE)
def test_the_store_tools_report_a_damaged_store_in_one_line_with_exit_1(lmdb_run, tmp_path, capsys, kind):
    from aqpipe.cli import main

    run = tmp_path / "run"
    shutil.copytree(lmdb_run, run)
    victim = store_path(run, 1)
    DAMAGE[kind](victim)
    for action in ("verify", "stats"):
        code = main(["store", action, str(run)])
        err = capsys.readouterr().err
        assert code == 1, (action, err)
        assert len(err.strip().splitlines()) == 1
        assert "rank 1's m(xi) store is damaged" in err and str(victim / "data.mdb") in err


def test_a_resume_drops_damaged_stores_and_reseeds_their_samples(lmdb_run, tmp_path):
    """Three of the four ranks' stores damaged, each a different way; rank 1's stays sound. The resumed run drops
    the three, rank 1 drops its copies of their samples (counted as re-seeded), and every copy agrees at the end."""
    run = tmp_path / "run"
    shutil.copytree(lmdb_run, run)
    for rank, kind in zip((0, 2, 3), DAMAGE):
        DAMAGE[kind](store_path(run, rank))
    proc = aqpipe("launch", "--resume", str(run), "--steps", "8", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 2, 3):
        assert f"rank {rank}'s m(xi) store is damaged" in proc.stderr and "dropping it" in proc.stderr
    assert "rank 1's" not in proc.stderr and "Traceback" not in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8
    assert summary["store"]["reseeded"] > 0
    verify = aqpipe("store", "verify", str(run))
    assert verify.returncode == 0 and "0 mismatch(es)" in verify.stdout, verify.stdout + verify.stderr
