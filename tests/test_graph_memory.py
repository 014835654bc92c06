"""What the codecs' CUDA graphs hold, measured on the meta device: the most a call holds at once plus its inputs'
copies; views and in-place ops on what the call was given count nothing; and every graph a codec really replays is
one its `graph_calls` names, of the same input shapes."""

import math

import pytest
import torch

from aqpipe.compress.gpu import fused
from aqpipe.compress.gpu import graph_memory as gm
from aqpipe.compress.link import aqsgd, sample_coders
from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.pipeline.links.transport import Header
from aqpipe.storage import MemoryStore, SlabStore, StoreView

MB = 1 << 20


def test_a_call_holds_its_inputs_copies_and_the_most_it_had_alive_at_once():
    def twice_plus_one(x):
        doubled = x * 2  # 4 MB
        result = doubled + 1  # 4 MB more: 8 MB held at this point
        del doubled
        return (result.sum(0),)  # 4 kB beside result's 4 MB: less than the 8 MB before

    x = gm.stand_in((1024, 1024), torch.float32)
    # and a part-used segment of each size its blocks came from: 20 MiB (blocks of 1-10 MiB), 2 MiB (the sum's)
    assert gm.held_bytes(gm.GraphCall("f", twice_plus_one, (x,))) == 4 * MB + 8 * MB + 20 * MB + 2 * MB


def test_views_and_in_place_ops_on_what_the_call_was_given_count_nothing():
    def views(x):
        x.add_(1)
        return (x[0], x.view(-1), x.float())  # (float() of a float32 tensor is the tensor itself)

    x = gm.stand_in((256, 1024), torch.float32)
    assert gm.held_bytes(gm.GraphCall("views", views, (x,))) == MB  # the input's copy alone, no segment of its own


def test_blocks_and_segments_are_sized_as_cudas_caching_allocator_sizes_them():
    tiny = gm.stand_in((3,), torch.uint8)
    assert gm.held_bytes(gm.GraphCall("tiny", lambda t: (t + 1,), (tiny,))) == 2 * gm.BLOCK + 2 * MB
    large = gm.stand_in((11 * MB + 1,), torch.uint8)  # from 10 MiB on, blocks are whole 2 MiB units, cut to measure
    assert gm.held_bytes(gm.GraphCall("large", lambda t: (t + 1,), (large,))) == 2 * 12 * MB


def _recording(monkeypatch) -> set:
    """Record (graph name, input shapes and dtypes) of every call the codecs hand to `graphed` outside another such
    call (on a GPU a call inside another's capture becomes part of that graph)."""
    seen = set()
    depth = [0]

    def graphed(key, fn, *tensors, borrow=False):
        if not depth[0]:
            seen.add((key[1], tuple((tuple(t.shape), t.dtype) for t in tensors)))
        depth[0] += 1
        try:
            return fn(*tensors)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(aqsgd, "graphed", graphed)
    monkeypatch.setattr(sample_coders, "graphed", graphed)
    return seen


def _named(calls) -> set:
    return {(c.name, tuple((tuple(t.shape), t.dtype) for t in c.inputs)) for c in calls}


@pytest.mark.parametrize("spec,first_sight", [("aqsgd:3", "fp32"), ("aqsgd:3", "rtq:4"), ("aqsgd:4", "directq:6"),
                                              ("aqsgd-rtq:3", "fp32"), ("aqsgd:3", "bf16")])
def test_the_graphs_an_aqsgd_link_replays_are_those_its_graph_calls_name(monkeypatch, spec, first_sight):
    """A run with a lossless warm-up, then first sights, then deltas: each end replays the graphs it names, no more
    and no fewer, of the same input shapes and dtypes."""
    seen = _recording(monkeypatch)
    shape = (4, 8, 64)
    ends = [build_codec(spec, "fw", StoreView(MemoryStore(torch.float16), 0, side), QuantOptions(),
                        first_sight=first_sight) for side in ("send", "recv")]
    x = torch.randn(shape)
    sent, received = set(), set()
    for visit, compress in enumerate((False, True, True, True)):
        ids = torch.arange(4) + (4 if visit == 1 else 0)  # (the second message: first sights)
        encoded = ends[0].encode(x + 0.01 * visit, ids, compress=compress)
        sent |= seen
        seen.clear()
        ends[1].decode(Header.for_encoded(encoded, ends[0].code), encoded.payload, ids)
        received |= seen
        seen.clear()
    assert sent == _named(ends[0].graph_calls(shape, sending=True, warmup=True))
    assert received == _named(ends[1].graph_calls(shape, sending=False, warmup=True))


def test_a_sender_with_a_first_sight_coder_and_no_warm_up_names_no_lossless_seeds():
    sender = build_codec("aqsgd:3", "fw", StoreView(MemoryStore(torch.float16), 0, "send"), QuantOptions(),
                         first_sight="rtq:4")
    assert "seed" not in {c.name for c in sender.graph_calls((4, 8, 64), sending=True)}
    assert "seed" in {c.name for c in sender.graph_calls((4, 8, 64), sending=True, warmup=True)}


@pytest.mark.parametrize("spec", ["directq:6", "rtq:4", "rtqo:4"])
def test_the_graphs_a_coder_codec_replays_are_those_its_graph_calls_name(monkeypatch, spec):
    seen = _recording(monkeypatch)
    shape = (4, 8, 64)
    codec = build_codec(spec, "bw")
    encoded = codec.encode(torch.randn(shape), torch.arange(4))
    assert seen == _named(codec.graph_calls(shape, sending=True))
    seen.clear()
    codec.decode(Header.for_encoded(encoded, codec.code), encoded.payload, torch.arange(4))
    assert seen == _named(codec.graph_calls(shape, sending=False))


@pytest.mark.parametrize("spec,direction", [("directq:6", "bw"), ("aqsgd:3", "fw")])
def test_stochastic_rounding_replays_no_encode_but_a_receivers_decodes_still_replay(monkeypatch, spec, direction):
    """A replay would repeat an encode's random draws, so a stochastic sender replays nothing; decoding draws
    nothing, so a receiver's coders still replay their decodes."""
    seen = _recording(monkeypatch)
    shape = (4, 8, 64)
    options = QuantOptions(stochastic=True)
    ends = [build_codec(spec, direction, StoreView(MemoryStore(torch.float16), 0, side), options,
                        first_sight="directq:6") if direction == "fw" else build_codec(spec, direction, options=options)
            for side in ("send", "recv")]
    x, received = torch.randn(shape), set()
    for visit in range(3):
        ids = torch.arange(4)
        encoded = ends[0].encode(x + 0.01 * visit, ids)
        assert not seen and ends[0].graph_calls(shape, sending=True, warmup=True) == []
        ends[1].decode(Header.for_encoded(encoded, ends[0].code), encoded.payload, ids)
        received |= seen
        seen.clear()
    assert received and received == _named(ends[1].graph_calls(shape, sending=False, warmup=True))


def test_codecs_that_replay_nothing_name_no_graphs():
    for sending in (True, False):
        assert build_codec("fp32", "fw").graph_calls((4, 8, 64), sending) == []
        assert build_codec("topk:0.1:8", "bw").graph_calls((4, 8, 64), sending) == []


def test_a_graph_two_link_ends_share_is_counted_once():
    """A coder's graphs are named by the coder, not the codec: a rank's forward and backward ends with one coder
    and one shape replay one graph."""
    shape = (4, 64, 64)
    forward, backward = build_codec("rtq:4", "fw"), build_codec("rtq:4", "bw")
    one = gm.graphs_bytes(forward.graph_calls(shape, sending=True))
    assert gm.graphs_bytes(forward.graph_calls(shape, True) + backward.graph_calls(shape, True)) == one
    both = forward.graph_calls(shape, True) + backward.graph_calls(shape, False)  # an encode and a decode: two
    assert gm.graphs_bytes(both) > one


def test_a_calls_count_does_not_depend_on_what_was_counted_before():
    """The caches a call reads (the checksum's position weights, level tables) are made by its first call, which
    no graph captures: not counted, whichever graph is counted first."""
    from aqpipe.compress.link import checksum

    checksum._position_weights.clear()
    sender = build_codec("aqsgd:3", "fw", StoreView(MemoryStore(torch.float16), 0, "send"), QuantOptions())
    seed = next(c for c in sender.graph_calls((8, 128, 576), sending=True) if c.name == "seed")
    assert gm.held_bytes(seed) == gm.held_bytes(seed)


def _delta_step(monkeypatch, switch: str, quantized_by_triton: bool = False) -> None:
    """AQ-SGD's delta step in torch ops ("0"), or fused ("": the default at the shapes of these tests, where
    Triton's kernels import); a test that measures the change quantized by Triton's kernels needs them as well."""
    if (switch == "" or quantized_by_triton) and fused._kernels() is None:
        pytest.skip("Triton is not installed (the README's test command installs triton==3.6.0)")
    monkeypatch.setenv(fused.DELTA_SWITCH, switch)


def test_an_aqsgd_senders_delta_graph_holds_at_least_its_inputs_and_what_it_keeps(monkeypatch):
    _delta_step(monkeypatch, "0")
    shape = (8, 128, 576)
    sender = build_codec("aqsgd:3", "fw", StoreView(MemoryStore(torch.float16), 0, "send"), QuantOptions())
    delta = next(c for c in sender.graph_calls(shape, sending=True) if c.name == "delta-encode")
    values = 8 * 128 * 576
    inputs, new_m = values * (4 + 2), values * 2
    assert gm.held_bytes(delta) >= inputs + new_m + values * 3 // 8  # (and the 3-bit payload)


def test_aqsgds_delta_graphs_hold_no_float32_copy_of_m_and_no_sum_of_their_own(monkeypatch):
    """At SmolLM2's 8 × 1024 × 576 micro-batch (m(ξ) fp16) the delta step in torch ops holds no float32 copy of
    m(ξ) and no sum beside the change, in graphs kept for the run (making m(ξ) float32 and summing it with the
    dequantized change beside that change would hold 4.6 and 3.1 float32 copies of the batch): m(ξ) is read in its
    own dtype and the change takes it in place, with the same bits (tests/test_aqsgd.py and the GPU tests compare them). (Fused, the default at this
    size, the step keeps no graph at all: the next test.) The change itself is quantized by Triton's kernels, as on
    every GPU (a CUDA torch brings Triton): without Triton the torch ops quantize it, and the bounds do not apply."""
    _delta_step(monkeypatch, "0", quantized_by_triton=True)
    shape = (8, 1024, 576)
    bounds = (3.0, 2.6)
    batch = 8 * 1024 * 576 * 4  # one float32 copy
    peaks = {}
    for side, sending, name in (("send", True, "delta-encode"), ("recv", False, "delta-decode")):
        codec = build_codec("aqsgd:3", "fw", StoreView(MemoryStore(torch.float16), 0, side), QuantOptions())
        call = next(c for c in codec.graph_calls(shape, sending) if c.name == name)
        inputs = sum(gm._rounded(t.untyped_storage().nbytes()) for t in call.inputs)
        peaks[name] = (gm.held_bytes(call) - inputs - gm.SMALL_SEGMENT - gm.MID_SEGMENT) / batch
    assert peaks["delta-encode"] <= bounds[0] and peaks["delta-decode"] <= bounds[1], peaks


@pytest.mark.parametrize("shape,fusing", [((8, 1024, 576), True), ((4, 128, 576), False)])
@pytest.mark.parametrize("slabs", [True, False], ids=["slabs", "host-ram"])
def test_a_fused_delta_step_replays_a_graph_only_over_slabs_and_the_plan_counts_it(monkeypatch, shape, fusing, slabs):
    """The fused kernels read m(ξ) where it lies. Over a slab's rows (`--store-device cuda`, written in place) each
    end's step replays one graph, which holds a copy of its index (the slots, then addresses) and its outputs (the
    payload; the verdicts) but no copy of m(ξ), no new m(ξ), no activation and no received rows (read and written
    where they lie, through their addresses); over m(ξ) kept otherwise the kernels run ungraphed and hold nothing.
    By default the step
    is fused from a million values (SmolLM2's 8 × 1024 × 576); below it the torch ops replay their own graphs."""
    _delta_step(monkeypatch, "")
    assert fused.delta_fusable(torch.device("meta"), shape, torch.float16, 3, "channel", "signed") == fusing
    values = math.prod(shape)
    for side, sending, torch_ops, fused_step in (("send", True, "delta-encode", "fused-encode"),
                                                 ("recv", False, "delta-decode", "fused-decode")):
        store = SlabStore(torch.float16, "meta") if slabs else MemoryStore(torch.float16)
        codec = build_codec("aqsgd:3", "fw", StoreView(store, 0, side), QuantOptions())
        calls = {call.name: call for call in codec.graph_calls(shape, sending)}
        assert (torch_ops in calls) == (not fusing) and (fused_step in calls) == (fusing and slabs), calls
        assert "seed" in calls
        if fused_step in calls:
            held = gm.held_bytes(calls[fused_step])
            payload = values * 3 // 8  # (the message the sender's makes; the activation and the rows are not copied)
            if sending:
                assert payload <= held <= payload + values // 2 + gm.MID_SEGMENT + gm.SMALL_SEGMENT, (held, payload)
            else:  # (its small buffers and the part-used segment they are cut from: no copy of the rows)
                assert held < gm.SMALL_SEGMENT + payload // 4, (held, payload)
