"""A damaged m(ξ) on either side of a link is re-seeded at full precision, never used: the sender's own damage
turns the sample into a first sight; the receiver's is found ahead of time and reported back up the link."""

import pytest
import torch

from aqpipe.compress.link.aqsgd import MODE_FULL, AQSGDCodec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.pipeline.links.transport import KIND_ACTIVATION, Header
from aqpipe.storage import StoreView
from aqpipe.storage.lmdb_store import LMDBStore, pack_key, unpack_key
from aqpipe.storage.prefetch import PrefetchingStore
from tests import warm


def _link(tmp_path):
    sender_store = PrefetchingStore(LMDBStore(tmp_path / "sender", "fp16"))
    receiver_store = PrefetchingStore(LMDBStore(tmp_path / "receiver", "fp16"))
    options = QuantOptions()
    sender = AQSGDCodec(3, StoreView(sender_store, 0, "send"), options)
    receiver = AQSGDCodec(3, StoreView(receiver_store, 0, "recv"), options)
    return sender, receiver, sender_store, receiver_store


def _send(sender, receiver, x, ids, compress=True):
    encoded = sender.encode(x, ids, compress)
    header = Header(KIND_ACTIVATION, 0, 0, encoded.shape, encoded.wire_dtype, ids.numel(), encoded.payload.numel(),
                    codec=sender.code, codec_check=encoded.codec_check, flags=encoded.flags)
    return encoded.payload[: ids.numel()].tolist(), receiver.decode(header, encoded.payload, ids)


def _damage(store: PrefetchingStore, sample: int) -> None:
    """Flip a byte of one stored value, as a bad sector would (writes flushed first)."""
    store.flush()
    env = store.backend.env
    with env.begin(write=True) as txn:
        key = pack_key(0, "recv", sample) if txn.get(pack_key(0, "recv", sample)) else pack_key(0, "send", sample)
        raw = bytearray(txn.get(key))
        raw[-3] ^= 0xFF
        txn.put(key, bytes(raw))


def test_receiver_damage_is_reported_back_and_the_sample_goes_in_full(tmp_path):
    sender, receiver, sender_store, receiver_store = _link(tmp_path)
    ids = torch.tensor([3, 4, 5, 6])
    x = torch.randn(4, 8, 16)
    _send(sender, receiver, x, ids, compress=False)  # the warm-up seeds both copies
    modes, _ = _send(sender, receiver, x + 0.1, ids)
    assert modes == [1, 1, 1, 1]
    _damage(receiver_store, 5)
    assert receiver.missing([3, 4, 5, 6]) == [5]  # found before the sender encodes the next step
    assert receiver_store.stats.reseeded == 1
    sender.forget([5])
    modes, out = _send(sender, receiver, x + 0.2, ids)
    assert modes == [1, 1, MODE_FULL, 1]  # the damaged sample went at full precision and seeded both copies again
    assert torch.equal(out[2], x[2] + 0.2)
    sender_store.flush()
    receiver_store.flush()
    send = {i: v for (_, _, i), v in sender_store.items()}
    recv = {i: v for (_, _, i), v in receiver_store.items()}
    assert send.keys() == recv.keys() == {3, 4, 5, 6}
    assert all(torch.equal(send[i], recv[i]) for i in send)
    sender_store.close()
    receiver_store.close()


def test_sender_damage_turns_the_sample_into_a_first_sight(tmp_path):
    sender, receiver, sender_store, receiver_store = _link(tmp_path)
    ids = torch.tensor([1, 2])
    x = torch.randn(2, 4, 8)
    _send(sender, receiver, x, ids, compress=False)
    _damage(sender_store, 2)
    modes, out = _send(sender, receiver, x, ids)
    assert modes == [1, MODE_FULL] and torch.equal(out[1], x[1])
    assert sender_store.stats.reseeded == 1
    sender_store.close()
    receiver_store.close()


def test_nothing_is_reported_while_both_copies_are_sound(tmp_path):
    sender, receiver, sender_store, receiver_store = _link(tmp_path)
    ids = torch.tensor([1, 2, 3])
    _send(sender, receiver, torch.randn(3, 4, 8), ids, compress=False)
    hits = receiver_store.stats.hits
    assert receiver.missing([1, 2, 3]) == [] and receiver.missing([1, 9]) == [9]
    assert receiver_store.stats.hits == hits  # asking ahead is not a lookup
    sender_store.close()
    receiver_store.close()


LOSSLESS_FIRST_SIGHTS = ("--warmup-epochs", "1", "--first-sight", "fp32")  # the paper's: an fp32 first epoch


@pytest.mark.parametrize("schedule,extra", [("gpipe", LOSSLESS_FIRST_SIGHTS), ("1f1b", LOSSLESS_FIRST_SIGHTS),
                                            ("gpipe", ("--warmup-epochs", "0", "--first-sight", "rtq:4"))],
                         ids=["gpipe", "1f1b", "gpipe-coded-first-sight"])
def test_a_live_run_survives_damage_to_a_receivers_store_and_ends_with_identical_copies(tmp_path, schedule, extra):
    """Damage every m(ξ) the receiver of link 0 holds while the run trains (from another process, as a failing
    disk would): the run re-seeds them and finishes, and `aqpipe store verify` finds both copies identical. Under
    1F1B the re-seed request must come after the step's last activation (a late micro-batch of the step may hold
    a sample the next step needs). Re-seeds go losslessly after an fp32 first epoch, and coded with a coded first
    sight (the defaults: rtq:4 from step 1)."""
    import json
    import time

    import lmdb

    out = tmp_path / "run"
    proc = warm.start("launch", "--pp", "3", "--steps", "40", "--seq-len", "16", "--max-samples", "128",
                      "--eval-samples", "16", "--fw", "aqsgd:3", "--store", "lmdb", "--no-progress", "--schedule",
                      schedule, *extra, "--out", str(out))
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 12):  # past the first epoch (8 steps)
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # rank 1 holds the receiver side of link 0 and the sender side of link 1: damage both
    path = out / "store" / "rank-1.lmdb"
    env = lmdb.open(str(path), map_size=(path / "data.mdb").stat().st_size + (64 << 20), sync=True)
    damaged = []
    with env.begin(write=True) as txn:
        for key, value in list(txn.cursor()):
            raw = bytearray(value)
            raw[-3] ^= 0xFF
            txn.put(bytes(key), bytes(raw))
            damaged.append(unpack_key(bytes(key))[:2])
    env.close()
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (0, "recv") in damaged and (1, "send") in damaged
    assert summary["store"]["reseeded"] > 0
    verify = warm.run("store", "verify", str(out))
    assert verify.returncode == 0 and "0 mismatch(es)" in verify.stdout, verify.stdout + verify.stderr
