"""The in-memory m(ξ) store: compact values, the non-finite guard, and the up-front RAM check."""

import pytest
import torch

from aqpipe.cli import main
from aqpipe.storage import MemoryStore
from tests.store_cases import QueuedCopy, queued_copies


def _held_bytes(store: MemoryStore) -> int:
    """Bytes of the distinct storages the store's values keep alive."""
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for _, v in store.items()}
    return sum(storages.values())


def test_values_are_compact_copies_that_do_not_pin_their_micro_batch():
    """Rows of a stacked micro-batch kept as views held the whole batch alive for as long as any one row lived."""
    store = MemoryStore(torch.float16)
    first = torch.randn(8, 64, 32).to(torch.float16)
    store.put(0, "send", list(range(8)), list(first))
    second = torch.randn(8, 64, 32).to(torch.float16)  # the next epoch regroups: 7 of the 8 samples get new values
    store.put(0, "send", list(range(1, 8)), list(second[1:]))
    value_bytes = 8 * 64 * 32 * 2
    assert _held_bytes(store) == value_bytes
    assert torch.equal(store.get(0, "send", [0])[0], first[0]) and torch.equal(store.get(0, "send", [3])[0], second[3])


def test_only_finite_values_are_storable():
    store = MemoryStore(torch.float16)
    rows = torch.tensor([[1.0, 1.0], [70000.0, 1.0], [float("nan"), 1.0]]).to(torch.float16)  # 70000: inf in fp16
    assert store.storable_rows(rows).tolist() == [True, False, False]


def test_a_memory_store_that_cannot_fit_in_ram_is_refused_with_the_numbers(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("aqpipe.runtime.plan.available_memory", lambda: 10_000)
    code = main(["launch", "--steps", "1", "--max-samples", "64", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "GB of RAM" in err[0] and "0.00 GB is available" in err[0] and "--store lmdb" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_values_from_another_device_cross_in_one_copy(monkeypatch):
    """A GPU's m(ξ) for host RAM (here: host values for the meta device) moves as one stacked copy, one wait for the
    GPU per message rather than one per sample, and each value then owns its storage."""
    import threading

    from aqpipe.storage.base import on_device

    copies = []
    real_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        if threading.current_thread() is threading.main_thread():  # (another test's lingering thread is not ours)
            copies.append(tuple(self.shape))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    values = [torch.randn(5, 3).half() for _ in range(4)]
    moved = on_device(values, "meta")
    assert copies == [(4, 5, 3)]
    assert all(v.device.type == "meta" and v.shape == (5, 3) for v in moved)
    copies.clear()
    same = on_device(values, "cpu")
    assert all(a is b for a, b in zip(same, values))  # already there: the values themselves, no copy


def _queued_copies(monkeypatch) -> list[QueuedCopy]:
    """Make every put take the path of a GPU's values bound for host RAM (`store_cases.queued_copies`)."""
    from aqpipe.storage import memory

    return queued_copies(monkeypatch, memory, "crosses_to_the_host")


def test_a_gpus_values_reach_host_ram_without_the_host_waiting(monkeypatch):
    """The H200's sync audit found the host waiting for the GPU once per AQ-SGD message to copy the new m(ξ) into
    host RAM. `put` now queues that copy (here: host values standing for a GPU's) and returns; the next call that
    needs the values waits for it, and then every value owns pageable storage of its own."""
    queued = _queued_copies(monkeypatch)
    store = MemoryStore(torch.float16)
    first = torch.randn(4, 16, 8).half()
    store.put(0, "send", [0, 1, 2, 3], list(first))
    assert len(queued) == 1 and queued[0].waits == 0  # one copy for the message, and no wait yet
    assert store.contains(0, "send", [3, 4]) == [True, False] and queued[0].waits == 0
    store.delete(0, "send", [2])
    second = torch.randn(2, 16, 8).half()
    store.put(0, "send", [1, 5], list(second))  # the next message: the first copy lands, the second is queued
    assert queued[0].waits == 1 and queued[1].waits == 0
    got = store.get(0, "send", [0, 1, 3, 5])
    assert queued[1].waits == 1
    for value, want in zip(got, (first[0], second[0], first[3], second[1])):
        assert torch.equal(value, want)
    assert store.present(0, "send", [2]) == [False]
    assert _held_bytes(store) == 4 * 16 * 8 * 2  # each value its own storage, not a view of its message's block


def test_values_cross_without_waiting_only_from_a_gpu_to_host_ram():
    from aqpipe.storage.memory import crosses_to_the_host

    host = [torch.zeros(2, 3), torch.zeros(2, 3)]
    assert not crosses_to_the_host(host, torch.device("cpu"))
    assert not crosses_to_the_host([], torch.device("cpu"))
    meta = [torch.zeros(2, 3, device="meta")]
    assert not crosses_to_the_host(meta, torch.device("cpu"))


@pytest.mark.parametrize("call", ["get", "entries", "items", "value_bytes", "load", "close", "put"])
def test_every_call_that_hands_out_or_replaces_values_lands_the_copy_first(monkeypatch, call):
    """Values still crossing from the GPU are views of a block the copy is still filling: whatever returns them,
    counts their storage, replaces them or ends the store waits for the copy first."""
    queued = _queued_copies(monkeypatch)
    store = MemoryStore(torch.float16)
    store.put(0, "send", [0, 1], list(torch.randn(2, 3).half()))
    assert queued[0].waits == 0
    calls = {"get": lambda: store.get(0, "send", [1]), "entries": store.entries, "items": store.items,
             "value_bytes": store.value_bytes, "load": lambda: store.load({}), "close": store.close,
             "put": lambda: store.put(0, "send", [2], [torch.zeros(3).half()])}
    calls[call]()
    assert queued[0].waits == 1


def test_a_copy_whose_wait_fails_is_waited_for_again():
    """A failed wait (a CUDA error, an interrupt) must not leave the views behind as if they had landed."""
    store = MemoryStore(torch.float16)
    value = torch.ones(3).half()

    class Failing(QueuedCopy):
        def synchronize(self) -> None:
            super().synchronize()
            if self.waits == 1:
                raise RuntimeError("the copy failed")

    copy = Failing()
    store._values[(0, "send", 0)] = value
    store._crossing = ([(0, "send", 0)], [value], copy)
    with pytest.raises(RuntimeError):
        store.get(0, "send", [0])
    assert torch.equal(store.get(0, "send", [0])[0], value) and copy.waits == 2


def test_compact_all_copies_borrowed_rows_together_and_keeps_owned_values():
    from aqpipe.storage.memory import compact_all

    batch = torch.randn(3, 4, 8).half()
    owned = torch.randn(4, 8).half()
    kept = compact_all([*batch.unbind(0), owned])
    assert kept[3] is owned
    for row, value in zip(batch, kept[:3]):
        assert torch.equal(row, value) and value.untyped_storage().nbytes() == value.numel() * 2
        assert value.untyped_storage().data_ptr() != batch.untyped_storage().data_ptr()


def test_host_values_bound_for_a_gpu_are_stacked_into_page_locked_memory_and_copied_without_a_wait(monkeypatch):
    """m(ξ) kept in host RAM for a GPU's codec (the default store on a CUDA run) goes to the GPU as one batch; from
    pageable memory that copy holds the host while the driver stages it, so the batch is stacked into a pinned block
    and copied from there, queued. (On the host: the pinned allocation and the GPU copy are recorded stand-ins.)"""
    from aqpipe.storage.base import StoreView, stacked_on

    pinned, copies = [], []
    real_empty, real_to = torch.empty, torch.Tensor.to

    def empty(*args, pin_memory=False, **kwargs):
        out = real_empty(*args, **kwargs)
        if pin_memory:
            pinned.append(out)
        return out

    def to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            copies.append((self, kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "to", to)
    values = [torch.randn(5, 3).half() for _ in range(4)]
    batch = stacked_on(values, torch.device("cuda"))
    assert len(pinned) == 1 and copies == [(pinned[0], True)] and batch is pinned[0]
    assert torch.equal(batch, torch.stack(values))
    store = MemoryStore(torch.float16)
    store.put(0, "send", [3, 1], values[:2])
    assert torch.equal(StoreView(store, 0, "send").gather([1, 3], torch.device("cuda")), torch.stack(values[1::-1]))
    assert len(pinned) == 2 and len(copies) == 2
    for device in (None, torch.device("cpu")):  # for the host itself: a plain stack, nothing pinned or copied
        assert torch.equal(stacked_on(values, device), torch.stack(values))
    assert len(pinned) == 2 and len(copies) == 2
