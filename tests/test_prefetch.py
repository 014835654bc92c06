"""Prefetch and write-behind: reads always see the newest m(ξ), even while its write is still pending."""

import threading

import torch

from aqpipe.storage import MemoryStore
from aqpipe.storage.prefetch import PrefetchingStore


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
