"""AQ-SGD's fused delta step writing m(ξ) over the old in a slab's rows (aqpipe.compress.gpu.fused, `in_place`): which
messages it writes so, that the bits stay the torch ops' (under Triton's interpreter), and what a failure after an
in-place write does. tests/test_gpu_codecs.py checks the same bits on a GPU."""

from types import SimpleNamespace

import pytest
import torch

from aqpipe.compress.gpu import fused
from tests.fused_cases import interpret, needs_triton


@needs_triton
def test_a_slabs_m_is_written_in_place_once_the_kernels_have_run():
    """m(ξ) kept as a slab's rows: the first delta message each way writes its new m(ξ) apart (the kernels have not
    run yet in the process, and a kernel that fails to compile must leave m(ξ) as it was), and the store keeps it;
    every later one is written over the old rows by the kernels themselves — no new m(ξ) made, no store write — except
    a batch with a sample twice (two programs would write one row). Both copies of m(ξ), every payload and activation
    agree bit for bit with a link through the torch ops."""
    interpret("""
        import os
        import torch
        from aqpipe.compress.gpu import fused
        from aqpipe.compress.link.options import QuantOptions
        from aqpipe.compress.link.factory import build_codec
        from aqpipe.pipeline.links.transport import Header
        from aqpipe.storage import StoreView
        from aqpipe.storage.slab import SlabStore

        made, writes = [], []
        for name in ("delta_encode", "delta_decode"):
            def noted(*args, _f=getattr(fused, name), _name=name, **kw):
                out = _f(*args, **kw)
                made.append((out.m_new if _name == "delta_encode" else out[0]) is not None)
                return out
            setattr(fused, name, noted)
        scatter = SlabStore.scatter
        def counted(self, link, side, ids, values):
            writes.append(side)
            return scatter(self, link, side, ids, values)
        SlabStore.scatter = counted

        def run(switch):
            os.environ["AQPIPE_FUSED_KERNELS"] = switch
            torch.manual_seed(3)
            send, recv = SlabStore(torch.float16, "cpu"), SlabStore(torch.float16, "cpu")
            sender = build_codec("aqsgd:4", "fw", StoreView(send, 0, "send"), QuantOptions())
            receiver = build_codec("aqsgd:4", "fw", StoreView(recv, 0, "recv"), QuantOptions())
            x, out, stores = torch.randn(4, 6, 16), [], []
            for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0], [1, 1, 2, 0], [0, 2, 3, 1]):
                ids = torch.tensor(order)
                x += 0.1 * torch.randn_like(x)
                made.clear(), writes.clear()
                e = sender.encode(x[ids], ids, compress=True)
                out += [e.payload, receiver.decode(Header.for_encoded(e, sender.code), e.payload, ids)]
                stores.append((list(made), list(writes)))
                for kept, side in ((send, "send"), (recv, "recv")):
                    out.append(torch.stack(kept.get(0, side, [0, 1, 2, 3])))
            return out, stores

        fused_out, fused_stores = run("1")
        assert fused_stores == [
            ([], ["send", "recv"]),  # first sights, seeded through the store
            ([True, True], ["send", "recv"]),  # the first deltas: the kernels have not run yet
            ([False, False], []),  # written in place
            ([True, True], ["send", "recv"]),  # sample 1 twice: apart
            ([False, False], []),
        ], fused_stores
        torch_out, torch_stores = run("0")
        assert not torch_stores[2][0] and torch_stores[2][1] == ["send", "recv"]  # (the torch ops: no kernels)
        assert len(fused_out) == len(torch_out) == 20
        for a, b in zip(fused_out, torch_out):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        print("checked")
    """)


@needs_triton
def test_a_receiver_checking_late_keeps_the_bits_with_m_written_in_place():
    """A receiver that checks its checksums late (as on a GPU) over slabs the kernels write in place, its messages
    mixing rtq:4 first sights with deltas (a group each: the deltas' m(ξ) written by the kernels, the first sights'
    kept through the store), then all deltas, then a NaN and a value past fp16 among deltas (read at once): every
    payload, activation and both copies of m(ξ) as a link through the torch ops, and every late check passes."""
    interpret("""
        import os
        import torch
        from aqpipe.compress.gpu import fused
        from aqpipe.compress.link.options import QuantOptions
        from aqpipe.compress.link.factory import build_codec
        from aqpipe.compress.link.late_checks import LateChecks
        from aqpipe.pipeline.links.transport import Header
        from aqpipe.storage import StoreView
        from aqpipe.storage.slab import SlabStore

        in_place = []
        decode = fused.delta_decode
        def noted(*args, **kw):
            out = decode(*args, **kw)
            in_place.append(out[0] is None)
            return out
        fused.delta_decode = noted

        def run(switch):
            os.environ["AQPIPE_FUSED_KERNELS"] = switch
            torch.manual_seed(5)
            send, recv = SlabStore(torch.float16, "cpu"), SlabStore(torch.float16, "cpu")
            sender = build_codec("aqsgd:3", "fw", StoreView(send, 0, "send"), QuantOptions(), first_sight="rtq:4")
            receiver = build_codec("aqsgd:3", "fw", StoreView(recv, 0, "recv"), QuantOptions(), first_sight="rtq:4")
            receiver.late_checks = LateChecks(receiver._verify)  # (what a GPU receiver has)
            x, out = torch.randn(8, 6, 16), []
            visits = [[0, 1, 2, 3], [2, 4, 0, 5], [6, 1, 3, 7], [5, 2, 7, 4], [0, 6, 1, 3], [4, 5, 6, 7]]
            for visit, order in enumerate(visits):
                ids = torch.tensor(order)
                x += 0.1 * torch.randn_like(x)
                batch = x[ids].clone()
                if visit == 5:
                    batch[0, 1, 2] = float("nan")  # sample 4: sent losslessly, m(ξ) dropped on both sides
                    batch[2, 3, 4] = 70000.0  # sample 6: its new m(ξ) past fp16's largest: likewise
                e = sender.encode(batch, ids, compress=True)
                out += [e.payload, receiver.decode(Header.for_encoded(e, sender.code, step=visit), e.payload, ids)]
            receiver.settle()
            assert len(receiver.late_checks) == 0
            for kept, side in ((send, "send"), (recv, "recv")):
                held = [i for i, here in zip(range(8), kept.present(0, side, list(range(8)))) if here]
                assert held == [0, 1, 2, 3, 5, 7], (side, held)
                out.append(torch.stack(kept.get(0, side, held)))
            return out

        fused_out = run("1")
        assert True in in_place, in_place  # (the kernels wrote some messages' m(ξ) in place)
        torch_out = run("0")
        assert len(fused_out) == len(torch_out) == 14
        for a, b in zip(fused_out, torch_out):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        print("checked")
    """)


def test_a_delta_step_that_fails_after_writing_m_in_place_says_so_rather_than_diverge(monkeypatch, caplog):
    """Until a delta step's kernels have run in the process they write m(ξ) apart, so a kernel that fails then (one
    that will not compile) leaves m(ξ) as it was and the torch ops take the message. Once they write in place, a
    failure after the write cannot be taken back: a RuntimeError says so (a fallback would code against an m(ξ) the
    peer never had)."""
    class Runs:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    class Fails:
        def __getitem__(self, grid):
            raise RuntimeError("an illegal memory access")

    kernels = SimpleNamespace(scales_kernel=Runs(), codes_kernel=Runs(), decode_kernel=Runs(), verdicts_kernel=Fails(),
                              SCALE_T=32, SCALE_C=32, TILE_T=16, TILE_C=64, VERDICT_P=256, VERDICT_C=256, OPTIONS={},
                              WARPS=dict.fromkeys(("scales", "codes", "decode", "delta_decode", "verdicts"), 4))
    monkeypatch.setattr(fused, "_kernels", lambda: kernels)
    slab, slots = torch.zeros(5, 8, 16, dtype=torch.float16), torch.tensor([3, 1])
    x, rows = torch.randn(2, 8, 16), torch.zeros(2, fused.row_bytes(8, 16, 4), dtype=torch.uint8)
    for proven in (set(), {"encode", "decode"}):
        monkeypatch.setattr(fused, "_proven", set(proven))
        monkeypatch.setattr(fused, "_failed", [])
        steps = (lambda: fused.delta_encode(x, slab, slots, 4, "signed", (40503, 65521), 1, in_place=True),
                 lambda: fused.delta_decode(rows, slab, slots, (2, 8, 16), 4, "signed", (40503, 65521), in_place=True))
        for step in steps:
            if not proven:
                assert step() is None  # (nothing written: the caller's torch ops code the message)
            else:
                with pytest.raises(RuntimeError, match="failed after writing m\\(xi\\) in place.*illegal memory"):
                    step()
        assert fused._failed and not fused.fusable(x.device, tuple(x.shape), 4, "channel", "signed")


@needs_triton
def test_the_steady_delta_step_replayed_from_a_graph_over_a_slab_keeps_the_bits():
    """Once the kernels write m(ξ) in place, each end's delta step over a slab's rows runs from a CUDA graph (here a
    stand-in that replays the step on the host, `tests.graph_stand_ins`): its first such message launches the
    kernels, the next captures the graph, later ones replay it, with the slab held where it lies — written once a
    message, never twice — and its outputs lent to the codec until its next message; the activation is read, and the
    decoded one written, where the codec's caller has it, and the received rows read where they lie (no copy in or
    out). A batch with a sample twice
    still launches the kernels, writing m(ξ) apart. A slab that grows (new samples) moves, and the step's graph
    over the old slab is replaced. Every payload, activation, checksum check (late, as on a GPU) and both copies of
    m(ξ) agree bit for bit with a link through the torch ops."""
    interpret("""
        import os
        import torch
        from aqpipe.compress.gpu import cuda_graphs
        from aqpipe.compress.link import aqsgd, base
        from aqpipe.compress.link.options import QuantOptions
        from aqpipe.compress.link.factory import build_codec
        from aqpipe.compress.link.late_checks import LateChecks
        from aqpipe.pipeline.links.transport import Header
        from aqpipe.storage import StoreView
        from aqpipe.storage.slab import SlabStore
        from tests.graph_stand_ins import install

        captures = []
        install(captures)
        for module in (base, aqsgd):  # (a GPU's payload crosses to the host in a copy: the stand-in's must too)
            module.to_host = lambda payload: (payload.clone(), None)

        def run(switch):
            os.environ["AQPIPE_FUSED_KERNELS"] = switch
            cuda_graphs.clear()
            torch.manual_seed(7)
            send, recv = SlabStore(torch.float16, "cpu", 4), SlabStore(torch.float16, "cpu", 4)
            sender = build_codec("aqsgd:3", "fw", StoreView(send, 0, "send"), QuantOptions())
            receiver = build_codec("aqsgd:3", "fw", StoreView(recv, 0, "recv"), QuantOptions())
            receiver.late_checks = LateChecks(receiver._verify)  # (what a GPU receiver has)
            x, out, slabs = torch.randn(8, 6, 16), [], []
            visits = [[0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0], [1, 0, 3, 2], [1, 1, 2, 0], [0, 2, 3, 1],
                      [4, 5, 6, 7], [7, 6, 5, 4], [5, 7, 4, 6], [6, 4, 7, 5], [0, 1, 2, 3]]
            for visit, order in enumerate(visits):
                ids = torch.tensor(order)
                x += 0.1 * torch.randn_like(x)
                e = sender.encode(x[ids], ids, compress=True)
                out += [e.payload, torch.tensor(e.codec_check),
                        receiver.decode(Header.for_encoded(e, sender.code, step=visit), e.payload, ids)]
                slabs.append(send._slabs[(0, "send", (6, 16))].rows.data_ptr())
            receiver.settle()
            for kept, side in ((send, "send"), (recv, "recv")):
                out.append(torch.stack(kept.get(0, side, list(range(8)))))
            kinds = sorted(signature[0][1] for signature in cuda_graphs._cache.graphs)
            return out, kinds, len(set(slabs))

        graphed, kinds, slabs = run("1")
        assert slabs == 2  # (the slab grew for samples 4-7)
        assert kinds == ["fused-decode", "fused-encode", "seed", "seed"], kinds  # (the old slab's graphs dropped)
        steps = [g for g in captures if g.held]
        assert len(steps) == 4 and all(g.replays >= 2 for g in steps), [g.replays for g in steps]
        # no activation copied into a graph or out of one, nor the received rows: each step's one buffer is its index
        # (the slots, then the addresses of the activation, or of the rows and the activation); neither returns an
        # activation
        assert sorted(tuple(t.shape) for g in steps for t in g.inputs) == [(5,), (5,), (6,), (6,)]
        assert all(t.dtype == torch.int64 for g in steps for t in g.inputs)
        assert all(out.dtype != torch.float32 or out.numel() < 4 * 6 * 16 for g in steps for out in g.outputs)
        ops, _, _ = run("0")
        assert len(graphed) == len(ops) == 3 * 11 + 2
        for a, b in zip(graphed, ops):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        print("checked")
    """)
