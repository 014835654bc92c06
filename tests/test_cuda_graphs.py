"""When a codec's kernels run op by op and when they replay a graph: the cache's rules, checked on the host with a
stand-in capture (the `stand_in` fixture, tests/conftest.py; the GPU tests replay real CUDA graphs and compare their
bits with op by op). tests/test_cuda_graphs_in_place.py has the tensors a graph does not copy."""

import logging
from types import SimpleNamespace

import pytest
import torch

from aqpipe.compress.gpu import cuda_graphs
from aqpipe.compress.gpu.cuda_graphs import graphed


class Counted:
    """A pure function that counts its op-by-op runs."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, y):
        self.calls += 1
        return x * 2 + y, (x - y).sum(dim=1)


def test_the_first_call_runs_op_by_op_the_second_captures_and_later_ones_replay(stand_in):
    fn = Counted()
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    first = graphed("k", fn, x, y)
    assert fn.calls == 1 and not stand_in
    second = graphed("k", fn, x + 1, y)
    assert len(stand_in) == 1 and stand_in[0].replays == 1
    calls = fn.calls
    third = graphed("k", fn, x - 1, y)
    assert fn.calls == calls + 1 and stand_in[0].replays == 2  # one run: the replay itself, no capture again
    for got, inputs in ((first, (x, y)), (second, (x + 1, y)), (third, (x - 1, y))):
        for a, b in zip(got, fn(*inputs)):
            assert torch.equal(a, b)
    assert cuda_graphs.captured() == 1


def test_a_host_tensor_given_beside_gpu_tensors_reaches_fn_on_the_gpu_on_every_path(stand_in):
    """A host tensor is fed: op by op (the first call), in the capture and in every replay `fn` gets it on the GPU,
    and the graph's buffer for it lies there (the meta device stands in for a GPU: a device that is not the host)."""
    seen = []

    def fn(x, y):
        seen.append((x.device, y.device))
        return (x + y,)

    gpu = torch.device("meta")
    for k in range(4):
        out = graphed("fed", fn, torch.full((4, 3), float(k)), torch.empty(4, 3, device=gpu))
        assert out[0].device == gpu
    assert len(seen) >= 4 and set(seen) == {(gpu, gpu)}
    assert len(stand_in) == 1 and stand_in[0].replays == 3 and stand_in[0].inputs[0].device == gpu
    held = torch.empty(2, 3, device=gpu)  # (a held call's first run, on copies of its inputs, gets them there too)
    for _ in range(3):
        graphed("fed-held", lambda x, slab: fn(x, slab[0])[:1], torch.ones(2, 3), held=(held,))
    assert len(seen) >= 7 and set(seen) == {(gpu, gpu)} and len(stand_in) == 2


def test_what_a_replay_returns_is_the_callers_own(stand_in):
    fn = Counted()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    for _ in range(2):
        graphed("k", fn, x, y)
    kept = graphed("k", fn, x, y)
    expected = [t.clone() for t in kept]
    graphed("k", fn, x * 3, y)  # the next replay writes the graph's outputs again
    assert all(torch.equal(a, b) for a, b in zip(kept, expected))
    kept[0].zero_()  # and writing what was returned leaves the graph's buffers alone
    assert not torch.equal(stand_in[0].outputs[0], kept[0])


def test_each_key_shape_and_dtype_gets_its_own_graph(stand_in):
    fn = Counted()
    calls = [("a", torch.randn(2, 4)), ("b", torch.randn(2, 4)), ("a", torch.randn(3, 4)),
             ("a", torch.randn(2, 4, dtype=torch.float64)), ("a", torch.randn(4, 2).t())]
    for key, x in calls:
        for _ in range(2):
            graphed(key, fn, x, x)
    assert len(stand_in) == len(calls) == cuda_graphs.captured()


def test_a_capture_that_fails_turns_graphs_off_for_the_process_with_one_warning(stand_in, monkeypatch, caplog):
    fn = Counted()
    x = torch.randn(2, 3)
    for _ in range(3):
        graphed("kept", fn, x, x)  # a graph made before the failure
    replays = stand_in[0].replays

    def failing(fn, tensors, held=()):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "_capture", failing)
    with caplog.at_level(logging.WARNING, logger="aqpipe.compress.gpu.cuda_graphs"):
        results = [graphed(key, fn, x, x) for key in ("k", "k", "k", "other", "other", "kept")]
    assert len(stand_in) == 1 and stand_in[0].replays == replays  # the earlier graph is not replayed again either
    assert cuda_graphs.stopped() == "a capture failed: every graphed call runs op by op"
    assert [r.message for r in caplog.records if "capture of k failed" in r.message] and len(caplog.records) == 1
    assert all(torch.equal(r[0], x * 3) for r in results)


def test_the_switch_turns_every_graph_off(stand_in, monkeypatch):
    monkeypatch.setenv(cuda_graphs.SWITCH, "0")
    fn = Counted()
    for _ in range(3):
        graphed("k", fn, torch.ones(2, 2), torch.ones(2, 2))
    assert fn.calls == 3 and not stand_in


def test_a_graphed_call_inside_a_capture_becomes_part_of_it(stand_in):
    inner = Counted()

    def outer(x, y):
        a, b = graphed("inner", inner, x, y)
        return a + 1, b

    x = torch.randn(2, 3)
    for _ in range(4):
        graphed("outer", outer, x, x)
    assert len(stand_in) == 1  # the outer one only: the inner calls ran inline in it
    assert cuda_graphs.captured() == 1


def test_past_the_limit_new_signatures_run_op_by_op_with_one_warning(stand_in, monkeypatch, caplog):
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 2)
    fn = Counted()
    with caplog.at_level(logging.WARNING, logger="aqpipe.compress.gpu.cuda_graphs"):
        for n in range(1, 3):
            for _ in range(3):
                graphed("k", fn, torch.ones(n, 2), torch.ones(n, 2))
        assert cuda_graphs.stopped() is None  # (at the limit, not past it: no signature has been turned away)
        for n in range(3, 5):
            for _ in range(3):
                graphed("k", fn, torch.ones(n, 2), torch.ones(n, 2))
    assert cuda_graphs.captured() == 2 and len(stand_in) == 2
    assert len([r for r in caplog.records if "graphs held" in r.message]) == 1
    assert cuda_graphs.stopped() == "2 graphs held: a signature not among them runs op by op"


def test_graphs_dropped_below_the_limit_are_captured_again_and_no_longer_reported_stopped(stand_in, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 2)
    fn = Counted()
    for owner, n in (("a", 1), ("b", 2), ("c", 3)):  # the third turned away
        for _ in range(3):
            graphed((owner, "step"), fn, torch.ones(n, 2), torch.ones(n, 2))
    assert cuda_graphs.stopped() is not None and cuda_graphs.captured() == 2
    cuda_graphs.forget("a")  # (a codec that ends)
    assert cuda_graphs.stopped() is None
    for _ in range(3):
        graphed(("d", "step"), fn, torch.ones(4, 2), torch.ones(4, 2))
    assert cuda_graphs.captured() == 2 and len(stand_in) == 3  # the new signature was captured


def test_forget_drops_the_graphs_of_one_owner(stand_in):
    fn = Counted()
    for key in (("a", "encode"), ("a", "decode"), ("b", "encode")):
        for _ in range(2):
            graphed(key, fn, torch.ones(2, 2), torch.ones(2, 2))
    cuda_graphs.forget("a")
    assert cuda_graphs.captured() == 1
    graphed(("a", "encode"), fn, torch.ones(2, 2), torch.ones(2, 2))  # seen again from the start: op by op first
    assert len(stand_in) == 3


def _aqsgd_link(options):
    from aqpipe.compress.link.factory import build_codec
    from aqpipe.storage import MemoryStore, StoreView

    return (build_codec("aqsgd:3", "fw", StoreView(MemoryStore(torch.float16), 0, "send"), options,
                        first_sight="rtq:4"),
            build_codec("aqsgd:3", "fw", StoreView(MemoryStore(torch.float16), 0, "recv"), options,
                        first_sight="rtq:4"))


def _visit(sender, receiver, x, ids):
    from aqpipe.pipeline.links.transport import Header

    encoded = sender.encode(x, ids, compress=True)
    return encoded, receiver.decode(Header.for_encoded(encoded, sender.code), encoded.payload, ids)


def test_aqsgd_captures_its_cores_but_never_with_stochastic_rounding(stand_in):
    """AQ-SGD graphs its first-sight and delta arithmetic on both ends; with stochastic rounding no encode is ever
    graphed (a replay would repeat the random draws); a codec that is dropped takes its graphs with it."""
    import gc

    from aqpipe.compress.link.options import QuantOptions

    x = torch.randn(4, 8, 16)
    ids = torch.arange(4)
    link = _aqsgd_link(QuantOptions(stochastic=True))
    for visit in range(4):
        _visit(*link, x + visit, ids)
    assert not [s for s in cuda_graphs._cache.graphs if "encode" in str(s[0])]  # (decoding draws nothing)
    link = _aqsgd_link(QuantOptions())
    for visit in range(4):
        for start in (0, 4, 8):  # three first sights of one shape, then deltas
            _visit(*link, x + visit, ids + start)
    kinds = {signature[0][1] for signature in cuda_graphs._cache.graphs}
    assert {"first-encode", "delta-encode", "delta-decode"} <= kinds
    del link
    gc.collect()
    assert not [s for s in cuda_graphs._cache.graphs if isinstance(s[0][0], str) and s[0][0].startswith("aqsgd")]


def test_tensors_on_two_devices_run_op_by_op(stand_in, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_replays_on", lambda device: device.type == "cpu")
    calls = []

    def fn(x, y):
        calls.append(1)
        return (x * 2,)

    for _ in range(3):
        graphed("k", fn, torch.ones(2, 2), torch.ones(2, 2, device="meta"))
    assert len(calls) == 3 and not stand_in


def test_on_the_host_the_function_just_runs():
    fn = Counted()
    for _ in range(3):
        graphed("k", fn, torch.ones(2, 2), torch.ones(2, 2))
    assert fn.calls == 3 and cuda_graphs.captured() == 0


def test_a_codec_finalized_during_a_capture_does_not_deadlock(stand_in, monkeypatch):
    """A garbage collection inside a capture (which holds the cache's lock) may run a dropped codec's `forget`."""
    import threading

    capture = cuda_graphs._capture

    def collecting(fn, tensors, held=()):
        cuda_graphs.forget("a-dropped-codec")  # what a finalizer run by the collector here would do
        return capture(fn, tensors, held)

    monkeypatch.setattr(cuda_graphs, "_capture", collecting)
    fn = Counted()
    worker = threading.Thread(target=lambda: [graphed("k", fn, torch.ones(2, 2), torch.ones(2, 2)) for _ in range(3)],
                              daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and len(stand_in) == 1


def test_a_failed_capture_is_ended_and_its_pool_and_random_generator_released(monkeypatch):
    """After a capture that `fn` broke off, what torch's capture_end does after a good one is done anyway: the
    allocator stops routing to the graph's pool, and the device's default generator leaves capture mode (a copy of
    its own state: same seed and offset). On an H100 the generator, left capturing, failed every later draw."""
    calls = []

    class BrokenGraph:
        def capture_end(self):
            calls.append("capture_end")
            raise RuntimeError("operation failed due to a previous error during capture")

        def pool(self):
            return (0, 7)

    class Generator:
        def clone_state(self):
            calls.append("clone_state")
            return "copy"

        def graphsafe_set_state(self, state):
            calls.append(("graphsafe_set_state", state))

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda device, pool: calls.append(("pool", device, pool)),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "default_generators", (Generator(), Generator()))
    cuda_graphs._end_failed(BrokenGraph(), torch.device("cuda", 1))
    assert calls == ["capture_end", ("pool", 1, (0, 7)), "clone_state", ("graphsafe_set_state", "copy")]


def test_a_graphed_call_may_lend_its_output_buffers_which_the_next_replay_writes(stand_in):
    fn = Counted()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    for _ in range(2):
        graphed("k", fn, x, y)
    lent = graphed("k", fn, x, y, borrow=True)
    assert lent[0] is stand_in[0].outputs[0]
    graphed("k", fn, x * 3, y, borrow=True)
    assert torch.equal(lent[0], x * 6 + y)  # what was lent now holds the later call's result


@pytest.mark.parametrize("first_sight", ["fp32", "rtq:4"])
@pytest.mark.parametrize("store,dtype", [("memory", torch.float16), ("slab", torch.float16),
                                         ("memory", torch.bfloat16)])
def test_aqsgd_uses_lent_graph_outputs_before_its_next_replay_or_keeps_copies(stand_in, monkeypatch, store, dtype,
                                                                               first_sight):
    """AQ-SGD takes its graphs' outputs without copies (a copy call saved per output on a GPU): every use must be
    queued before the next replay writes them, and anything kept must be a copy. One known sample with one new,
    message after message (each new m(ξ) one row, which a per-sample store would keep as it is), then steady deltas,
    then new samples alone, then new samples of which one must go losslessly (and is kept, in bf16): payloads,
    activations, fidelity sums and both copies of m(ξ) as op by op (where nothing is lent)."""
    from aqpipe.compress.link import aqsgd, aqsgd_rows, base
    from aqpipe.compress.link.factory import build_codec
    from aqpipe.compress.link.options import QuantOptions
    from aqpipe.storage import MemoryStore, SlabStore, StoreView

    # a GPU's payload crosses to the host in a copy: the stand-in's host "device" must copy too (where a message's
    # copy is queued: a steady-state AQ-SGD message's before its verdicts are read, any other's after), and a steady
    # message's verdicts in a copy of their own, queued before the payload's and waited for when read
    for module in (base, aqsgd):
        monkeypatch.setattr(module, "to_host", lambda payload, spin=False: (payload.clone(), None))
    waits = []
    landing = SimpleNamespace(device=torch.device("cpu"), synchronize=lambda: waits.append(1))
    monkeypatch.setattr(aqsgd_rows, "to_host", lambda verdicts, spin=False: (verdicts.clone(), landing))
    generator = torch.Generator().manual_seed(0)
    visits = ([[0, 1]] + [[k, k + 2] for k in range(1, 6)] + [[k] for k in (2, 3, 4, 5)] + [[9], [10], [11]]
              + [[12, 13], [14, 15], [16, 17]])  # (the second sample of the last three: too large for fp16)
    x = torch.randn(len(visits), 2, 6, 16, generator=generator)
    x[-3:, 1, 0, 0] = 1e6

    def run() -> tuple[list, list, list]:
        ends = []
        for side in ("send", "recv"):
            kept = MemoryStore(dtype) if store == "memory" else SlabStore(dtype, "cpu")
            ends.append(build_codec("aqsgd:3", "fw", StoreView(kept, 0, side), QuantOptions(), first_sight=first_sight))
        sender, receiver = ends
        sent = []
        for visit, ids in enumerate(visits):
            encoded, out = _visit(sender, receiver, x[visit, : len(ids)], torch.tensor(ids))
            fidelity = None if encoded.fidelity is None else encoded.fidelity.squares  # (read after the run)
            sent.append((encoded.payload, encoded.codec_check, out, fidelity))
        held = [[end.view.get([i])[0] if end.view.present([i])[0] else None for i in range(18)] for end in ends]
        return sent, held[0], held[1]

    monkeypatch.setenv(cuda_graphs.SWITCH, "0")
    expected = run()
    monkeypatch.delenv(cuda_graphs.SWITCH)
    got = run()
    assert any(graph.replays > 2 for graph in stand_in)  # (the outputs were lent, message after message)
    assert waits  # (steady messages' verdicts were read from their own copies)
    for (payload, check, out, fidelity), (want_payload, want_check, want_out, want_fidelity) in zip(got[0],
                                                                                                  expected[0]):
        assert torch.equal(payload, want_payload) and check == want_check and torch.equal(out, want_out)
        assert (fidelity is None and want_fidelity is None) or torch.equal(fidelity, want_fidelity)
    for side in (1, 2):
        for value, want in zip(got[side], expected[side]):
            assert (value is None and want is None) or torch.equal(value, want)


def test_what_the_graphs_hold_is_measured_again_only_after_a_graph_is_added_or_dropped(monkeypatch):
    """Each step reports what the process's graphs hold (`held_on`, the `stage_codec_graph_bytes` metric): a memory
    snapshot walks every segment of the allocator, so it is taken again only when the graphs change; off a GPU, or
    with no graph, nothing is asked of CUDA. (On the host: the graphs and the allocator's report are stand-ins.)"""
    cuda_graphs.clear()
    cuda = torch.device("cuda", 0)
    assert cuda_graphs.held_on(torch.device("cpu")) == 0 and cuda_graphs.held_on(cuda) == 0
    asked = []
    monkeypatch.setattr(cuda_graphs, "device_bytes", lambda: asked.append(1) or {("a", "delta"): 7, ("b", "x"): 5})
    try:
        cuda_graphs._cache.graphs[(("a", "delta"), 0)] = object()  # a graph of owner "a", as a capture files it
        cuda_graphs._cache.version += 1
        assert cuda_graphs.held_on(cuda) == 12 and cuda_graphs.held_on(cuda) == 12 and len(asked) == 1
        cuda_graphs.forget("a")  # a codec that ends takes its graphs with it
        assert cuda_graphs.held_on(cuda) == 0 and len(asked) == 1  # (no graph left: nothing to ask)
        cuda_graphs._cache.graphs[(("b", "x"), 0)] = object()
        cuda_graphs._cache.version += 1
        assert cuda_graphs.held_on(cuda) == 12 and len(asked) == 2
        cuda_graphs.clear()  # a new cache: measured anew
        cuda_graphs._cache.graphs[(("b", "x"), 0)] = object()
        assert cuda_graphs.held_on(cuda) == 12 and len(asked) == 3
    finally:
        cuda_graphs.clear()
