"""The codecs' GPU paths (`pytest -m gpu`): their kernels replayed from CUDA graphs and the fused Triton kernels,
each against the torch ops op by op, bit for bit (a failed capture, and CUDA graphs themselves:
tests/test_gpu_cuda_graphs.py). They skip where CUDA is absent, as tests/test_gpu.py's checks do (whose device
switch, marks and header helper they share)."""

import os
import subprocess
import sys

import pytest
import torch

from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.storage import StoreView, memory_store
from tests.test_gpu import DEVICE, _header, needs_cuda, pytestmark  # noqa: F401 - pytestmark marks these tests too


def _has_triton() -> bool:
    from aqpipe.compress.gpu import fused

    return fused._kernels() is not None


needs_triton = pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.is_available() and not _has_triton(),
                                  reason="the fused codec kernels need Triton (a CUDA build of torch brings it)")


@needs_cuda
@pytest.mark.parametrize("spec,direction,per,grid", [("directq:4", "fw", "channel", "signed"),
                                                     ("directq:3", "bw", "token", "fit"),
                                                     ("directq:1", "fw", "channel", "signed"),
                                                     ("directq:8", "bw", "channel", "symmetric"),
                                                     ("rtq:4", "fw", "channel", "signed"),
                                                     ("rtq:3", "bw", "channel", "signed"),
                                                     ("rtqo:4", "fw", "channel", "signed")])
def test_a_codecs_cuda_graph_replays_the_bits_of_its_ops(monkeypatch, spec, direction, per, grid):
    """A stateless codec's encode and decode replayed from CUDA graphs (from the third call of a shape) give the
    bytes and values the same calls give op by op (AQPIPE_CUDA_GRAPHS=0), call after call."""
    from aqpipe.compress.gpu import cuda_graphs

    options = QuantOptions(per=per, grid=grid)
    codec = build_codec(spec, direction, options=options, device=DEVICE)
    ids = torch.arange(4)
    cuda_graphs.clear()
    before = cuda_graphs.captured()
    for call in range(5):
        x = torch.randn(4, 24, 40, device=DEVICE) * (call + 1)
        monkeypatch.setenv(cuda_graphs.SWITCH, "1")
        replayed = codec.encode(x, ids)
        decoded = codec.decode(_header(replayed, codec), replayed.payload, ids)
        monkeypatch.setenv(cuda_graphs.SWITCH, "0")
        op_by_op = codec.encode(x, ids)
        assert torch.equal(replayed.payload, op_by_op.payload), call
        assert torch.equal(decoded, codec.decode(_header(op_by_op, codec), op_by_op.payload, ids)), call
    assert cuda_graphs.captured() >= before + 2  # its encode and its decode


@needs_cuda
@pytest.mark.parametrize("spec,first_sight,dtype", [("aqsgd:3", "fp32", torch.float32),
                                                    ("aqsgd:4", "rtq:4", torch.float32),
                                                    ("aqsgd-rtq:3", "directq:6", torch.bfloat16),
                                                    ("aqsgd:3", "rtqo:4", torch.float32)])
def test_aqsgd_replayed_from_cuda_graphs_sends_and_keeps_the_bits_of_its_ops(monkeypatch, spec, first_sight, dtype):
    """Two AQ-SGD links fed the same activations, one replaying its kernels from CUDA graphs and one op by op: every
    message's bytes, every decoded activation and every m(ξ) agree bit for bit, first sights (three batches of new
    samples: the third replays) and deltas alike."""
    from aqpipe.compress.gpu import cuda_graphs

    cuda_graphs.clear()
    options = QuantOptions()
    links = []
    for _ in range(2):
        send, recv = memory_store(torch.float16, DEVICE), memory_store(torch.float16, DEVICE)  # slabs
        links.append((build_codec(spec, "fw", StoreView(send, 0, "send"), options, device=DEVICE,
                                  first_sight=first_sight),
                      build_codec(spec, "fw", StoreView(recv, 0, "recv"), options, device=DEVICE,
                                  first_sight=first_sight), send, recv))
    x = torch.randn(12, 16, 32, device=DEVICE)
    for visit in range(7):
        ids = torch.tensor([[3, 1, 4, 5], [0, 2, 6, 7], [8, 9, 10, 11]][visit % 3])
        rows = slice(4 * (visit % 3), 4 * (visit % 3) + 4)
        x[rows] += 0.1 * torch.randn_like(x[rows])
        results = []
        for switch, (sender, receiver, _, _) in zip(("1", "0"), links):
            monkeypatch.setenv(cuda_graphs.SWITCH, switch)
            encoded = sender.encode(x[rows].to(dtype), ids, compress=True)
            results.append((encoded, receiver.decode(_header(encoded, sender), encoded.payload, ids)))
        (graphed, graphed_out), (op_by_op, op_by_op_out) = results
        assert torch.equal(graphed.payload, op_by_op.payload), visit
        assert torch.equal(graphed_out, op_by_op_out), visit
    for i in range(12):
        values = [store.get(0, side, [i])[0] for _, _, send, recv in links for store, side in ((send, "send"),
                                                                                           (recv, "recv"))]
        assert all(torch.equal(values[0], v) for v in values[1:])
    kinds = {signature[0][1] for signature in cuda_graphs._cache.graphs if isinstance(signature[0][0], str)
             and signature[0][0].startswith("aqsgd")}
    assert {"delta-encode", "delta-decode"} <= kinds and (first_sight == "fp32" or "first-encode" in kinds)


@needs_cuda
@pytest.mark.parametrize("first_sight", ["fp32", "rtq:4"])
def test_a_steady_aqsgd_message_on_slabs_waits_for_the_gpu_once_a_side(monkeypatch, first_sight):
    """m(ξ) on the GPU as slabs and the graphs' outputs lent: a message of deltas alone, or of first sights coded by a
    first-sight coder, makes the host wait once, on the sender's side (the read of its verdicts and checksum sums;
    the receiver keeps every such row and checks the checksum once the sums reach the host: `late_checks`); one of
    lossless first sights once on each side (the receiver reads which it can keep). Each sends and keeps what the
    same link sends and keeps op by op (no graphs, nothing lent)."""
    import warnings

    from aqpipe.compress.gpu import cuda_graphs

    cuda_graphs.clear()
    links = []
    for _ in range(2):
        send, recv = memory_store(torch.float16, DEVICE, 16), memory_store(torch.float16, DEVICE, 16)
        links.append([build_codec("aqsgd:3", "fw", StoreView(send, 0, "send"), QuantOptions(), device=DEVICE,
                                  first_sight=first_sight),
                      build_codec("aqsgd:3", "fw", StoreView(recv, 0, "recv"), QuantOptions(), device=DEVICE,
                                  first_sight=first_sight)])
    x = torch.randn(8, 64, 576, device=DEVICE)
    waits = {}
    for visit in range(6):  # first sights (new samples, three times: the third replays), then deltas
        ids = torch.arange(4) + (4 * visit if visit < 3 else 0)
        x[:4] += 0.1 * torch.randn_like(x[:4])
        results = []
        for switch, (sender, receiver) in zip(("1", "0"), links):
            monkeypatch.setenv(cuda_graphs.SWITCH, switch)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    encoded = sender.encode(x[:4], ids, compress=True)
                    encode_waits = sum("synchronizing" in str(w.message) for w in caught)
                    out = receiver.decode(_header(encoded, sender), encoded.payload, ids)
                    decode_waits = sum("synchronizing" in str(w.message) for w in caught) - encode_waits
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            results.append((encoded.payload, torch.tensor(encoded.codec_check), out))
            if switch == "1":
                waits[visit] = (encode_waits, decode_waits)
        for a, b in zip(*results):
            assert torch.equal(a.cpu(), b.cpu()), visit
    lossless = first_sight == "fp32"
    assert waits[2] == (1, 1 if lossless else 0) and waits[5] == (1, 0), waits  # replayed first sights, then deltas
    for _, receiver in links:
        receiver.settle()  # (every message's checksum passes)
    for end, side in ((0, "send"), (1, "recv")):  # each side's m(ξ) of all twelve samples, graphed and op by op
        graphed, op_by_op = (link[end].view.store.gather(0, side, list(range(12))) for link in links)
        assert torch.equal(graphed, op_by_op)


@needs_cuda
@pytest.mark.parametrize("shape", [(4, 64, 576), (4, 128, 576)], ids=["torch-ops", "fused"])
def test_a_gpu_receiver_refuses_a_divergence_once_the_checksum_sums_reach_the_host(monkeypatch, shape):
    """A GPU receiver's delta messages leave their checksum checks for later: each is made at the receiver's next
    message, once its sums have arrived, or when the step settles; a divergence planted in its m(ξ) is refused
    then, naming the message. The delta step in torch ops and fused (AQPIPE_FUSED_AQSGD=1)."""
    from aqpipe.compress.gpu import fused
    from aqpipe.compress.link.specs import CodecError
    from aqpipe.pipeline.links.transport import Header

    monkeypatch.setenv(fused.DELTA_SWITCH, "1" if shape[1] == 128 else "0")
    stores = memory_store(torch.float16, DEVICE, 16), memory_store(torch.float16, DEVICE, 16)
    sender, receiver = (build_codec("aqsgd:3", "fw", StoreView(store, 0, side), QuantOptions(), device=DEVICE)
                        for store, side in zip(stores, ("send", "recv")))
    assert receiver.late_checks is not None
    x, ids = torch.randn(shape, device=DEVICE), torch.tensor([3, 0, 2, 1])
    for visit in range(4):
        encoded = sender.encode(x + 0.1 * visit, ids, compress=True)
        receiver.decode(Header.for_encoded(encoded, sender.code, step=visit), encoded.payload, ids)
    assert len(receiver.late_checks) >= 1  # (the last one at least: no message after it yet)
    receiver.settle()
    assert len(receiver.late_checks) == 0
    slab, slots = stores[1].rows(0, "recv", [2])
    slab[slots] += 1  # plant a divergence in sample 2's m(ξ)
    encoded = sender.encode(x + 0.5, ids, compress=True)
    receiver.decode(Header.for_encoded(encoded, sender.code, step=7, micro_batch=1), encoded.payload, ids)
    with pytest.raises(CodecError, match="diverged on link 0: .* at step 7 micro-batch 1"):
        receiver.settle()


_FRESH_FUSED_GRAPHS = """
import torch
from aqpipe.compress.gpu import cuda_graphs, fused
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.factory import build_codec
from aqpipe.pipeline.links.transport import Header
from aqpipe.storage import StoreView, memory_store
ends = [build_codec("aqsgd:3", "fw", StoreView(memory_store(torch.float16, "cuda"), 0, side), QuantOptions(),
                    device=torch.device("cuda")) for side in ("send", "recv")]
x, ids = torch.randn(4, 64, 576, device="cuda"), torch.arange(4)
for visit in range(6):
    encoded = ends[0].encode(x + 0.01 * visit, ids, compress=True)
    ends[1].decode(Header.for_encoded(encoded, ends[0].code, step=visit), encoded.payload, ids)
ends[1].settle()
kinds = sorted(signature[0][1] for signature in cuda_graphs._cache.graphs)
print("failed" if cuda_graphs._cache.failed or fused._failed else "captured", kinds)
"""


@needs_cuda
@needs_triton
def test_a_fresh_process_captures_the_fused_steps_graphs_over_rows_at_an_odd_offset():
    """In a process whose kernels have never run, a 4-sample message's rows lie 4 bytes into their payload, where
    the decode step's graph reads them (their offset from a 64-byte boundary names the graph): Triton's kernels for
    that alignment must be compiled and loaded before the capture (which cannot compile: it failed so at
    codec_speed.py's aqsgd:3 on an H100, when the graph read an aligned copy of the rows, and every later row ran
    about ten times slower)."""
    env = {**os.environ, "AQPIPE_FUSED_AQSGD": "1"}
    proc = subprocess.run([sys.executable, "-c", _FRESH_FUSED_GRAPHS], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "captured ['fused-decode', 'fused-encode']", (proc.stdout,
                                                                                            proc.stderr[-3000:])


@needs_cuda
@needs_triton
@pytest.mark.parametrize("bits", range(2, 9))
def test_the_fused_kernels_write_the_bits_of_the_torch_ops_on_the_gpu(bits):
    """DirectQ's fused kernels (aqpipe.compress.gpu.fused) against the torch ops on the same GPU — rows, the values AQ-SGD
    keeps as m(ξ) and decoded values bit for bit — and the host's decode of the GPU's rows against the GPU's: real-run
    shapes and ragged tiles, every grid they take, an all-zero channel, −0, values past fp16, fp16-subnormal scales."""
    from aqpipe.compress.gpu import fused
    from aqpipe.compress.link.directq import decode_samples, encode_samples
    from aqpipe.compress.quantize import dequantize, quantize
    from tests.fused_cases import edge_case_batch

    torch.manual_seed(bits)
    for shape in [(4, 128, 576), (8, 1024, 576), (4, 512, 1600), (3, 17, 40), (2, 3, 5, 16), (1, 1, 8)]:
        for grid in ("signed", "symmetric", "uniform"):
            x = edge_case_batch(shape, DEVICE)
            assert fused.encodable(x, bits, "channel", False, grid)
            q = quantize(x, bits, "channel", False, None, grid)
            rows, values = fused.encode(x, bits, grid, values=True)
            assert torch.equal(rows, encode_samples(q)), (shape, grid)
            assert torch.equal(values.view(torch.int32), dequantize(q, shape).view(torch.int32)), (shape, grid)
            decoded = fused.decode(rows, shape, bits, grid)
            assert torch.equal(decoded.view(torch.int32), values.view(torch.int32)), (shape, grid)
            on_host = decode_samples(rows.cpu(), shape, bits, "channel", grid)
            assert torch.equal(on_host.view(torch.int32), decoded.cpu().view(torch.int32)), (shape, grid)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("spec,first_sight,dtype,store", [("aqsgd:3", "fp32", torch.float32, torch.float16),
                                                          ("aqsgd:4", "directq:6", torch.bfloat16, torch.float16),
                                                          ("aqsgd:2", "fp32", torch.float32, torch.bfloat16),
                                                          ("aqsgd:8", "rtq:4", torch.float32, torch.float32)])
def test_aqsgd_through_the_fused_kernels_keeps_the_bits_of_the_torch_ops(monkeypatch, spec, first_sight, dtype,
                                                                         store):
    """Two AQ-SGD links and two DirectQ codecs fed the same activations, one through the fused kernels (DirectQ's
    replayed from CUDA graphs; AQ-SGD's delta step reading m(ξ) in place from its slab, through slots the shuffled
    visits put out of order, and a bf16 activation as it is), one through the torch ops op by op: every message's
    bytes and checksum, decoded activation and m(ξ) agree (the fidelity norms, summed in another order, to float
    tolerance). m(ξ) in fp16, bf16 (both fused) and fp32 (the torch ops update it)."""
    from aqpipe.compress.gpu import cuda_graphs, fused
    from aqpipe.compress.link import aqsgd_fused

    cuda_graphs.clear()
    options = QuantOptions()
    links = []
    for _ in range(2):
        send, recv = memory_store(store, DEVICE), memory_store(store, DEVICE)
        links.append((build_codec(spec, "fw", StoreView(send, 0, "send"), options, device=DEVICE,
                                  first_sight=first_sight),
                      build_codec(spec, "fw", StoreView(recv, 0, "recv"), options, device=DEVICE,
                                  first_sight=first_sight), send, recv, build_codec("directq:6", "bw", device=DEVICE)))
    x = torch.randn(8, 64, 576, device=DEVICE)
    monkeypatch.setenv("AQPIPE_FUSED_KERNELS", "1")
    assert fused.encodable(x, 3, "channel", False, "signed")
    monkeypatch.setenv(fused.DELTA_SWITCH, "1")
    calls: list[str] = []
    inside: list[str] = []  # (a graphed step's own launches, op by op or captured, are not counted again)

    def counting(name, kernel):
        def counted(*args, **kwargs):
            if not inside:  # (a graphed call by its step: "graphed fused-encode", "graphed fused-decode")
                calls.append(name if name != "graphed" else f"graphed {args[0][1]}")
            if name != "graphed":
                return kernel(*args, **kwargs)
            inside.append(name)
            try:
                return kernel(*args, **kwargs)
            finally:
                inside.pop()
        return counted

    for name in ("encode", "decode", "delta_encode", "delta_decode"):
        monkeypatch.setattr(fused, name, counting(name, getattr(fused, name)))
    monkeypatch.setattr(aqsgd_fused, "graphed", counting("graphed", aqsgd_fused.graphed))
    fidelity = []
    for visit in range(6):
        ids = torch.tensor([[0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0]][visit // 2]) + 4 * (visit % 2)
        x[ids] += 0.1 * torch.randn_like(x[ids])
        results = []
        for switch, (sender, receiver, _, _, directq) in zip(("1", "0"), links):
            monkeypatch.setenv(cuda_graphs.SWITCH, switch)
            monkeypatch.setenv("AQPIPE_FUSED_KERNELS", switch)
            monkeypatch.setenv(fused.DELTA_SWITCH, switch)
            encoded = sender.encode(x[ids].to(dtype), ids, compress=True)
            grads = directq.encode(x[ids] * 1e-3, ids)
            results.append((encoded.payload, receiver.decode(_header(encoded, sender), encoded.payload, ids),
                            torch.tensor(encoded.codec_check), grads.payload,
                            directq.decode(_header(grads, directq), grads.payload, ids)))
            fidelity.append(encoded.fidelity)
        for a, b in zip(*results):
            assert torch.equal(a, b), visit
        fused_fidelity, torch_fidelity = fidelity[-2:]
        assert (fused_fidelity is None) == (torch_fidelity is None) == (visit < 2)
        if fused_fidelity is not None:
            assert torch.allclose(fused_fidelity.squares, torch_fidelity.squares, rtol=1e-5)
    # the fused link ran its kernels (DirectQ's outside a graph only on a shape's first two calls: the rest replay
    # them; AQ-SGD's delta step on every delta message: launched until the kernels write m(ξ) in place, then from
    # the step's graph over the slab — op by op at its first call, captured at its second, replayed after)
    graphs = {"graphed fused-encode", "graphed fused-decode"}
    fused_parts = {"encode", "decode"} | (graphs if store != torch.float32 else set())
    launched = {"delta_encode", "delta_decode"} if store != torch.float32 else set()  # (unless proven before)
    assert set(calls) - launched == fused_parts and not fused._failed, (calls, fused._failed)
    if store != torch.float32:  # the four delta visits each way, each through the kernels: launched or graphed
        for step in ("encode", "decode"):
            assert calls.count(f"delta_{step}") + calls.count(f"graphed fused-{step}") == 4, calls
            assert calls.count(f"graphed fused-{step}") >= 2, calls  # (at least the last two visits)
        kinds = {signature[0][1] for signature in cuda_graphs._cache.graphs if isinstance(signature[0], tuple)}
        assert {"fused-encode", "fused-decode"} <= kinds, kinds
    for i in range(8):
        values = [store.get(0, side, [i])[0] for _, _, send, recv, _ in links for store, side in ((send, "send"),
                                                                                              (recv, "recv"))]
        assert all(torch.equal(values[0], v) for v in values[1:])


@needs_cuda
@needs_triton
def test_a_replayed_fused_step_reads_and_writes_activations_wherever_they_lie(monkeypatch):
    """The fused delta step's graphs reach each message's activation, and write each decoded one, through addresses
    their index carries (`fused.addressable`), not copies: fed fresh activations that all stay alive (each lies
    elsewhere), the link replaying graphs sends, decodes and keeps the bits of the same kernels launched one by
    one, and every decoded activation keeps its values after later messages (the caller's own tensor)."""
    from aqpipe.compress.gpu import cuda_graphs, fused

    cuda_graphs.clear()
    monkeypatch.setenv("AQPIPE_FUSED_KERNELS", "1")
    monkeypatch.setenv(fused.DELTA_SWITCH, "1")
    links = [[build_codec("aqsgd:3", "fw", StoreView(memory_store(torch.float16, DEVICE, 16), 0, side),
                          QuantOptions(), device=DEVICE) for side in ("send", "recv")] for _ in range(2)]
    base, ids, kept = torch.randn(8, 64, 576, device=DEVICE), torch.arange(8), []
    for visit in range(7):  # a first sight, deltas launched, then the step's first call, its capture and replays
        x = base + 0.1 * visit * torch.randn_like(base)
        results = []
        for switch, (sender, receiver) in zip(("1", "0"), links):
            monkeypatch.setenv(cuda_graphs.SWITCH, switch)
            encoded = sender.encode(x, ids, compress=True)
            results.append((encoded.payload, torch.tensor(encoded.codec_check),
                            receiver.decode(_header(encoded, sender), encoded.payload, ids)))
        for a, b in zip(*results):
            assert torch.equal(a.cpu(), b.cpu()), visit
        kept.append((x, results[0][2], results[0][2].clone()))
    assert len({x.data_ptr() for x, _, _ in kept}) == len(kept)
    assert all(torch.equal(out, copy) for _, out, copy in kept)
    kinds = {signature[0][1] for signature in cuda_graphs._cache.graphs if isinstance(signature[0], tuple)}
    assert {"fused-encode", "fused-decode"} <= kinds, kinds
    for _, receiver in links:
        receiver.settle()


@needs_cuda
def test_a_gpu_receivers_messages_land_in_page_locked_memory_and_decode_as_from_any_memory():
    """Each message is decoded without a wait (DirectQ's decode reads nothing back) and dropped before the next, of
    the same size, is received: a pinned block reused before its copy to the GPU was done would change an earlier
    decode, which the end compares with the decode of pageable copies."""
    import socket

    from aqpipe.pipeline.links import transport as t

    sender, receiver = socket.socketpair()
    box = t.Outbox(sender, "rank 1", timeout=30)
    inbox = t.Inbox(receiver, "rank 0", 30, torch.device(DEVICE))
    ends = [build_codec("directq:4", "bw", device=DEVICE) for _ in range(3)]
    x, ids = torch.randn(4, 256, 64, device=DEVICE), torch.arange(4)
    decoded, expected = [], []
    for visit in range(6):
        encoded = ends[0].encode(x * (visit + 1), ids)
        header = _header(encoded, ends[0])
        inbox.expect(t.Expect(t.KIND_GRADIENT, visit, 0, 4, check=ends[1].check_header))
        box.send(t.Header(t.KIND_GRADIENT, visit, 0, header.shape, header.dtype, 4, encoded.payload_len,
                          codec=header.codec, codec_check=header.codec_check, flags=header.flags), ids,
                 encoded.payload, ready=encoded.ready)
        message = inbox.get()
        assert message.payload.is_pinned() and not message.ids.is_pinned()
        pageable = message.payload.clone()
        decoded.append(ends[1].decode(message.header, message.payload, message.ids))
        expected.append(ends[2].decode(message.header, pageable, message.ids))
        del message  # (its block may serve the next message)
    torch.cuda.synchronize()
    for got, want in zip(decoded, expected):
        assert torch.equal(got, want)
    box.close()
    inbox.close()


@needs_cuda
@pytest.mark.parametrize("spec,direction,fused_delta", [("aqsgd:3", "fw", ""), ("aqsgd:3", "fw", "0"),
                                                        ("directq:8", "bw", "")])
def test_the_capacity_plans_count_of_a_links_graphs_matches_what_they_hold_on_the_gpu(monkeypatch, spec, direction,
                                                                                     fused_delta):
    """`graph_calls` measured on the meta device (AQ-SGD's delta step fused, as by default at this size, and in torch
    ops; DirectQ's fused kernels) against each graph's pool segments and input copies as the caching allocator
    reports them: not above the count with the allocator's headroom and 2 MiB, not below half of it."""
    from aqpipe.compress.gpu import cuda_graphs, fused
    from aqpipe.compress.gpu.graph_memory import held_bytes
    from aqpipe.runtime.capacity.plan import ALLOCATOR_HEADROOM

    monkeypatch.setenv(fused.DELTA_SWITCH, fused_delta)
    cuda_graphs.clear()
    shape = (8, 256, 576)
    fusing = fused.delta_fusable(torch.device(DEVICE), shape, torch.float16, 3, "channel", "signed")
    assert fusing == (fused_delta == "" and DEVICE == "cuda" and _has_triton())
    ends = [build_codec(spec, direction, StoreView(memory_store(torch.float16, DEVICE, 16), 0, side), QuantOptions(),
                        device=DEVICE) for side in ("send", "recv")]
    x = torch.randn(shape, device=DEVICE)
    for visit in range(6):  # (AQ-SGD: two batches' first sights, then deltas) each graph captured at its second call
        ids = torch.arange(8) + 8 * (visit % 2)
        encoded = ends[0].encode(x + 0.01 * visit, ids, compress=True)
        ends[1].decode(_header(encoded, ends[0]), encoded.payload, ids)
    torch.cuda.synchronize()
    held = cuda_graphs.device_bytes()
    planned = {call.key: held_bytes(call) for sending, end in ((True, ends[0]), (False, ends[1]))
               for call in end.graph_calls(shape, sending)}
    assert len(held) >= 2 and set(held) <= set(planned), (held, planned)
    for key, actual in held.items():
        assert planned[key] / 2 <= actual <= planned[key] * ALLOCATOR_HEADROOM + (2 << 20), (key, actual, planned)
