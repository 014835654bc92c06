"""The slab store (m(ξ) in a GPU's memory, `--store-device cuda`): a message's m(ξ) in one gather and one scatter,
the message store's calls on top, and AQ-SGD on it bit for bit as on the per-sample store. Checked on the host,
where the same code runs (the GPU tests run it on a GPU)."""

from types import SimpleNamespace

import pytest
import torch

from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.pipeline.links.transport import Header
from aqpipe.storage import MemoryStore, SlabStore, StoreView, in_memory, memory_store


def _batch(b: int, seed: int, shape=(6, 8)) -> torch.Tensor:
    return torch.randn((b, *shape), generator=torch.Generator().manual_seed(seed)).half()


def test_a_message_is_read_in_one_gather_and_written_in_one_scatter():
    store = SlabStore(torch.float16, "cpu", rows_hint=8)
    first = _batch(4, 0)
    store.scatter(0, "send", [7, 3, 9, 1], first)
    assert torch.equal(store.gather(0, "send", [1, 9]), first[[3, 2]])
    assert [t.shape for t in (s.rows for s in store._slabs.values())] == [(8, 6, 8)]  # sized from the hint, once
    second = _batch(2, 1)
    store.scatter(0, "send", [3, 5], second)  # one known sample, one new
    assert torch.equal(store.gather(0, "send", [7, 3, 9, 1, 5]), torch.stack([first[0], second[0], first[2],
                                                                              first[3], second[1]]))
    assert store.contains(0, "send", [5, 6]) == [True, False] and store.present(0, "recv", [5]) == [False]
    assert len(store) == 5


def test_a_messages_rows_are_named_in_place_for_a_kernel_to_read():
    """`rows`: the slab itself and the slots of the samples in it — what the fused AQ-SGD kernels read m(ξ) through,
    with no gathered copy — the same values a gather gives; a store without slabs names none."""
    store = SlabStore(torch.float16, "cpu", rows_hint=8)
    first = _batch(4, 0)
    store.scatter(0, "send", [7, 3, 9, 1], first)
    slab, slots = store.rows(0, "send", [1, 9, 7])
    assert slab is store._slabs[(0, "send", (6, 8))].rows and slots.dtype == torch.int64
    assert slots.tolist() == [3, 2, 0] and torch.equal(slab[slots], store.gather(0, "send", [1, 9, 7]))
    view = StoreView(store, 0, "send")
    named = view.slots([3, 1])  # (`slots`: the same, the slots as numbers on the host)
    assert named is not None and named[0] is slab and named[1] == [1, 3]
    assert StoreView(MemoryStore(torch.float16), 0, "send").slots([3]) is None
    with pytest.raises(KeyError, match="no m\\(xi\\) for link 0 side send sample 4"):
        store.rows(0, "send", [1, 4])


def test_what_get_returns_and_what_scatter_was_given_stay_the_callers_own():
    store = SlabStore(torch.float16, "cpu")
    given = _batch(3, 0)
    store.scatter(0, "send", [0, 1, 2], given)
    got = store.get(0, "send", [1])[0]
    given.zero_()  # the caller reuses its buffer (a CUDA graph's output, written again by the next replay)
    store.scatter(0, "send", [1], _batch(1, 5))
    assert torch.equal(got, _batch(3, 0)[1])  # the value read before the later put
    assert torch.equal(store.gather(0, "send", [0, 2]), _batch(3, 0)[[0, 2]])


def test_the_slab_grows_past_its_hint_and_keeps_every_value():
    store = SlabStore(torch.float16, "cpu", rows_hint=2)
    values = _batch(40, 0)
    for start in range(0, 40, 3):
        ids = list(range(start, min(start + 3, 40)))
        store.scatter(0, "recv", ids, values[ids])
    assert torch.equal(store.gather(0, "recv", list(range(40))), values)
    assert store.value_bytes() >= 40 * 6 * 8 * 2


def test_a_deleted_samples_row_is_reused_and_its_value_gone():
    store = SlabStore(torch.float16, "cpu", rows_hint=4)
    store.scatter(0, "send", [0, 1, 2, 3], _batch(4, 0))
    store.delete(0, "send", [1, 99])
    assert store.present(0, "send", [1]) == [False]
    with pytest.raises(KeyError, match="no m\\(xi\\) for link 0 side send sample 1"):
        store.gather(0, "send", [0, 1])
    store.scatter(0, "send", [4], _batch(1, 1))
    assert store._slabs[(0, "send", (6, 8))].rows.shape[0] == 4  # the freed row took the new sample
    assert torch.equal(store.gather(0, "send", [0, 4, 3]), torch.stack([_batch(4, 0)[0], _batch(1, 1)[0],
                                                                        _batch(4, 0)[3]]))


def test_a_sample_twice_in_one_batch_keeps_its_last_row_as_puts_one_after_another_would():
    store, memory = SlabStore(torch.float16, "cpu"), MemoryStore(torch.float16)
    values = _batch(3, 0)
    store.scatter(0, "send", [5, 6, 5], values)
    memory.put(0, "send", [5, 6, 5], list(values))
    assert torch.equal(store.gather(0, "send", [5, 6]), torch.stack(memory.get(0, "send", [5, 6])))


def test_a_sample_kept_again_with_another_shape_moves_and_mixed_shapes_are_named():
    store = SlabStore(torch.float16, "cpu")
    store.scatter(0, "send", [0, 1], _batch(2, 0))
    store.scatter(0, "send", [1], _batch(1, 1, shape=(3, 8)))
    assert torch.equal(store.get(0, "send", [1])[0], _batch(1, 1, shape=(3, 8))[0])
    assert len(store._slabs[(0, "send", (6, 8))].free) > 0  # its old row is free
    with pytest.raises(ValueError, match="different shapes"):
        store.gather(0, "send", [0, 1])


def test_the_hint_sizes_a_link_sides_first_slab_only():
    """The hint is the samples a link side will see: a value shape seen later (were there one) must not take as
    many rows again."""
    store = SlabStore(torch.float16, "cpu", rows_hint=100)
    store.scatter(0, "send", [0], _batch(1, 0))
    store.scatter(0, "send", [1], _batch(1, 1, shape=(3, 8)))
    store.scatter(0, "recv", [0], _batch(1, 2))
    rows = {key: slab.rows.shape[0] for key, slab in store._slabs.items()}
    assert rows == {(0, "send", (6, 8)): 100, (0, "send", (3, 8)): 16, (0, "recv", (6, 8)): 100}


def test_a_value_of_another_dtype_is_refused():
    store = SlabStore(torch.float16, "cpu")
    with pytest.raises(TypeError, match="keeps torch.float16"):
        store.scatter(0, "send", [0], torch.zeros(1, 3))


def test_entries_round_trip_through_load_and_items_name_every_value():
    store = SlabStore(torch.bfloat16, "cpu")
    store.scatter(0, "send", [0, 1], _batch(2, 0).bfloat16())
    store.scatter(1, "recv", [0], _batch(1, 1, shape=(2, 2)).bfloat16())
    entries = store.entries()
    assert set(entries) == {"0/send/0", "0/send/1", "1/recv/0"}
    assert all(v.untyped_storage().nbytes() == v.numel() * 2 for v in entries.values())  # each its own storage
    again = SlabStore(torch.bfloat16, "cpu")
    again.load(entries)
    assert {k: v for k, v in again.entries().items()}.keys() == entries.keys()
    assert all(torch.equal(again.entries()[k], v) for k, v in entries.items())
    assert sorted(key for key, _ in again.items()) == [(0, "send", 0), (0, "send", 1), (1, "recv", 0)]


def test_a_scatter_after_the_gather_of_the_same_samples_reuses_its_index():
    """A message's scatter follows its gather: on a GPU the index would cross to the device twice."""
    store = SlabStore(torch.float16, "cpu")
    store.scatter(0, "send", [2, 4], _batch(2, 0))
    store.gather(0, "send", [2, 4])
    index = store._last[2]
    store.scatter(0, "send", [2, 4], _batch(2, 1))
    assert store._last[2] is index
    store.scatter(0, "send", [4, 2], _batch(2, 1))  # other rows: another index
    assert store._last[2] is not index


def test_m_xi_on_a_gpu_is_kept_as_slabs_and_both_memory_stores_are_checkpointed():
    assert isinstance(memory_store(torch.float16, "cpu"), MemoryStore)
    assert isinstance(memory_store(torch.float16, "meta", 4), MemoryStore)
    assert in_memory(SlabStore(torch.float16, "cpu")) and in_memory(MemoryStore())
    assert not in_memory(SimpleNamespace())


def test_a_checkpoint_keeps_a_slab_stores_m_xi():
    """`collect_state` kept m(ξ) only from the per-sample store: a GPU run's m(ξ) would have been lost on resume."""
    from aqpipe.runtime.checkpoints.resume import collect_state

    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    worker = SimpleNamespace(module=module, optimizer=optimizer,
                             lr_schedule=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                             grad_sync=SimpleNamespace(state_dict=dict),
                             links=SimpleNamespace(codecs=dict, tied_rows=None),
                             device=torch.device("cpu"), scaler=None)
    store = SlabStore(torch.float16, "cpu")
    store.scatter(0, "send", [3], _batch(1, 0))
    assert torch.equal(collect_state(worker, store)["store"]["0/send/3"], _batch(1, 0)[0])


def _link(store_class, first_sight="fp32"):
    ends = []
    for side in ("send", "recv"):
        store = store_class()
        ends.append(build_codec("aqsgd:3", "fw", StoreView(store, 0, side), QuantOptions(), first_sight=first_sight))
    return ends


@pytest.mark.parametrize("first_sight", ["fp32", "rtq:4"])
def test_aqsgd_on_slabs_sends_the_same_bytes_and_keeps_the_same_m_xi(first_sight):
    """Epochs of first sights, deltas, a batch of known and new samples, and a sample too large for fp16: the slab
    store's link sends what the per-sample store's does, byte for byte, and both keep the same m(ξ)."""
    links = {"memory": _link(lambda: MemoryStore(torch.float16), first_sight=first_sight),
             "slab": _link(lambda: SlabStore(torch.float16, "cpu", rows_hint=3), first_sight=first_sight)}
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 16, generator=generator)
    for visit, (ids, compress) in enumerate([([0, 1, 2, 3], False), ([0, 1, 2, 3], True), ([2, 3, 4, 5], True),
                                             ([5, 0, 1, 3], True), ([1], True)]):
        x = x + 0.1 * torch.randn(x.shape, generator=generator)
        batch = x[: len(ids)].clone()
        if visit == 3:
            batch[1, 0, 0] = 1e6  # beyond fp16: sent losslessly, and m(ξ) dropped
        sent = {}
        for name, (sender, receiver) in links.items():
            encoded = sender.encode(batch, torch.tensor(ids), compress=compress)
            out = receiver.decode(Header.for_encoded(encoded, sender.code), encoded.payload, torch.tensor(ids))
            sent[name] = (encoded.payload.clone(), encoded.codec_check, out)
        assert torch.equal(sent["memory"][0], sent["slab"][0]) and sent["memory"][1] == sent["slab"][1]
        assert torch.equal(sent["memory"][2], sent["slab"][2])
    for j in range(2):
        memory, slab = links["memory"][j].view, links["slab"][j].view
        assert memory.present(list(range(6))) == slab.present(list(range(6)))
        held = [i for i, ok in zip(range(6), memory.present(list(range(6)))) if ok]
        assert held and torch.equal(memory.gather(held), slab.gather(held))


def test_a_freed_row_survives_a_scatter_of_known_samples_and_takes_the_next_new_one():
    """A scatter of samples all already kept (every message after the first epoch) emptied the free list: the rows
    of samples dropped since (an overflow, a re-seed) were lost, and the next new sample grew the slab by half."""
    store = SlabStore(torch.float16, "cpu", rows_hint=4)
    store.scatter(0, "send", [0, 1, 2, 3], _batch(4, 0))
    store.delete(0, "send", [2])  # its m(ξ) dropped (overflow) on both sides
    store.scatter(0, "send", [0, 1, 3], _batch(3, 1))  # the steady state: known samples only
    store.scatter(0, "send", [4], _batch(1, 2))
    assert store._slabs[(0, "send", (6, 8))].rows.shape[0] == 4
    assert torch.equal(store.gather(0, "send", [0, 1, 3, 4]), torch.cat([_batch(3, 1), _batch(1, 2)]))


def test_a_scatter_whose_rows_do_not_match_its_samples_is_refused_and_changes_nothing():
    store = SlabStore(torch.float16, "cpu")
    store.scatter(0, "send", [0, 1], _batch(2, 0))
    with pytest.raises(ValueError, match="3 samples but 2 rows"):
        store.scatter(0, "send", [0, 1, 2], _batch(2, 1))
    with pytest.raises(ValueError, match="3 samples but 2 rows"):
        store.scatter(0, "send", [5, 1, 2], _batch(2, 1, shape=(3, 8)))
    assert store.present(0, "send", [0, 1, 2, 5]) == [True, True, False, False]
    assert torch.equal(store.gather(0, "send", [0, 1]), _batch(2, 0))


def test_a_gather_of_no_samples_is_refused_by_name():
    with pytest.raises(ValueError, match="no samples"):
        SlabStore(torch.float16, "cpu").gather(0, "send", [])
