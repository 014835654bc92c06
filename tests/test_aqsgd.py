"""AQ-SGD's link codec: first sights (lossless or coded) then deltas, both copies of m(ξ) bit-identical, the checksum,
fidelity, values no store can keep, and one read of the device per message."""


import pytest
import torch

from aqpipe.compress.link.aqsgd import MODE_DELTA, MODE_FIRST, MODE_FULL, MODE_FULL_BF16
from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.sample_coders import sample_coder
from aqpipe.compress.link.specs import CodecError, check_first_sight
from aqpipe.pipeline.links.transport import KIND_ACTIVATION, Header
from aqpipe.storage import MemoryStore, StoreView
from tests.codec_cases import aqsgd_pair, device_reads, send, wire


def test_aqsgd_first_sight_is_full_precision_then_deltas():
    sender, receiver, _, _ = aqsgd_pair(2)
    x = torch.randn(4, 8, 16)
    ids = torch.tensor([10, 11, 12, 13])
    encoded, y = send(sender, receiver, x, ids)
    assert encoded.payload[:4].tolist() == [MODE_FULL] * 4
    assert torch.equal(y, x)  # the receiver computes on the exact activation the first time
    x2 = x + 0.01 * torch.randn_like(x)
    encoded2, y2 = send(sender, receiver, x2, ids)
    assert encoded2.payload[:4].tolist() == [MODE_DELTA] * 4
    per_sample = 2 * 16 + (8 * 16 * 2 + 7) // 8
    assert encoded2.payload.numel() == 4 + 4 * per_sample
    assert (y2 - x2).abs().max() < (x2 - x).abs().max()  # a 2-bit delta is finer than the change itself


@pytest.mark.parametrize("first_sight", ["rtq:4", "rtqo:4", "directq:3", "bf16"])
def test_a_coded_first_sight_seeds_both_copies_from_the_bytes_sent(first_sight):
    options = QuantOptions()
    stores = MemoryStore(torch.float16), MemoryStore(torch.float16)
    sender, receiver = (build_codec("aqsgd:2", "fw", StoreView(store, 0, side), options, first_sight=first_sight)
                        for store, side in zip(stores, ("send", "recv")))
    x, ids = torch.randn(4, 8, 64), torch.tensor([10, 11, 12, 13])
    x[:, :, 5] *= 40.0  # an outlier channel
    encoded, y = send(sender, receiver, x, ids)
    assert encoded.payload[:4].tolist() == [MODE_FIRST] * 4
    coder = sample_coder(check_first_sight(first_sight), options)
    assert encoded.payload.numel() == 4 + 4 * coder.sample_bytes(tuple(x.shape)) < 0.51 * x.numel() * 4
    rows, values = coder.encode(x, values=True)
    assert torch.equal(y, values)  # the receiver computes on what the coder's bytes stand for
    for i in ids.tolist():  # and both sides hold it as m(ξ), bit for bit
        assert torch.equal(stores[0].get(0, "send", [i])[0], stores[1].get(0, "recv", [i])[0])
    assert (y - x).pow(2).sum() < 0.05 * x.pow(2).sum()
    x2 = x + 0.05 * torch.randn_like(x)
    encoded2, y2 = send(sender, receiver, x2, ids)  # the deltas then check out against the seeded copies
    assert encoded2.payload[:4].tolist() == [MODE_DELTA] * 4
    # while not compressing (the warm-up) a first sight stays lossless, and an out-of-range one too
    wide = x.clone()
    wide[0, 0, 0] = 1e6
    encoded3, y3 = send(sender, receiver, wide, torch.tensor([20, 21, 22, 23]))
    assert encoded3.payload[:4].tolist() == [MODE_FULL, MODE_FIRST, MODE_FIRST, MODE_FIRST]
    assert torch.equal(y3[0], wide[0])
    encoded4, _ = send(sender, receiver, x, torch.tensor([30, 31, 32, 33]), compress=False)
    assert encoded4.payload[:4].tolist() == [MODE_FULL] * 4


def test_a_receiver_without_the_senders_first_sight_coder_says_so():
    stores = MemoryStore(torch.float16), MemoryStore(torch.float16)
    sender = build_codec("aqsgd:2", "fw", StoreView(stores[0], 0, "send"), first_sight="rtq:4")
    receiver = build_codec("aqsgd:2", "fw", StoreView(stores[1], 0, "recv"))
    x, ids = torch.randn(2, 4, 64), torch.tensor([1, 2])
    encoded = sender.encode(x, ids)
    with pytest.raises(CodecError, match="no --first-sight coder"):
        receiver.decode(wire(receiver, encoded, ids), encoded.payload, ids)


def test_a_half_precision_activations_lossless_first_sight_travels_in_its_own_dtype():
    sender, receiver, s_store, r_store = aqsgd_pair(3)
    x, ids = torch.randn(2, 8, 16).to(torch.bfloat16), torch.tensor([1, 2])
    encoded, y = send(sender, receiver, x, ids)
    assert encoded.payload[:2].tolist() == [MODE_FULL_BF16] * 2
    assert encoded.payload.numel() == 2 + x.numel() * 2 and torch.equal(y, x.float())
    assert torch.equal(s_store.get(0, "send", [1])[0], r_store.get(0, "recv", [1])[0])


@pytest.mark.parametrize("spec", ["aqsgd:4", "topk:0.1:8", "rtq:0", "gzip"])
def test_a_first_sight_must_be_a_per_sample_coder(spec):
    from aqpipe.compress.link.specs import check_first_sight

    with pytest.raises(CodecError, match="is not a first-sight coder; use fp32, fp16, bf16, directq:B, rtq:B"):
        check_first_sight(spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"stochastic": True}, {"per": "token"},
                                     {"kind": "aqsgd-rtq", "stochastic": True, "first_sight": "rtq:4"},
                                     {"first_sight": "directq:4", "grid": "fit"}, {"first_sight": "rtqo:3"}])
def test_aqsgd_both_copies_stay_bit_identical(dtype, options):
    sender, receiver, s_store, r_store = aqsgd_pair(3, dtype, **options)
    coded_first = options.get("first_sight", "fp32") != "fp32"  # then compress from the first epoch: first sights
    torch.manual_seed(1)
    base = torch.randn(12, 6, 10)
    for epoch in range(5):
        order = torch.randperm(12)
        for chunk in order.split(5):  # different micro-batch compositions every epoch
            drift = base[chunk] + 0.1 * epoch * torch.randn(len(chunk), 6, 10)
            _, y = send(sender, receiver, drift, chunk, compress=epoch > 0 or coded_first)
            got = torch.stack(r_store.get(0, "recv", chunk.tolist()))
            if epoch > 0:
                assert torch.equal(y, got.float())
    sent = dict(s_store.items())
    received = dict(r_store.items())
    assert len(sent) == len(received) == 12
    for (link, side, sample), value in sent.items():
        assert torch.equal(value.view(torch.uint8), received[(link, "recv", sample)].view(torch.uint8))
        assert value.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_aqsgd_reports_how_far_its_deltas_and_its_m_are_from_the_activation(dtype):
    """Over the samples sent as deltas only (not a first sight, not one whose change is beyond an fp16 scale):
    ‖a‖², ‖a − m_old‖² and ‖a − m_new‖² with m_new in the store's dtype, i.e. what the receiver computes on."""
    sender, receiver, sender_store, _ = aqsgd_pair(2, dtype)
    torch.manual_seed(0)
    x = torch.randn(3, 8, 16)
    assert send(sender, receiver, x, torch.tensor([0, 1, 3]))[0].fidelity is None  # first sight: nothing quantized
    m_old = torch.stack(sender_store.get(0, "send", [0, 1])).float()
    x2 = torch.cat([torch.randn(1, 8, 16), x[:2] + 0.3 * torch.randn(2, 8, 16), x[2:]])
    x2[3, 0, 0] = 1e5  # a change no fp16 scale spans: this sample goes in full
    encoded, y = send(sender, receiver, x2, torch.tensor([2, 0, 1, 3]))  # 2: first sight; 0, 1: deltas
    assert encoded.payload[:4].tolist() == [MODE_FULL, MODE_DELTA, MODE_DELTA, MODE_FULL]
    f = encoded.fidelity
    assert f.signal.dtype == torch.float64
    assert float(f.signal) == pytest.approx(float((x2[1:3] ** 2).sum()), rel=1e-5)
    assert float(f.change) == pytest.approx(float(((x2[1:3] - m_old) ** 2).sum()), rel=1e-5)
    assert float(f.error) == pytest.approx(float(((x2[1:3] - y[1:3]) ** 2).sum()), rel=1e-4)  # y: what it got
    assert 0 < float(f.error) < float(f.change)  # nearest rounding on a grid with a zero never adds error
    total = f + f
    assert float(total.change) == pytest.approx(2 * float(f.change))


def test_aqsgd_mixed_first_sight_and_known_samples_in_one_micro_batch():
    sender, receiver, _, _ = aqsgd_pair(4)
    x = torch.randn(3, 5, 7)
    send(sender, receiver, x[:2], torch.tensor([0, 1]))
    encoded, y = send(sender, receiver, x, torch.tensor([0, 1, 2]))
    assert encoded.payload[:3].tolist() == [MODE_DELTA, MODE_DELTA, MODE_FULL]
    assert torch.equal(y[2], x[2])


def test_aqsgd_divergence_is_caught_by_the_checksum():
    sender, receiver, _, r_store = aqsgd_pair(2)
    x, ids = torch.randn(2, 4, 4), torch.tensor([5, 6])
    send(sender, receiver, x, ids)
    r_store.put(0, "recv", [6], [r_store.get(0, "recv", [6])[0] + 1])  # plant a divergence
    encoded = sender.encode(x * 1.1, ids)
    with pytest.raises(CodecError, match="diverged"):
        receiver.decode(wire(sender, encoded, ids), encoded.payload, ids)


def test_a_receiver_checking_late_decodes_deltas_without_reading_the_device_and_refuses_a_divergence_later(
        monkeypatch):
    """On a GPU a receiver checks a delta message's checksum once its sums reach the host (`late_checks`): decoding
    it reads nothing from the device. A divergence planted in its m(ξ) is refused at the next message or when the
    step settles, naming the message it came with. (On a CPU, where reading costs no wait, it checks at once.)"""
    from aqpipe.compress.link.late_checks import LateChecks

    sender, receiver, _, r_store = aqsgd_pair(2)
    assert receiver.late_checks is None  # (a CPU receiver)
    x, ids = torch.randn(2, 4, 8), torch.tensor([5, 6])
    send(sender, receiver, x, ids)  # first sights: whether each is kept is read at once
    reads = device_reads(monkeypatch)

    def decoding_reads(scale):
        encoded = sender.encode(x * scale, ids)  # (the sender reads its verdicts: whether each goes as a delta)
        reads.clear()
        receiver.decode(wire(sender, encoded, ids), encoded.payload, ids)
        return list(reads)

    # checking at once: the two samples' mode bytes and ids (host bytes), then their verdicts (kept, sum) read
    assert sorted(decoding_reads(1.1)) == [("tolist", 2), ("tolist", 2), ("tolist", 4)]
    receiver.late_checks = LateChecks(receiver._verify)
    assert decoding_reads(1.2) == [("tolist", 2), ("tolist", 2)] and len(receiver.late_checks) == 1
    r_store.put(0, "recv", [6], [r_store.get(0, "recv", [6])[0] + 1])  # plant a divergence
    encoded = sender.encode(x * 1.3, ids)
    receiver.decode(wire(sender, encoded, ids, step=3, mb=1), encoded.payload, ids)  # (the check is still to come)
    sender.settle()  # (a sender leaves nothing for later)
    with pytest.raises(CodecError, match="diverged on link 0: .* at step 3 micro-batch 1"):
        receiver.settle()
    assert len(receiver.late_checks) == 0


def test_a_receiver_checking_late_reads_nothing_for_first_sights_and_deltas_and_reads_a_lossless_row_at_once(
        monkeypatch):
    """First sights (rtq:4) and deltas, alone or mixed in one message, are kept whatever their values — the sender
    sent each so only where it could be — so a receiver checking late reads nothing from the device for them; a
    message with a lossless row (a NaN) is read at once, whether the store can keep it deciding. Every check passes,
    and a first-sight message whose checksum was tampered with is refused, naming it."""
    from aqpipe.compress.link.late_checks import LateChecks

    sender, receiver, s_store, r_store = aqsgd_pair(3, first_sight="rtq:4")
    receiver.late_checks = LateChecks(receiver._verify)
    x = torch.randn(4, 8, 16)
    reads = device_reads(monkeypatch)

    def decoding_reads(batch, ids, step=0, tamper=0):
        encoded = sender.encode(batch, ids)
        reads.clear()
        header = wire(sender, encoded, ids, step=step)
        header.codec_check ^= tamper
        receiver.decode(header, encoded.payload, ids)
        return encoded.payload[:len(ids)].tolist(), [n for _, n in reads if n > len(ids)]

    assert decoding_reads(x[:2], torch.tensor([0, 1])) == ([MODE_FIRST] * 2, [])
    scatters = []
    real_scatter = receiver.view.scatter
    monkeypatch.setattr(receiver.view, "scatter", lambda ids, values: (scatters.append(ids), real_scatter(ids, values)))
    assert decoding_reads(x[:3] * 1.1, torch.tensor([0, 1, 2])) == ([MODE_DELTA, MODE_DELTA, MODE_FIRST], [])
    # m(ξ) of the mixed message kept in one call (a host-RAM store's next call waits for the copy the last queued)
    assert scatters == [[0, 1, 2]]
    receiver.settle()  # (the two checks left so far made: what follows reads this message's numbers alone)
    nan = x[:2] * 1.2
    nan[1, 0, 0] = float("nan")
    modes, waited = decoding_reads(nan, torch.tensor([0, 3]))
    assert modes == [MODE_DELTA, MODE_FULL] and waited == [4]  # (read at once: the verdicts of two samples)
    receiver.settle()
    assert len(receiver.late_checks) == 0
    for i in range(4):  # both copies alike (sample 3's NaN kept by neither)
        here = s_store.present(0, "send", [i])
        assert here == r_store.present(0, "recv", [i])
        if here[0]:
            assert torch.equal(s_store.get(0, "send", [i])[0], r_store.get(0, "recv", [i])[0])
    decoding_reads(x[:2] * 1.3, torch.tensor([5, 6]), step=9, tamper=1)  # (new samples: first sights)
    with pytest.raises(CodecError, match="at step 9 micro-batch 0"):
        receiver.settle()


def test_a_divergence_left_for_a_late_check_is_named_by_its_own_message_when_a_later_one_is_read_at_once():
    """A message of deltas leaves its check for later; the next message mixes a new sample in, so it is read at
    once — after the check left for later, which names the message the divergence came with."""
    from aqpipe.compress.link.late_checks import LateChecks

    sender, receiver, _, r_store = aqsgd_pair(2)
    receiver.late_checks = LateChecks(receiver._verify)
    x, ids = torch.randn(3, 4, 8), torch.tensor([5, 6, 7])
    send(sender, receiver, x[:2], ids[:2])
    r_store.put(0, "recv", [6], [r_store.get(0, "recv", [6])[0] + 1])  # plant a divergence
    encoded = sender.encode(x[:2] * 1.1, ids[:2])
    receiver.decode(wire(sender, encoded, ids[:2], step=2, mb=0), encoded.payload, ids[:2])
    encoded = sender.encode(x * 1.2, ids)  # samples 5 and 6 as deltas, 7 a first sight
    with pytest.raises(CodecError, match="at step 2 micro-batch 0"):
        receiver.decode(wire(sender, encoded, ids, step=2, mb=1), encoded.payload, ids)


def test_aqsgd_checksum_can_be_switched_off():
    store = MemoryStore()
    codec = build_codec("aqsgd:2", "fw", StoreView(store, 0, "send"), check=False)
    encoded = codec.encode(torch.randn(1, 2, 2), torch.tensor([0]))
    assert encoded.codec_check == 0


def test_aqsgd_receiver_without_m_for_a_delta_fails_clearly():
    sender, receiver, _, _ = aqsgd_pair(2)
    x, ids = torch.randn(1, 3, 3), torch.tensor([9])
    sender.encode(x, ids)  # the receiver never saw this message
    encoded = sender.encode(x, ids)
    with pytest.raises(CodecError, match="never seen"):
        receiver.decode(wire(sender, encoded, ids), encoded.payload, ids)


def test_aqsgd_refuses_a_message_flagged_raw():
    """AQ-SGD never sends a raw message (its lossless samples travel as modes of its own payload): one flagged raw
    comes from a peer running another codec, and is refused before its payload is read, m(ξ) untouched."""
    aq, _, _, _ = aqsgd_pair(2)
    payload = torch.zeros(2 * 3 * 4 * 4, dtype=torch.uint8)
    header = Header(KIND_ACTIVATION, 0, 0, (2, 3, 4), torch.float32, 2, payload.numel(), codec=aq.code,
                    flags=aq.flags(raw=True))
    assert "raw" in aq.check_header(header)
    with pytest.raises(CodecError, match="raw"):
        aq.decode(header, payload, torch.arange(2))


@pytest.mark.parametrize("poison", [70000.0, float("inf"), float("nan")])
def test_a_value_not_finite_in_the_store_dtype_is_never_stored(poison):
    """One activation above 65504 made an fp16 m(xi) inf, and the receiver computed on inf in every later epoch."""
    sender, receiver, sender_store, receiver_store = aqsgd_pair(3)
    ids = torch.tensor([0, 1, 2])
    x = torch.randn(3, 4, 8)
    encoded, _ = send(sender, receiver, x, ids)  # first sight: both copies seeded
    spiked = x.clone()
    spiked[1, 2, 3] = poison
    encoded, out = send(sender, receiver, spiked, ids)
    assert encoded.payload[:3].tolist() == [MODE_DELTA, MODE_FULL, MODE_DELTA]
    assert sender_store.stats.overflow == 1 and receiver_store.stats.overflow == 0
    assert sender_store.present(0, "send", [0, 1, 2]) == [True, False, True]
    assert receiver_store.present(0, "recv", [0, 1, 2]) == [True, False, True]
    assert torch.allclose(out[1], spiked[1], equal_nan=True, rtol=0, atol=0)  # the activation itself, in full
    encoded, out = send(sender, receiver, x, ids)  # back to normal: a first sight again, stored, finite everywhere
    assert encoded.payload[:3].tolist() == [MODE_DELTA, MODE_FULL, MODE_DELTA] and sender_store.stats.overflow == 1
    assert sender_store.present(0, "send", [0, 1, 2]) == [True, True, True]
    assert torch.equal(out[1], x[1]) and bool(torch.isfinite(out).all())
    for (key, value) in sender_store.items():
        assert torch.equal(value, receiver_store.get(0, "recv", [key[2]])[0]) and bool(torch.isfinite(value).all())


def test_a_delta_whose_sum_would_overflow_goes_in_full_and_is_stored_when_it_fits():
    """m + deQ(Q(a - m)) can leave fp16's range while a itself does not: that sample is sent (and stored) in full."""
    sender, receiver, sender_store, receiver_store = aqsgd_pair(3)
    ids = torch.tensor([4])
    x = torch.full((1, 2, 2), 60000.0)
    send(sender, receiver, x, ids)
    y = x.clone()
    y[0, 0, 0] = 65500.0  # fp16-finite; the 3-bit delta's reconstruction may overshoot
    encoded, out = send(sender, receiver, y, ids)
    kept_send, kept_recv = sender_store.get(0, "send", [4])[0], receiver_store.get(0, "recv", [4])[0]
    assert torch.equal(kept_send, kept_recv) and bool(torch.isfinite(kept_send).all())
    assert bool(torch.isfinite(out).all())


def test_a_value_a_rotated_tile_cannot_carry_goes_losslessly_instead_of_clipping():
    """A tile's scale is an fp16 of its largest rotated value, which can be up to √64 = 8 times the tile's largest:
    a tile whose rotated values pass 65504 would clip, so AQ-SGD sends that sample losslessly, as it does a change an
    fp16 scale cannot span."""
    sender, receiver, s_store, r_store = aqsgd_pair(3, torch.float32, kind="aqsgd-rtq", first_sight="rtq:4")
    x = torch.randn(2, 4, 64)
    x[1] = 10_000.0  # a tile of 10000s: rotated, 80000 in its first position
    encoded, y = send(sender, receiver, x, torch.tensor([7, 8]))
    assert encoded.payload[:2].tolist() == [MODE_FIRST, MODE_FULL]
    assert torch.equal(y[1], x[1])
    x2 = x.clone()
    x2[0] += 9_000.0  # a change no rotated tile carries either
    encoded, y = send(sender, receiver, x2, torch.tensor([7, 8]))
    assert encoded.payload[:2].tolist() == [MODE_FULL, MODE_DELTA] and torch.equal(y[0], x2[0])
    assert torch.equal(s_store.get(0, "send", [7])[0], r_store.get(0, "recv", [7])[0])


def test_a_massive_activation_in_one_channel_goes_as_a_rotated_first_sight():
    """LLMs' residual streams hold a few "massive activations" (SmolLM2-135M: in every sample, beyond 8188 from its
    second stage on). Rotated, one channel's 30000 is ±3750 in each of its tile's 64 positions, well inside an fp16
    scale: the first sight is coded, not sent losslessly for fear of a bound (8 × the tile's largest) it never
    reaches — which sent every first sight of SmolLM2's later links in fp32."""
    sender, receiver, s_store, r_store = aqsgd_pair(3, torch.float32, kind="aqsgd", first_sight="rtq:4")
    x = torch.randn(2, 4, 128)
    x[:, 0, 5] = 30_000.0
    encoded, y = send(sender, receiver, x, torch.tensor([7, 8]))
    assert encoded.payload[:2].tolist() == [MODE_FIRST, MODE_FIRST]
    # rotated tiles use the fit grid: on the signed grid the short side's last level is 7/8 of the scale, so the
    # half of the tile's ±3750 on that side clipped to 3281, and 1/16 of the massive value (1878) came back missing
    # from it and as an error on channel 0 of its tile, an ordinary channel of magnitude about 1
    tile_error = (y[:, 0, :64] - x[:, 0, :64]).abs()
    assert tile_error.max() < 60, tile_error.max()
    assert torch.equal(s_store.get(0, "send", [7])[0], r_store.get(0, "recv", [7])[0])


@pytest.mark.parametrize("first_sight", ["fp32", "rtq:4"])
def test_an_aqsgd_message_reads_its_numbers_from_the_device_once(monkeypatch, first_sight):
    """On a GPU each read of tensor values into Python waits for the GPU. An AQ-SGD encode reads once — which
    samples go as deltas (or first sights) and the m(ξ) checksum sums, together — besides its sample ids (host
    numbers); a decode reads the same once, besides the ids and the mode bytes, which it reads where they arrived.
    (One read per sample for storability, the range check, the checksum and the fidelity's indices would make a
    steady-state message 15-20 reads.)"""
    b = 4
    options = QuantOptions()
    send, recv = MemoryStore(torch.float16), MemoryStore(torch.float16)
    sender = build_codec("aqsgd:3", "fw", StoreView(send, 0, "send"), options, first_sight=first_sight)
    receiver = build_codec("aqsgd:3", "fw", StoreView(recv, 0, "recv"), options, first_sight=first_sight)
    ids = torch.tensor([3, 1, 4, 5])
    x = torch.randn(b, 16, 32)
    for compress in (False, True):  # the first visit seeds m(ξ); the second is all deltas
        encoded = sender.encode(x, ids, compress=compress)
        receiver.decode(Header.for_encoded(encoded, sender.code), encoded.payload, ids)
        x = x + 0.1 * torch.randn_like(x)
    reads = device_reads(monkeypatch)
    encoded = sender.encode(x, ids, compress=True)
    assert reads == [("tolist", b), ("tolist", 2 * b)]  # the ids; the verdicts with the sums
    reads.clear()
    header = Header.for_encoded(encoded, sender.code)
    receiver.decode(header, encoded.payload, ids)
    assert reads == [("tolist", b), ("tolist", b), ("tolist", 2 * b)]  # the mode bytes and the ids (host); one read
