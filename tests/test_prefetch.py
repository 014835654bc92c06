"""Prefetch and write-behind: reads always see the newest m(ξ), even while its write is still pending."""

import threading

import pytest
import torch

from aqpipe.storage import MemoryStore
from aqpipe.storage.lmdb_store import LMDBStore
from aqpipe.storage.prefetch import PrefetchingStore
from tests.store_cases import QueuedCopy, queued_copies


class GatedStore(MemoryStore):
    """A memory store whose reads and writes wait until the test opens their gate."""

    def __init__(self):
        super().__init__(torch.float32)
        self.read_gate, self.write_gate = threading.Event(), threading.Event()
        self.read_gate.set()
        self.write_gate.set()

    def get(self, link, side, ids):
        self.read_gate.wait(10)
        return super().get(link, side, ids)

    def put(self, link, side, ids, values):
        self.write_gate.wait(10)
        super().put(link, side, ids, values)


def value(x):
    return torch.full((2, 2), float(x))


def test_a_read_sees_a_write_that_is_still_pending():
    backend = GatedStore()
    backend.put(0, "send", [7], [value(1)])
    store = PrefetchingStore(backend)
    store.prefetch(0, "send", [7])
    assert torch.equal(store.get(0, "send", [7])[0], value(1))
    backend.write_gate.clear()  # the disk is slow: the next write stays pending
    store.put(0, "send", [7], [value(2)])
    store.prefetch(0, "send", [7])  # the next epoch's prefetch of the same sample
    assert store.contains(0, "send", [7]) == [True]
    assert torch.equal(store.get(0, "send", [7])[0], value(2))
    assert torch.equal(backend.get(0, "send", [7])[0], value(1))  # really still pending
    backend.write_gate.set()
    store.flush()
    assert torch.equal(backend.get(0, "send", [7])[0], value(2))
    store.close()


def test_a_prefetch_that_started_before_a_write_cannot_install_the_older_value():
    backend = GatedStore()
    backend.put(0, "recv", [3], [value(1)])
    store = PrefetchingStore(backend)
    backend.read_gate.clear()  # the read of the old value is slow
    store.prefetch(0, "recv", [3])
    store.put(0, "recv", [3], [value(2)])
    store.flush()  # the new value is on disk and no longer pending
    backend.read_gate.set()  # now the stale read completes
    assert torch.equal(store.get(0, "recv", [3])[0], value(2))
    store.close()


def test_absent_samples_and_write_order():
    backend = GatedStore()
    store = PrefetchingStore(backend)
    store.prefetch(1, "send", [1, 2])
    assert store.contains(1, "send", [1, 2]) == [False, False]
    for v in range(1, 6):  # successive versions of one sample must land in order
        store.put(1, "send", [1], [value(v)])
    store.flush()
    assert torch.equal(backend.get(1, "send", [1])[0], value(5))
    store.close()


class GatedLMDB(LMDBStore):
    """An LMDB store whose writes wait until the test opens their gate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.write_gate = threading.Event()
        self.write_gate.set()

    def put(self, link, side, ids, values):
        self.write_gate.wait(10)
        super().put(link, side, ids, values)

    def put_raw(self, link, side, ids, raws, shapes):
        self.write_gate.wait(10)
        super().put_raw(link, side, ids, raws, shapes)


@pytest.mark.parametrize("encoding", ["q8", "q4", "q2", "fp16"])
def test_a_store_returns_the_same_bits_before_and_after_the_write_lands(tmp_path, encoding):
    """Sender and receiver flush at different times: a quantized store served the unquantized pending value first
    and the re-quantized one after (0.19 apart), so the two copies of m(xi) differed."""
    backend = GatedLMDB(tmp_path / "s", encoding)
    store = PrefetchingStore(backend)
    value = torch.randn(6, 16).to(store.dtype)
    backend.write_gate.clear()
    store.put(0, "send", [7], [value])
    before = store.get(0, "send", [7])[0]  # served from the pending table
    backend.write_gate.set()
    store.flush()
    after = store.get(0, "send", [7])[0]  # read from disk
    assert before.dtype == after.dtype and torch.equal(before, after)
    store.close()


def test_the_write_queue_is_bounded_and_a_producer_ahead_of_the_disk_waits():
    backend = GatedStore()
    store = PrefetchingStore(backend, max_queued_writes=2)
    backend.write_gate.clear()
    done = threading.Event()

    def produce():
        for i in range(8):
            store.put(0, "send", [i], [value(i)])
        done.set()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    assert not done.wait(1.0)  # blocked: the disk has not taken a write yet
    assert store._writes.qsize() <= 2
    backend.write_gate.set()
    assert done.wait(10)
    store.flush()
    assert all(torch.equal(backend.get(0, "send", [i])[0], value(i)) for i in range(8))
    store.close()


def test_bookkeeping_does_not_grow_with_the_samples_seen():
    """A per-key version table grew one entry per sample forever."""
    store = PrefetchingStore(MemoryStore(torch.float32))
    for epoch in range(2):
        for i in range(0, 2000, 8):
            ids = list(range(i, i + 8))
            store.prefetch(0, "send", ids)
            if epoch:
                store.get(0, "send", ids)
            store.put(0, "send", ids, [value(epoch)] * 8)
    store.flush()
    held = sum(len(v) for v in vars(store).values() if isinstance(v, (dict, set)))
    assert held == 0, {k: len(v) for k, v in vars(store).items() if isinstance(v, (dict, set))}
    store.close()


def _gpu_values(monkeypatch) -> list[QueuedCopy]:
    """Make every put and scatter take the path of a GPU's values (`store_cases.queued_copies`)."""
    from aqpipe.storage import prefetch

    return queued_copies(monkeypatch, prefetch, "crosses_to_the_host", "from_a_gpu")


@pytest.mark.parametrize("encoding", ["fp16", "q4"])
def test_a_gpus_values_reach_the_disk_store_without_the_host_waiting(tmp_path, monkeypatch, encoding):
    """Reading found `put` copying a GPU's m(ξ) to the host with a blocking copy — a wait for the GPU on every AQ-SGD
    message of both sides under `--store lmdb`. `put` now queues the copy (here: host values standing for a GPU's)
    and returns; the next call that reads or writes waits for it — by then long done — and then encodes and queues
    the values for the disk as before. A prefetch, which follows a put, does not wait. What the store serves and
    writes equals what the same puts from the host give."""
    torch.manual_seed(0)
    first, second, third = (torch.randn(n, 4, 16).half() for n in (3, 1, 2))
    reference = PrefetchingStore(LMDBStore(tmp_path / "r", encoding))  # (before the GPU stand-ins: the host's path)
    reference.put(0, "send", [0, 1, 2], list(first.to(reference.dtype)))
    served = reference.get(0, "send", [0, 1, 2])
    reference.put(0, "send", [1], list(second.to(reference.dtype)))
    reference.put(0, "recv", [4, 1], list(third.to(reference.dtype)))
    reference.flush()
    queued = _gpu_values(monkeypatch)
    store = PrefetchingStore(LMDBStore(tmp_path / "s", encoding))
    store.put(0, "send", [0, 1, 2], list(first.to(store.dtype)))
    assert len(queued) == 1 and queued[0].waits == 0  # one copy for the message, and no wait yet
    store.prefetch(0, "send", [1, 2, 5])
    assert queued[0].waits == 0
    assert store.present(0, "send", [2, 5]) == [True, False] and queued[0].waits == 1
    assert all(torch.equal(a, b) for a, b in zip(store.get(0, "send", [0, 1, 2]), served))
    store.put(0, "send", [1], list(second.to(store.dtype)))
    store.scatter(0, "recv", [4, 1], third.to(store.dtype))  # a second crossing right after: the first lands
    assert queued[1].waits == 1 and queued[2].waits == 0 and len(queued) == 3
    assert store.contains(0, "recv", [1]) == [True] and queued[2].waits == 1
    store.flush()
    for link, side, i in [(0, "send", 0), (0, "send", 1), (0, "send", 2), (0, "recv", 4), (0, "recv", 1)]:
        want = reference.backend.get(link, side, [i])[0]  # on disk: what the host's puts wrote
        assert torch.equal(store.backend.get(link, side, [i])[0], want), (side, i)
        assert torch.equal(store.get(link, side, [i])[0], want)
    store.close()
    reference.close()


def test_a_read_in_flight_when_a_gpus_values_cross_never_installs_the_older_value(monkeypatch):
    backend = GatedStore()
    backend.put(0, "recv", [3], [value(1)])
    queued = _gpu_values(monkeypatch)
    store = PrefetchingStore(backend)
    backend.read_gate.clear()  # the read of the old value is slow
    store.prefetch(0, "recv", [3])
    store.put(0, "recv", [3], [value(2)])  # crossing, not yet landed
    threading.Timer(0.2, backend.read_gate.set).start()  # the old value arrives while (or after) the put lands
    assert torch.equal(store.get(0, "recv", [3])[0], value(2)) and queued[0].waits == 1
    store.flush()
    assert torch.equal(store.get(0, "recv", [3])[0], value(2)) and torch.equal(backend.get(0, "recv", [3])[0], value(2))
    store.close()
