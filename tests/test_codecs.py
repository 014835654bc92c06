"""Link codecs: specs, wire round trips, per-sample payloads, header checks, every codec of the table, Top-k (AQ-SGD's
own: tests/test_aqsgd.py)."""


import pytest
import torch

from aqpipe.compress.link.codes import FLAG_RAW
from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CODEC_KINDS, CodecError, parse_spec
from aqpipe.compress.quantize import dequantize, quantize
from aqpipe.compress.rotated import ROTATED_GRID, rotated_dequantize, rotated_quantize
from aqpipe.pipeline.links.transport import KIND_ACTIVATION, Header
from aqpipe.storage import MemoryStore, StoreView
from tests.codec_cases import aqsgd_pair, device_moves, device_reads, send, wire


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


def test_a_non_finite_activation_is_reported_naming_step_stage_and_sample(capsys):
    from aqpipe.pipeline.execution.worker import finite_rows, report_nonfinite

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
    from aqpipe.compress.link.factory import build_codec
    from aqpipe.compress.link.options import QuantOptions

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
    from aqpipe.compress.link.factory import message_bytes
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
    reads = device_reads(monkeypatch)
    moved = device_moves(monkeypatch, reads, topk)
    assert torch.equal(codec.decode(header, payload, torch.arange(3)), expected)
    assert reads and moved[0] == len(reads)  # every read came before the bytes were handed to the device

