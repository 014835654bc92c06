"""The in-memory m(ξ) store: compact values, the non-finite guard, and the up-front RAM check."""

import torch

from aqpipe.cli import main
from aqpipe.storage import MemoryStore


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
