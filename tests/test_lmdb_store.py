"""The LMDB message store: every encoding round-trips, damage is detected and re-seeded, the map grows, caps hold,
and `aqpipe store verify|stats` check a real run."""

import threading
import time

import pytest
import torch

from aqpipe.storage.lmdb_store import LMDBStore, StoreFullError, pack_key
from tests import warm


@pytest.mark.parametrize("encoding", ["fp32", "fp16", "bf16"])
def test_float_encodings_round_trip_exactly(tmp_path, encoding):
    store = LMDBStore(tmp_path / "s", encoding)
    values = [torch.randn(5, 7).to(store.dtype) for _ in range(3)]
    store.put(0, "send", [1, 2, 3], values)
    assert store.contains(0, "send", [1, 2, 3, 4]) == [True, True, True, False]
    for got, want in zip(store.get(0, "send", [1, 2, 3]), values):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert store.stats.as_dict() == {"hits": 3, "misses": 1, "reseeded": 0, "overflow": 0}
    store.close()


@pytest.mark.parametrize("encoding,bits", [("q8", 8), ("q4", 4), ("q2", 2)])
def test_low_bit_encodings_are_close_and_identical_on_both_sides(tmp_path, encoding, bits):
    a, b = LMDBStore(tmp_path / "a", encoding), LMDBStore(tmp_path / "b", encoding)
    value = torch.randn(6, 16)
    a.put(0, "send", [7], [value])
    b.put(0, "recv", [7], [value.clone()])
    got_a, got_b = a.get(0, "send", [7])[0], b.get(0, "recv", [7])[0]
    assert torch.equal(got_a, got_b)
    step = value.abs().amax(dim=0) / (1 << (bits - 1))  # the signed grid; its short side may clip by up to a step
    assert bool(((got_a - value).abs() <= step * 1.01).all())
    assert float((got_a - value).abs().mean()) < float(step.mean()) / 2
    a.close()
    b.close()


def test_a_value_damaged_on_disk_is_detected_dropped_and_counted(tmp_path):
    store = LMDBStore(tmp_path / "s", "fp16")
    store.put(1, "recv", [5, 6], [torch.ones(4, 4, dtype=torch.float16)] * 2)
    with store.env.begin(write=True) as txn:  # flip one byte of sample 6's compressed body, as a bad sector would
        raw = bytearray(txn.get(pack_key(1, "recv", 6)))
        raw[-1] ^= 0xFF
        txn.put(pack_key(1, "recv", 6), bytes(raw))
    assert store.contains(1, "recv", [5, 6]) == [True, False]
    assert store.stats.reseeded == 1
    assert store.contains(1, "recv", [6]) == [False]  # gone: the next message re-seeds it at full precision
    with pytest.raises(KeyError):
        store.get(1, "recv", [6])
    store.close()


def test_the_map_grows_and_the_cap_holds(tmp_path):
    store = LMDBStore(tmp_path / "grow", "fp32", initial_map_bytes=1 << 20)
    store.put(0, "send", list(range(40)), [torch.randn(64, 64) for _ in range(40)])  # ~650 KB compressed poorly
    store.put(0, "send", list(range(40, 80)), [torch.randn(64, 64) for _ in range(40)])
    assert len(list(store.items())) == 80
    store.close()
    capped = LMDBStore(tmp_path / "cap", "fp32", initial_map_bytes=1 << 20, max_bytes=2 << 20)
    with pytest.raises(StoreFullError, match="cap"):
        for start in range(0, 400, 40):
            capped.put(0, "send", list(range(start, start + 40)), [torch.randn(64, 64) for _ in range(40)])
    capped.close()


def test_store_verify_and_stats_on_a_real_run(tmp_path, capsys):
    from aqpipe.cli import main
    from aqpipe.config import RunConfig, resolve
    from aqpipe.launch.job import run_job
    from aqpipe.storage.lmdb_store import store_path

    out = tmp_path / "run"
    cfg = resolve(RunConfig(model="gpt2-tiny", seq_len=16, micro_batch_size=2, micro_batches=2, epochs=3, pp=3,
                            max_samples=24, eval_samples=16, device="cpu", out=str(out), fw="aqsgd:2", store="lmdb",
                            store_dtype="q4"))
    assert run_job(cfg, progress=False, starter=warm.ranks()) == 0
    assert main(["store", "verify", str(out)]) == 0
    assert "0 mismatch(es) in 48 m(xi) entries compared" in capsys.readouterr().out
    assert main(["store", "stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert "0->1" in text and "1->2" in text and "bytes on disk" in text
    # (the run's one checkpoint, at its end: nothing changed since)
    assert "rewind journals: 0.000 MB; every store here rewinds to the checkpoint(s) of step(s) 18" in text
    receiver = LMDBStore(store_path(out, 2), "q4")
    receiver.put(1, "recv", [3], [receiver.get(1, "recv", [3])[0] + 0.5])  # plant a divergence
    receiver.close()
    assert main(["store", "verify", str(out)]) == 1
    text = capsys.readouterr().out
    assert "replica 0 link 1->2 sample 3: copies differ" in text and "1 mismatch(es)" in text


def test_store_commands_on_a_memory_run_give_a_clear_error(tmp_path, capsys):
    from aqpipe.cli import main

    (tmp_path / "config.json").write_text('{"store": "memory", "pp": 2, "dp": 1}')
    assert main(["store", "verify", str(tmp_path)]) == 2
    assert "not --store lmdb" in capsys.readouterr().err
    assert main(["store", "stats", str(tmp_path / "nothing")]) == 2


class WatchedEnv:
    """An LMDB environment that counts this process's open transactions and notes a resize made while any is open
    (LMDB forbids it without checking)."""

    def __init__(self, env):
        self._env, self._lock = env, threading.Lock()
        self.open = self.resizes = self.violations = 0

    def begin(self, **kwargs):
        txn = self._env.begin(**kwargs)
        with self._lock:
            self.open += 1
        return WatchedTxn(txn, self)

    def closed(self):
        with self._lock:
            self.open -= 1

    def set_mapsize(self, size):
        with self._lock:
            self.resizes += 1
            self.violations += self.open > 0
        self._env.set_mapsize(size)

    def __getattr__(self, name):
        return getattr(self._env, name)


class WatchedTxn:
    def __init__(self, txn, env):
        self._txn, self._env = txn, env

    def __enter__(self):
        self._txn.__enter__()
        return self._txn

    def __exit__(self, *exc):
        try:
            return self._txn.__exit__(*exc)
        finally:
            self._env.closed()


def test_the_map_grows_only_while_no_transaction_is_open(tmp_path):
    store = LMDBStore(tmp_path / "s", "fp32", initial_map_bytes=1 << 20)
    store.env = WatchedEnv(store.env)
    known = torch.randn(4, 64)
    store.put(0, "recv", [0], [known])
    stop, failures = threading.Event(), []

    def read():
        while not stop.is_set():
            try:
                assert torch.equal(store.get(0, "recv", [0])[0], known)
                store.present(0, "recv", [0, 1])
            except Exception as e:  # noqa: BLE001 - reported by the test
                failures.append(repr(e))
                return

    readers = [threading.Thread(target=read, daemon=True) for _ in range(2)]
    for thread in readers:
        thread.start()
    for i in range(1, 40):  # ~16 MB of incompressible values: the 1 MB map grows several times under the readers
        store.put(0, "send", [i], [torch.randn(64, 1024)])
    stop.set()
    for thread in readers:
        thread.join(10)
    assert not failures, failures
    assert store.env.resizes >= 3 and store.env.violations == 0
    assert store.contains(0, "send", list(range(1, 40))) == [True] * 39
    store.close()


def test_no_two_threads_share_a_zstd_context(tmp_path, monkeypatch):
    """python-zstandard's compressor and decompressor objects are not thread-safe. With one of each per store, a
    prefetch thread and the training thread decoding at once sometimes got garbage, which the store took for a
    damaged value: it dropped a sound m(xi) and re-seeded its sample (seen as a flaky map-growth test)."""
    import zstandard

    shared: list[str] = []

    class Exclusive:
        """A zstd context that notes any call made while another thread is inside one."""

        def __init__(self, context) -> None:
            self._context, self._busy = context, False

        def _once(self, method: str, data):
            if self._busy:
                shared.append(method)
            self._busy = True
            try:
                time.sleep(0.005)  # widen the window, so that sharing shows every time
                return getattr(self._context, method)(data)
            finally:
                self._busy = False

        def compress(self, data):
            return self._once("compress", data)

        def decompress(self, data):
            return self._once("decompress", data)

    compressor, decompressor = zstandard.ZstdCompressor, zstandard.ZstdDecompressor
    monkeypatch.setattr(zstandard, "ZstdCompressor", lambda *a, **k: Exclusive(compressor(*a, **k)))
    monkeypatch.setattr(zstandard, "ZstdDecompressor", lambda *a, **k: Exclusive(decompressor(*a, **k)))
    store = LMDBStore(tmp_path / "s", "fp32")
    values = [torch.randn(32) for _ in range(8)]
    store.put(0, "recv", list(range(8)), values)
    failures: list[str] = []

    def work(first: int) -> None:
        try:
            for _ in range(5):
                store.put(1, "send", [first], [values[first]])
                assert torch.equal(store.get(0, "recv", [first])[0], values[first])
        except Exception as e:  # noqa: BLE001 - reported by the test
            failures.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not shared, f"a zstd context was used by two threads at once: {shared[:5]}"
    assert not failures and store.stats.reseeded == 0, failures


def contents(store: LMDBStore) -> dict:
    """Every m(ξ) the store holds, by key."""
    return dict(store.items())


def assert_holds(store: LMDBStore, want: dict) -> None:
    got = contents(store)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[key], want[key]) for key in want)


def test_a_rewind_brings_back_every_value_the_checkpoint_held_and_only_those(tmp_path):
    """After a checkpoint, values changed (once or twice), added and deleted on both sides: a rewind puts back
    exactly what the checkpoint held and counts each value it changed once; the store then goes on journaling
    against the same checkpoint."""
    store = LMDBStore(tmp_path / "s", "fp16")
    store.put(0, "send", [1, 2, 3], [torch.randn(4, 8) for _ in range(3)])
    store.put(0, "recv", [1], [torch.randn(4, 8)])
    store.checkpointed(4, kept={4})
    held = contents(store)
    store.put(0, "send", [1, 4], [torch.randn(4, 8), torch.randn(4, 8)])  # one changed, one new
    store.put(0, "send", [1], [torch.randn(4, 8)])  # changed again: the journal keeps the checkpoint's
    store.delete(0, "send", [2])
    store.put(0, "recv", [1], [torch.randn(4, 8)])
    assert contents(store).keys() != held.keys()
    assert store.journal_bytes() > 0
    assert store.rewind(4) == 4  # send 1, 4 and 2; recv 1
    assert_holds(store, held)
    assert store.journal_checkpoints() == [4] and store.journal_bytes() == 0
    store.put(0, "send", [3], [torch.randn(4, 8)])
    assert store.rewind(4) == 1
    assert_holds(store, held)
    store.close()


def test_a_rewind_reaches_back_over_several_checkpoints_and_not_past_a_dropped_journal(tmp_path):
    store = LMDBStore(tmp_path / "s", "q4")
    store.put(1, "recv", [1, 2], [torch.randn(3, 16) for _ in range(2)])
    store.checkpointed(4, kept={4})
    at_4 = contents(store)
    store.put(1, "recv", [2, 3], [torch.randn(3, 16) for _ in range(2)])
    store.checkpointed(8, kept={4, 8})
    store.put(1, "recv", [1, 2], [torch.randn(3, 16) for _ in range(2)])
    assert store.journal_checkpoints() == [4, 8]
    assert store.rewind(4) == 4  # 2 and 3 since step 4; 1 and 2 since step 8 (2 twice: once per checkpoint)
    assert_holds(store, at_4)
    assert store.journal_checkpoints() == [4]
    store.put(1, "recv", [1], [torch.randn(3, 16)])
    store.checkpointed(12, kept={12})  # the checkpoint of step 4 is gone from the disk: so is its journal
    now = contents(store)
    store.put(1, "recv", [2], [torch.randn(3, 16)])
    after = contents(store)
    assert store.journal_checkpoints() == [12]
    assert store.rewind(4) is None  # nothing reaches back to it: the values stay as they are
    assert_holds(store, after)
    assert store.journal_checkpoints() == [] and store.journal.step is None
    store.put(1, "recv", [3], [torch.randn(3, 16)])  # (nothing journaled until the next checkpoint)
    assert store.journal_bytes() == 0
    assert now.keys() == after.keys()
    store.close()


def test_a_journal_dropped_between_two_kept_ones_still_lets_the_older_one_rewind_exactly(tmp_path):
    """Checkpoints 4, 8 and 12, of which 8 leaves the disk while 4 stays (the newest copied one across hosts): the
    values first changed after 8 are kept in 8's journal alone, and a rewind to 4 must still put them back. Lost
    with 8's journal, a rewind to 4 would leave those values as they were at 8, on both sides of a link alike (so no
    comparison of the copies could tell)."""
    store = LMDBStore(tmp_path / "s", "fp32")
    store.put(0, "send", [1, 2, 3], [torch.full((2, 2), float(i)) for i in (1, 2, 3)])
    store.checkpointed(4, kept={4})
    at_4 = contents(store)
    store.put(0, "send", [1], [torch.full((2, 2), 10.0)])  # between 4 and 8
    store.checkpointed(8, kept={4, 8})
    store.put(0, "send", [2, 4], [torch.full((2, 2), 20.0)] * 2)  # between 8 and 12: kept in 8's journal only
    store.checkpointed(12, kept={4, 12})
    store.put(0, "send", [1, 3], [torch.full((2, 2), 30.0)] * 2)  # after 12
    assert store.journal_checkpoints() == [4, 12]
    store.rewind(4)
    assert_holds(store, at_4)
    store.close()


def test_a_rewind_to_a_checkpoint_without_a_journal_drops_the_older_ones_too(tmp_path):
    """No journal for the checkpoint a resume starts from: the changes since were not all kept, so no older journal
    can be trusted either; the values stay as they are."""
    store = LMDBStore(tmp_path / "s", "fp16")
    store.put(0, "recv", [1], [torch.randn(2, 8)])
    store.checkpointed(4, kept={4})
    store.put(0, "recv", [1, 2], [torch.randn(2, 8)] * 2)
    store.checkpointed(8, kept={4, 8})
    store.put(0, "recv", [2], [torch.randn(2, 8)])
    now = contents(store)
    assert store.rewind(6) is None
    assert_holds(store, now)
    assert store.journal_checkpoints() == [] and store.journal.step is None and store.journal_bytes() == 0
    store.close()


def test_through_the_prefetching_store_a_checkpoint_holds_every_put_before_it_and_a_rewind_drops_read_ahead(tmp_path):
    """Puts still queued for the disk belong to the checkpoint that follows them; a value read ahead before a rewind
    is not served after it."""
    from aqpipe.storage.prefetch import PrefetchingStore

    store = PrefetchingStore(LMDBStore(tmp_path / "s", "fp32"))
    before = torch.full((2, 2), 1.0)
    store.put(0, "send", [1], [before])  # (written behind)
    store.checkpointed(4, kept={4})
    store.put(0, "send", [1], [torch.full((2, 2), 2.0)])
    store.flush()
    store.prefetch(0, "send", [1])
    time.sleep(0.2)  # (read ahead by now, as a rule; one still in flight is dropped by the rewind all the same)
    assert store.rewind(4) == 1
    assert torch.equal(store.get(0, "send", [1])[0], before)
    store.close()


REWRITTEN_THEN_KILLED = """
import os, signal, sys, torch
from aqpipe.storage.lmdb_store import LMDBStore
store = LMDBStore(sys.argv[1], "fp32")
store.put(0, "send", list(range(8)), [torch.full((4, 4), float(i)) for i in range(8)])
store.checkpointed(6, kept={6})
store.put(0, "send", list(range(4, 12)), [torch.full((4, 4), -1.0)] * 8)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_store_that_outlived_a_killed_process_rewinds_to_its_checkpoint(tmp_path):
    """The journal is written with the values it guards, in one transaction: a process killed after changing values
    past its checkpoint leaves a store that reopens and rewinds to that checkpoint exactly; the reopened store keeps
    journaling against it."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", REWRITTEN_THEN_KILLED, str(tmp_path / "s")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    store = LMDBStore(tmp_path / "s", "fp32")
    assert store.journal.step == 6
    assert len(contents(store)) == 12
    assert store.rewind(6) == 8
    assert_holds(store, {(0, "send", i): torch.full((4, 4), float(i)) for i in range(8)})
    store.close()


def test_the_journal_is_not_an_m_of_xi(tmp_path):
    """What a store holds, reads and reports is m(ξ) alone: the journal's database (a key among the values') is none
    of them, read-only opens included; a store that never saw a checkpoint has no journal at all."""
    store = LMDBStore(tmp_path / "s", "fp16")
    store.put(2, "send", [9], [torch.randn(4, 8)])
    assert store.journal_checkpoints() == [] and store.env.stat()["entries"] == 1
    store.checkpointed(2, kept={2})
    store.put(2, "send", [9], [torch.randn(4, 8)])
    assert [key for key, _ in store.items()] == [(2, "send", 9)]
    assert [key for key, *_ in store.raw_records()] == [(2, "send", 9)]
    store.close()
    reader = LMDBStore(tmp_path / "s", "fp16", readonly=True)
    assert [key for key, _ in reader.items()] == [(2, "send", 9)] and reader.journal_checkpoints() == [2]
    reader.close()
