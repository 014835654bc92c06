"""Link codecs: specs, wire round trips, per-sample payloads, AQ-SGD's two copies of m(ξ), Top-k."""

import threading

import pytest
import torch

from aqpipe.compress.link.aqsgd import MODE_DELTA, MODE_FIRST, MODE_FULL, MODE_FULL_BF16
from aqpipe.compress.link.codecs import FLAG_RAW, CodecError, QuantOptions, build_codec, parse_spec
from aqpipe.compress.link.sample_coders import sample_coder
from aqpipe.compress.link.specs import CODEC_KINDS
from aqpipe.compress.quantize import dequantize, quantize
from aqpipe.compress.rotated import ROTATED_GRID, rotated_dequantize, rotated_quantize
from aqpipe.pipeline.transport import KIND_ACTIVATION, Header
from aqpipe.storage import MemoryStore, StoreView


def wire(codec, encoded, ids, step=0, mb=0):
    """The header a sender would put in front of `encoded`."""
    return Header(KIND_ACTIVATION, step, mb, encoded.shape, encoded.wire_dtype, ids.numel(), encoded.payload.numel(),
                  codec=codec.code, codec_check=encoded.codec_check, flags=encoded.flags)


def send(sender, receiver, x, ids, compress=True):
    encoded = sender.encode(x, ids, compress)
    header = wire(sender, encoded, ids)
    assert receiver.check_header(header) is None
    return encoded, receiver.decode(header, encoded.payload.clone(), ids)


def aqsgd_pair(bits, dtype=torch.float16, kind="aqsgd", first_sight="fp32", **options):
    sender_store, receiver_store = MemoryStore(dtype), MemoryStore(dtype)
    opts = QuantOptions(**options)
    return (build_codec(f"{kind}:{bits}", "fw", StoreView(sender_store, 0, "send"), opts, first_sight=first_sight),
            build_codec(f"{kind}:{bits}", "fw", StoreView(receiver_store, 0, "recv"), opts, first_sight=first_sight),
            sender_store, receiver_store)


@pytest.mark.parametrize("spec,direction,parsed", [
    ("aqsgd:2", "fw", ("aqsgd", 2, 1.0)), ("directq:8", "bw", ("directq", 8, 1.0)),
    ("topk:0.2:8", "bw", ("topk", 8, 0.2)), ("bf16", "fw", ("bf16", 0, 1.0)),
])
def test_specs_parse(spec, direction, parsed):
    p = parse_spec(spec, direction)
    assert (p.kind, p.bits, p.fraction) == parsed and str(p) == spec


@pytest.mark.parametrize("spec,direction", [("aqsgd:0", "fw"), ("aqsgd:9", "fw"), ("topk:1.5:8", "bw"),
                                            ("gzip", "fw"), ("aqsgd:2", "bw"), ("topk:0.1:4", "fw")])
def test_bad_specs(spec, direction):
    with pytest.raises(CodecError):
        parse_spec(spec, direction)


@pytest.mark.parametrize("spec", ["fp32", "fp16", "bf16", "directq:1", "directq:3", "directq:8", "rtq:3", "rtq:4"])
def test_stateless_codecs_round_trip_within_their_precision(spec):
    codec = build_codec(spec)
    x = torch.randn(3, 16, 32)
    encoded, y = send(codec, build_codec(spec), x, torch.arange(3))
    assert y.dtype == torch.float32 and y.shape == x.shape
    if spec == "fp32":
        assert torch.equal(y, x)
    elif spec in ("fp16", "bf16"):
        assert torch.allclose(y, x, rtol=1e-2, atol=1e-2)
    elif spec.startswith("rtq"):
        bits = int(spec.split(":")[1])  # the rotated quantizer's reconstruction (its tests bound it)
        assert torch.equal(y, rotated_dequantize(rotated_quantize(x, bits, grid=ROTATED_GRID), tuple(x.shape)))
        assert encoded.payload.numel() == 3 * (2 * 16 + (16 * 32 * bits + 7) // 8)  # a scale per token: one 32-tile
    else:
        bits = int(spec.split(":")[1])  # exactly the quantizer's reconstruction on the default grid (its tests bound it)
        assert torch.equal(y, dequantize(quantize(x, bits), tuple(x.shape)))
        assert encoded.payload.numel() == 3 * (2 * 32 + (16 * 32 * bits + 7) // 8)


def test_uncompressed_sends_are_raw_fp32_for_every_codec():
    x = torch.randn(2, 4, 8)
    for spec in ("fp16", "directq:2", "topk:0.1:4", "rtq:3"):
        codec = build_codec(spec, "bw" if spec.startswith("topk") else "fw")
        encoded = codec.encode(x, torch.arange(2), compress=False)
        assert encoded.flags & FLAG_RAW and encoded.payload.numel() == x.numel() * 4
        assert torch.equal(codec.decode(wire(codec, encoded, torch.arange(2)), encoded.payload, torch.arange(2)), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lossless_messages_carry_a_half_precision_tensor_in_its_own_dtype(dtype):
    """A mixed-precision stage's activation crosses the fp32 codec (and any codec's raw message) bit for bit, at 2
    bytes per value, and arrives in its own dtype; the fp16/bf16 codecs still cast; a raw header of another dtype or
    length is refused before allocation."""
    x, ids = torch.randn(2, 4, 8).to(dtype), torch.arange(2)
    for codec, compress in ((build_codec("fp32", "fw"), True), (build_codec("directq:4", "fw"), False)):
        encoded, out = send(codec, codec, x, ids, compress)
        assert encoded.payload.numel() == x.numel() * 2 and out.dtype == dtype and torch.equal(out, x)
    cast = build_codec("bf16" if dtype == torch.float16 else "fp16", "fw")
    _, out = send(cast, cast, x, ids)
    assert out.dtype == torch.float32
    codec = build_codec("fp32", "fw")
    encoded = codec.encode(x, ids, compress=False)
    bad = Header(KIND_ACTIVATION, 0, 0, encoded.shape, torch.int64, 2, encoded.payload.numel(), codec=codec.code,
                 flags=encoded.flags)
    assert "raw message must be" in codec.check_header(bad)
    short = Header(KIND_ACTIVATION, 0, 0, encoded.shape, dtype, 2, encoded.payload.numel() - 2, codec=codec.code,
                   flags=encoded.flags)
    assert "does not match" in codec.check_header(short)


@pytest.mark.parametrize("spec", ["directq:3", "topk:0.25:4", "rtq:4"])
def test_a_sample_payload_does_not_depend_on_its_micro_batch(spec):
    torch.manual_seed(0)
    a, b, c = torch.randn(3, 1, 8, 16).unbind(0)
    codec = build_codec(spec, "bw" if spec.startswith("topk") else "fw")
    one = codec.encode(torch.cat([a, b]), torch.tensor([1, 2])).payload.view(2, -1)
    two = codec.encode(torch.cat([c * 50, a]), torch.tensor([3, 1])).payload.view(2, -1)
    assert torch.equal(one[0], two[1])


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
    coder = sample_coder(first_sight, options)
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


def test_header_checks_reject_a_mismatched_codec_or_length():
    sender = build_codec("directq:4")
    encoded = sender.encode(torch.randn(2, 3, 4), torch.arange(2))
    header = wire(sender, encoded, torch.arange(2))
    assert "this side decodes directq:2" in build_codec("directq:2").check_header(header)
    header.payload_len += 1
    assert "does not match" in sender.check_header(header)
    aq, _, _, _ = aqsgd_pair(2)
    header = Header(KIND_ACTIVATION, 0, 0, (2, 3, 4), torch.uint8, 2, 10**6, codec=aq.code, flags=aq.flags())
    assert "outside" in aq.check_header(header)


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


@pytest.mark.parametrize("fraction,n", [(0.2, 8 * 16), (0.01, 100_000), (1.0, 64)])
def test_topk_keeps_the_largest_entries_of_each_sample(fraction, n):
    codec = build_codec(f"topk:{fraction}:8", "bw")
    torch.manual_seed(0)
    g = torch.randn(3, n)
    _, y = send(codec, build_codec(f"topk:{fraction}:8", "bw"), g, torch.arange(3))
    k = max(1, int(-(-fraction * n // 1)))
    for row, out in zip(g, y):
        top = row.abs().topk(k).indices
        assert int((out != 0).sum()) <= k and set(out.nonzero().flatten().tolist()) <= set(top.tolist())
        assert torch.allclose(out[top], row[top], atol=float(row.abs().max()) / 100)


def test_topk_position_format_is_the_smaller_one():
    from aqpipe.compress.link.topk import position_format

    assert position_format(1000, 200)[0] == "bitmap"
    assert position_format(1000, 10) == ("int16", 20)
    assert position_format(100_000, 10) == ("int32", 40)


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


def test_a_non_finite_activation_is_reported_naming_step_stage_and_sample(capsys):
    from aqpipe.pipeline.worker import finite_rows, report_nonfinite

    x = torch.randn(3, 4)
    assert report_nonfinite([(finite_rows(x), torch.tensor([10, 11, 12]))], 4, 1) == []
    assert capsys.readouterr().err == ""
    y = x.clone()
    y[2, 1] = float("nan")
    # the sends of one step are read together: each send's rows with its own sample ids
    assert report_nonfinite([(finite_rows(x), torch.tensor([1, 2, 3])), (finite_rows(y), torch.tensor([10, 11, 12]))],
                            4, 1) == [12]
    err = capsys.readouterr().err
    assert "step 5, stage 1" in err and "[12]" in err and "not finite" in err


def test_a_generator_state_from_another_device_type_is_not_forced_on_the_codec():
    """A resume may move a run between the host and a GPU: a saved stochastic-rounding state of another kind (another
    size) leaves the codec on its own seed; one of the same kind is restored."""
    from aqpipe.compress.link.codecs import QuantOptions, build_codec

    codec = build_codec("directq:4", "fw", options=QuantOptions(stochastic=True, seed=1))
    same = build_codec("directq:4", "fw", options=QuantOptions(stochastic=True, seed=2))
    same.load_state_dict(codec.state_dict())
    assert torch.equal(same._generator.get_state(), codec._generator.get_state())
    before = same._generator.get_state()
    same.load_state_dict({"generator": torch.zeros(16, dtype=torch.uint8)})  # a CUDA generator's (Philox) state
    assert torch.equal(same._generator.get_state(), before)


@pytest.mark.parametrize("kind", list(CODEC_KINDS))
def test_every_codec_of_the_table_builds_round_trips_and_sizes_its_messages(kind):
    """The name table is all a codec needs: its entry builds it, sizes its messages exactly and says what it can
    do."""
    from aqpipe.compress.link.codecs import message_bytes
    from aqpipe.compress.link.specs import check_first_sight, usage

    entry = CODEC_KINDS[kind]
    spec, direction = usage(kind).replace("F", "0.25").replace("B", "4"), entry.directions[0]
    torch.manual_seed(0)
    x, ids = torch.randn(3, 8, 64), torch.tensor([4, 5, 6])
    views = [StoreView(MemoryStore(torch.float16), 0, side) if entry.keeps_messages else None
             for side in ("send", "recv")]
    sender, receiver = (build_codec(spec, direction, view, first_sight="rtq:3") for view in views)
    assert sender.keeps_messages == entry.keeps_messages
    first, y = send(sender, receiver, x, ids)
    kept = 0.8 if kind == "topk" else 0.1  # top-k drops three quarters of the values, the largest kept
    assert y.shape == x.shape and (y - x).pow(2).sum() < kept * x.pow(2).sum()
    if entry.keeps_messages:  # a first sight (here rtq:3), then a delta
        assert first.payload.numel() == message_bytes(spec, direction, tuple(x.shape), x.dtype, QuantOptions(),
                                                      "rtq:3", first_sights=True)
        first, _ = send(sender, receiver, x + 0.01, ids)
    sized = message_bytes(spec, direction, tuple(x.shape), x.dtype, QuantOptions())
    if kind == "tahq":  # sized with no tile rotated: each rotated one adds a 6-bit pivot
        assert sized <= first.payload.numel() <= sized + 3 * 8 * 6 // 8
    else:
        assert first.payload.numel() == sized
    if entry.first_sight:
        check_first_sight(spec)
    else:
        with pytest.raises(CodecError):
            check_first_sight(spec)


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


@pytest.mark.parametrize("spec", ["aqsgd:3", "rtq:4", "directq:4"])
def test_a_header_that_is_no_batch_of_samples_is_refused_in_words(spec):
    codec = build_codec(spec, "fw", StoreView(MemoryStore(torch.float16), 0, "recv") if "aqsgd" in spec else None)
    for shape, n_ids, needle in [((), 0, "a sample dimension and more"), ((4,), 4, "a sample dimension and more"),
                                 ((4, 0, 8), 4, "a sample dimension and more"), ((4, 2, 8), 3, "4 samples but 3")]:
        header = Header(KIND_ACTIVATION, 0, 0, shape, torch.uint8, n_ids, 64, codec=codec.code, flags=codec.flags())
        problem = codec.check_header(header)
        assert problem is not None and needle in problem, (shape, problem)


@pytest.mark.parametrize("spec,compress", [("fp32", True), ("fp32", False), ("directq:4", False), ("bf16", True)])
def test_a_message_never_aliases_the_tensor_it_was_encoded_from(spec, compress):
    """The link's writer thread reads a message's bytes after `send` returns; a payload that was the caller's own
    tensor (fp32 of an fp32 activation, any raw warm-up message) would go out with whatever the caller wrote since."""
    x = torch.randn(2, 3, 4)
    encoded = build_codec(spec, "fw").encode(x, torch.arange(2), compress)
    before = encoded.payload.clone()
    x.mul_(2)
    assert torch.equal(encoded.payload, before)


def _reads(monkeypatch) -> list[tuple[str, int]]:
    """Every read of tensor values into Python (what makes a host wait for a GPU), as (how, elements)."""
    seen: list[tuple[str, int]] = []
    for how in ("tolist", "item", "__bool__", "__float__", "__int__", "nonzero"):
        real = getattr(torch.Tensor, how)

        def spy(self, *args, _real=real, _how=how, **kwargs):
            if threading.current_thread() is threading.main_thread():  # (another test's lingering thread is not ours)
                seen.append((_how, self.numel()))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, how, spy)
    return seen


def _device_moves(monkeypatch, reads: list, module) -> list[int]:
    """Each time a codec hands values to the device (`to_device`, from the codecs module or `module`'s own import),
    how many reads `_reads` had seen by then."""
    from aqpipe.compress.link import codecs

    moved: list[int] = []
    real = codecs.to_device

    def spy(values, device):
        moved.append(len(reads))
        return real(values, device)

    for where in (codecs, module):
        monkeypatch.setattr(where, "to_device", spy, raising=False)
    return moved


@pytest.mark.parametrize("first_sight", ["fp32", "rtq:4"])
def test_an_aqsgd_message_reads_its_numbers_from_the_device_once(monkeypatch, first_sight):
    """On a GPU each read of tensor values into Python waits for the GPU. An AQ-SGD encode reads once — which
    samples go as deltas (or first sights) and the m(ξ) checksum sums, together — besides its sample ids (host
    numbers); a decode reads the same once, besides the ids and the mode bytes, which it reads where they arrived.
    Before, a steady-state message read 15-20 times (one per sample for storability, the range check, the
    checksum, the fidelity's indices…)."""
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
    reads = _reads(monkeypatch)
    encoded = sender.encode(x, ids, compress=True)
    assert reads == [("tolist", b), ("tolist", 2 * b)]  # the ids; the verdicts with the sums
    reads.clear()
    header = Header.for_encoded(encoded, sender.code)
    receiver.decode(header, encoded.payload, ids)
    assert reads == [("tolist", b), ("tolist", b), ("tolist", 2 * b)]  # the mode bytes and the ids (host); one read


def _topk_message(fraction: float):
    """A top-k codec, one gradient message of 3 samples of 8 × 16 and its header (0.25: a bitmap; 0.05: int16)."""
    from aqpipe.compress.link.topk import kept, position_format

    codec = build_codec(f"topk:{fraction}:4", "bw")
    torch.manual_seed(0)
    encoded = codec.encode(torch.randn(3, 8, 16), torch.arange(3), True)
    fmt = position_format(128, kept(128, fraction))[0]
    return codec, encoded.payload.clone(), Header.for_encoded(encoded, codec.code), fmt


@pytest.mark.parametrize("fraction,fmt", [(0.25, "bitmap"), (0.05, "int16")])
def test_topk_refuses_positions_that_cannot_be_a_top_k(fraction, fmt):
    codec, payload, header, got = _topk_message(fraction)
    assert got == fmt
    if fmt == "bitmap":
        payload[2] ^= 0xFF  # the first sample's first 8 positions flipped: no longer k marks
        needle = "does not mark exactly"
    else:
        payload.view(3, -1)[1, 2:4] = torch.tensor([0xFF, 0x7F], dtype=torch.uint8)  # position 32767 of 128
        needle = "outside the tensor"
    with pytest.raises(CodecError, match=needle):
        codec.decode(header, payload, torch.arange(3))


@pytest.mark.parametrize("fraction", [0.25, 0.05])
def test_topk_checks_positions_on_the_bytes_as_they_arrived(monkeypatch, fraction):
    """A message's bytes arrive on the host; read there, the positions (a bitmap's marks found with `nonzero`) and
    their check cost no wait, while on the stage's GPU (where they were read before) they made the host wait for
    the GPU on every gradient message."""
    from aqpipe.compress.link import topk

    codec, payload, header, _ = _topk_message(fraction)
    expected = codec.decode(header, payload, torch.arange(3))
    reads = _reads(monkeypatch)
    moved = _device_moves(monkeypatch, reads, topk)
    assert torch.equal(codec.decode(header, payload, torch.arange(3)), expected)
    assert reads and moved[0] == len(reads)  # every read came before the bytes were handed to the device

