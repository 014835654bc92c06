"""The fused quantization kernels (aqpipe.compress.gpu.fused): where they apply, and — under Triton's interpreter, on
CPU tensors with numpy's IEEE float32 — that they write the bytes and values of the torch ops they replace.
tests/test_gpu_codecs.py checks the same bits on a GPU."""

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from aqpipe.compress.gpu import fused
from tests import warm
from tests.fused_cases import INTERPRETER_PATCH, ROOT, interpret, needs_triton


@needs_triton
def test_the_kernels_write_the_bytes_and_values_of_the_torch_ops():
    """Every width 2–8 with every grid they take, every width on shapes with ragged tiles (each shape meeting every
    grid across its widths: a grid's arithmetic does not depend on the tiling, a width's packing does), an all-zero
    channel, −0, values past fp16 and values whose scale is an fp16 subnormal: rows, dequantized values and decoded
    values all bit-identical."""
    interpret("""
        import torch
        from aqpipe.compress.gpu import fused
        from aqpipe.compress.link.directq import decode_samples, encode_samples
        from aqpipe.compress.quantize import dequantize, quantize
        from tests.fused_cases import edge_case_batch

        torch.manual_seed(0)
        grids = ("signed", "symmetric", "uniform")
        for i, shape in enumerate([(2, 5, 16), (3, 37, 24), (2, 4, 3, 8), (1, 17, 72)]):
            for bits in range(2, 9):
                for grid in grids if i == 0 else [grids[(bits + i) % len(grids)]]:
                    x = edge_case_batch(shape)
                    assert fused.encodable(x, bits, "channel", False, grid)
                    q = quantize(x, bits, "channel", False, None, grid)
                    rows, values = fused.encode(x, bits, grid, values=True)
                    assert torch.equal(rows, encode_samples(q)), (shape, bits, grid)
                    assert torch.equal(values.view(torch.int32), dequantize(q, shape).view(torch.int32))
                    expected = decode_samples(rows, shape, bits, "channel", grid)
                    assert torch.equal(fused.decode(rows, shape, bits, grid).view(torch.int32),
                                       expected.view(torch.int32)), (shape, bits, grid)
        # a NaN or an inf: the channel's scale is NaN (or clamped) as torch's, so the receiver rebuilds NaN there and
        # `carried` refuses the row alike; the codes beside a NaN, undefined in torch, are left out
        from aqpipe.compress.link.sample_coders import scales_in_range
        for bits in (3, 8):
            for grid in ("signed", "symmetric"):
                x = torch.randn(2, 6, 16)
                x[0, 3, 5] = float("nan")
                x[1, 2, 6] = float("inf")
                x[1, 4, 7] = float("-inf")
                expected = encode_samples(quantize(x, bits, "channel", False, None, grid))
                rows, _ = fused.encode(x, bits, grid, values=False)
                scales, expected_scales = rows[:, :32].view(torch.float16), expected[:, :32].view(torch.float16)
                assert torch.equal(scales.isnan(), expected_scales.isnan()) and scales[0, 5].isnan()
                assert torch.equal(scales.nan_to_num(), expected_scales.nan_to_num())
                torch.testing.assert_close(decode_samples(rows, (2, 6, 16), bits, "channel", grid),
                                           decode_samples(expected, (2, 6, 16), bits, "channel", grid),
                                           rtol=0, atol=0, equal_nan=True)
                assert torch.equal(scales_in_range(rows, 16), scales_in_range(expected, 16))
        print("checked")
    """)


@needs_triton
def test_directq_and_aqsgd_send_the_same_bytes_with_the_kernels_as_without():
    """The link codecs through the kernels (the interpreter stands in for the GPU) against the same codecs with
    AQPIPE_FUSED_KERNELS=0: DirectQ's payloads, AQ-SGD's messages and both copies of m(ξ) agree bit for bit — m(ξ)
    kept a tensor per sample (the kernels read it gathered) and as a slab's rows (read in place, through slots that
    the shuffled visits put out of order), activations in float32 and in bfloat16 (which the kernels read as it is),
    with rows that cannot go as deltas: a NaN, a change whose scale passes fp16's largest, and a change whose scale
    fits but whose new m(ξ) would not."""
    interpret("""
        import os
        import torch
        from aqpipe.compress.link.options import QuantOptions
        from aqpipe.compress.link.factory import build_codec
        from aqpipe.pipeline.links.transport import Header
        from aqpipe.storage import MemoryStore, StoreView
        from aqpipe.storage.slab import SlabStore

        def run(switch, store, dtype):
            os.environ["AQPIPE_FUSED_KERNELS"] = switch
            torch.manual_seed(1)
            directq = build_codec("directq:4", "bw", options=QuantOptions())
            send, recv = store(), store()
            sender = build_codec("aqsgd:3", "fw", StoreView(send, 0, "send"), QuantOptions())
            receiver = build_codec("aqsgd:3", "fw", StoreView(recv, 0, "recv"), QuantOptions())
            out, fidelity[:] = [], []
            x = torch.randn(6, 9, 16)
            x[2, 4, 5] = 65000.0  # near fp16's largest (kept as 64992)
            for visit, order in enumerate([[0, 1, 2], [3, 4, 5], [2, 0, 1], [5, 3, 4], [1, 2, 0]]):
                ids = torch.tensor(order)
                x[ids] += 0.1 * torch.randn(3, 9, 16)
                e = directq.encode(x[ids], ids)
                out += [e.payload, directq.decode(Header.for_encoded(e, directq.code), e.payload, ids)]
                batch = x[ids].to(dtype)
                if visit == 3:
                    batch[1, 2, 3] = float("nan")  # sample 3: goes losslessly and loses m(ξ), either way
                if visit == 4:
                    batch[1, 4, 5] = 66000.0  # sample 2: its scale fits, but its new m(ξ) is past fp16's largest
                    batch[2, 1, 1] = 1e6  # sample 0: its scale does not fit
                e = sender.encode(batch, ids, compress=True)
                out += [e.payload, receiver.decode(Header.for_encoded(e, sender.code), e.payload, ids),
                        torch.tensor([e.codec_check])]
                fidelity.append(None if e.fidelity is None else e.fidelity.squares)
            for kept, side in ((send, "send"), (recv, "recv")):
                held = [i for i, here in zip(range(6), kept.present(0, side, list(range(6)))) if here]
                assert held == [1, 4, 5], held  # the others' values cannot be kept in fp16: dropped
                out.append(torch.stack(kept.get(0, side, held)))
            return out

        from aqpipe.compress.gpu import fused as kernels
        calls, fidelity = [], []
        for name in ("encode", "decode", "delta_encode", "delta_decode"):
            def counted(*args, _name=name, _f=getattr(kernels, name), **kw):
                calls.append(_name)
                return _f(*args, **kw)
            setattr(kernels, name, counted)
        # (m(ξ) in fp16: the interpreter casts float32 to bfloat16 by truncating, where a GPU rounds to nearest
        # even as torch does; tests/test_gpu_codecs.py checks a bfloat16 store on the GPU)
        memory, slab = lambda: MemoryStore(torch.float16), lambda: SlabStore(torch.float16, "cpu")
        for store, dtype in ((memory, torch.float32), (slab, torch.float32), (slab, torch.bfloat16)):
            calls.clear()
            fused = run("1", store, dtype)
            fused_fidelity = list(fidelity)
            # 5 DirectQ messages each way; AQ-SGD's deltas from the third visit on (the first two: fp32 first sights)
            expected = {"encode": 5, "decode": 5, "delta_encode": 3, "delta_decode": 3}
            assert {name: calls.count(name) for name in expected} == expected, calls
            assert not kernels._failed, kernels._failed  # (a failed launch would fall back to the torch ops)
            torch_ops = run("0", store, dtype)
            assert len(calls) == 16
            os.environ[kernels.DELTA_SWITCH] = "0"  # (off: AQ-SGD's delta step through the torch ops)
            calls.clear()
            run("1", store, dtype)
            assert sorted(set(calls)) == ["decode", "encode"], calls
            os.environ[kernels.DELTA_SWITCH] = "1"
            assert len(fused) == len(torch_ops)
            for a, b in zip(fused, torch_ops):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            # the fidelity norms: the same sums in another order
            assert [f is None for f in fused_fidelity] == [True, True, False, False, False]
            for a, b in zip(fused_fidelity[2:], fidelity[2:]):
                assert torch.allclose(a, b, rtol=1e-5), (a, b)
        print("checked")
    """)


@needs_triton
def test_the_verdicts_kernel_writes_each_samples_verdicts_and_the_batch_squares_as_the_torch_ops_sum_them():
    """A program a sample: every sample of a batch gets its verdict, checksum sum and norms (a sample whose scale is
    clamped among them), and the batch's squares are the sum `aqsgd_rows.delta_fidelity` takes of those norms —
    the same float64 bits."""
    interpret("""
        import torch
        from aqpipe.compress.gpu import fused
        from aqpipe.compress.link.aqsgd_rows import delta_fidelity
        from aqpipe.compress.link.checksum import CHECKSUM_WEIGHTS

        torch.manual_seed(3)
        x, m = torch.randn(5, 12, 24), (torch.randn(5, 12, 24) * 0.5).half()
        x[3, 2, 7] = 1e6  # sample 3's scale cannot be kept in fp16: it may not go as a delta
        done = fused.delta_encode(x, m, None, 3, "signed", CHECKSUM_WEIGHTS, 1)
        verdicts = done.verdicts.tolist()
        assert verdicts[:5] == [1, 1, 1, 0, 1], verdicts
        assert all(v != 0 for v in verdicts[5:]) and len(set(verdicts[5:])) == 5, verdicts
        assert bool((done.norms > 0).all()), done.norms
        want = delta_fidelity(done.norms, list(range(5))).squares
        assert torch.equal(done.squares, want), (done.squares, want)
        m_new, values, decoded = fused.delta_decode(done.payload[5:].view(5, -1), m, None, (5, 12, 24), 3, "signed",
                                                    CHECKSUM_WEIGHTS)
        assert decoded.tolist()[:5] == [1] * 5 and decoded.tolist()[5:] == verdicts[5:], (decoded, verdicts)
        print("checked")
    """)


@needs_triton
def test_the_kernels_checksum_sums_are_the_stores_over_many_ragged_tiles():
    """Each sample's checksum sum the codes and decode kernels form, over a batch of several tiles each way with
    ragged last tiles (the weights of each tile's words read from `fused.weight_parts`' tables by the words'
    positions), is the sum `checksum.row_sums` forms over the new m(ξ); a sample twice in a slab's slots too."""
    interpret("""
        import torch
        from aqpipe.compress.gpu import fused
        from aqpipe.compress.link.checksum import CHECKSUM_WEIGHTS, row_sums

        torch.manual_seed(4)
        shape = (3, 37, 136)  # 3 tiles of tokens (16, 16, 5) and 3 of channels (64, 64, 8) each
        x, m = torch.randn(shape), (torch.randn(shape) * 0.5).half()
        done = fused.delta_encode(x, m, None, 4, "signed", CHECKSUM_WEIGHTS, 1)
        assert done.verdicts.tolist()[3:] == row_sums(done.m_new).tolist()
        slab, slots = (torch.randn(5, 37, 136) * 0.5).half(), torch.tensor([4, 0, 4])
        m_new, values, decoded = fused.delta_decode(done.payload[3:].view(3, -1), slab, slots, shape, 4, "signed",
                                                    CHECKSUM_WEIGHTS)
        assert decoded.tolist()[3:] == row_sums(m_new).tolist()
        assert torch.equal(values, m_new.float())
        print("checked")
    """)


@needs_triton
def test_a_pipeline_through_the_fused_kernels_trains_bit_for_bit_as_through_the_torch_ops(tmp_path):
    """Two stages launched as a user launches them, AQ-SGD fw / DirectQ bw, three epochs of rtq:4 first sights then
    deltas: with every fused kernel on (the interpreter standing in for the GPU in each rank; AQ-SGD's delta step
    at every size) and with them all off, every step's loss and link bytes agree."""
    patch, ran = tmp_path / "patch", tmp_path / "kernels-ran.txt"
    patch.mkdir()
    # each process's interpreter patched (as `interpret` does), and each kernel call that coded a message noted
    (patch / "sitecustomize.py").write_text(INTERPRETER_PATCH + _NOTE_KERNEL_CALLS.format(log=str(ran)))
    flags = ["--model", "gpt2-tiny", "--pp", "2", "--seq-len", "32", "--max-samples", "8", "--micro-batch-size",
             "4", "--micro-batches", "2", "--epochs", "3", "--fw", "aqsgd:3", "--bw", "directq:6", "--device", "cpu",
             "--no-progress", "--eval-every", "0", "--first-sight", "rtq:4", "--warmup-epochs", "0"]
    records = {}
    for switch in ("1", "0"):
        env = {**os.environ, "AQPIPE_FUSED_KERNELS": switch, fused.DELTA_SWITCH: switch}
        if switch == "1":
            env.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(patch), str(ROOT)]))
        out = tmp_path / f"run-{switch}"
        if switch == "1":  # (a fresh interpreter: the patch applies as it starts)
            proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", *flags, "--out", str(out)], env=env,
                                  cwd=ROOT, capture_output=True, text=True, timeout=400)
        else:  # (the switches are read as each message is coded)
            proc = warm.run("launch", *flags, "--out", str(out), env=env, cwd=ROOT, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = (out / "metrics.jsonl").read_text().splitlines()
        records[switch] = [(r["loss"], r["fwd_bytes"], r["bwd_bytes"]) for r in map(json.loads, lines)]
    assert len(records["1"]) == 3 and records["1"][-1][1] < records["1"][0][1]  # (a step an epoch; deltas from the 2nd)
    assert records["1"] == records["0"]
    calls = ran.read_text().split()
    assert {name: calls.count(name) > 0 for name in ("encode", "decode", "delta_encode", "delta_decode")} == {
        "encode": True, "decode": True, "delta_encode": True, "delta_decode": True}, sorted(set(calls))


_NOTE_KERNEL_CALLS = """
from aqpipe.compress.gpu import fused as _fused
for _name in ("encode", "decode", "delta_encode", "delta_decode"):
    def _noted(*args, _call=getattr(_fused, _name), _name=_name, **kwargs):
        out = _call(*args, **kwargs)
        if out is not None:
            with open({log!r}, "a") as log:
                log.write(_name + "\\n")
        return out
    setattr(_fused, _name, _noted)
"""


@pytest.mark.parametrize("device,shape,bits,per,stochastic,grid", [
    ("cpu", (2, 8, 16), 4, "channel", False, "signed"),  # a CPU tensor: the torch ops (no interpreter here)
    ("cuda", (2, 16), 4, "channel", False, "signed"),  # 2-D: one scale per sample
    ("cuda", (2, 8, 12), 4, "channel", False, "signed"),  # channels not a multiple of 8
    ("cuda", (2, 8, 16), 4, "token", False, "signed"),
    ("cuda", (2, 8, 16), 4, "channel", True, "signed"),  # stochastic rounding draws
    ("cuda", (2, 8, 16), 1, "channel", False, "signed"),  # one bit: the mean |x| scale
    ("cuda", (2, 8, 16), 4, "channel", False, "fit"),  # its scale divides by a scalar: left to torch
    ("cuda", (2, 0, 16), 4, "channel", False, "signed"),
])
def test_the_kernels_apply_only_where_they_code_the_same_bits(monkeypatch, device, shape, bits, per, stochastic,
                                                             grid):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fused, "_kernels", lambda: object())  # as if Triton were there
    batch = SimpleNamespace(device=torch.device(device), shape=shape, dtype=torch.float32)  # (what encodable reads)
    assert not fused.encodable(batch, bits, per, stochastic, grid)  # type: ignore[arg-type]
    assert fused.fusable(torch.device(device), shape, bits, per, grid) == (stochastic and device == "cuda")


def test_on_the_meta_device_the_kernels_outputs_are_made_as_on_a_gpu_and_nothing_runs(monkeypatch):
    """What a GPU's codec graphs hold is measured on the meta device (`aqpipe.compress.gpu.graph_memory`): there the
    kernels apply where they would on a GPU, and make their outputs without launching."""
    if fused._kernels() is None:
        pytest.skip("Triton is not installed")
    monkeypatch.setenv(fused.DELTA_SWITCH, "1")
    x, m_old = torch.empty(2, 8, 16, device="meta"), torch.empty(2, 8, 16, device="meta", dtype=torch.float16)
    assert fused.encodable(x, 4, "channel", False, "signed")
    assert fused.delta_fusable(x.device, tuple(x.shape), torch.float16, 4, "channel", "signed")
    rows, values = fused.encode(x, 4, "signed", values=True)
    assert rows.device.type == "meta" and rows.shape == (2, fused.row_bytes(8, 16, 4)) and values.shape == x.shape
    assert fused.decode(rows, (2, 8, 16), 4, "signed").shape == (2, 8, 16)
    slab, slots = torch.empty(5, 8, 16, device="meta", dtype=torch.float16), torch.empty(2, dtype=torch.int64,
                                                                                      device="meta")
    for m, at in ((m_old, None), (slab, slots)):
        done = fused.delta_encode(x, m, at, 4, "signed", (40503, 65521), 1)
        assert done.payload.shape == (2 + rows.numel(),) and done.m_new.shape == x.shape
        assert (done.m_new.dtype, done.verdicts.shape, done.norms.shape, done.squares.shape) == (
            torch.float16, (4,), (2, 3), (3,))
        m_new, values, verdicts = fused.delta_decode(rows, m, at, (2, 8, 16), 4, "signed", (40503, 65521))
        assert m_new.shape == values.shape == (2, 8, 16) and verdicts.shape == (4,) and not fused._failed


def test_the_delta_kernels_refuse_m_rows_that_do_not_hold_the_batch():
    if fused._kernels() is None:
        pytest.skip("Triton is not installed")
    x, rows = torch.empty(2, 8, 16, device="meta"), torch.empty(2, fused.row_bytes(8, 16, 4), dtype=torch.uint8,
                                                                 device="meta")
    slab = torch.empty(5, 8, 16, device="meta", dtype=torch.float16)
    with pytest.raises(ValueError, match="m\\(xi\\) of 5 samples for a batch of 2"):
        fused.delta_encode(x, slab, None, 4, "signed", (40503, 65521), 1)
    for slots in (torch.empty(3, dtype=torch.int64, device="meta"), torch.empty(2, dtype=torch.int32, device="meta"),
                  torch.zeros(2, dtype=torch.int64)):
        with pytest.raises(ValueError, match="slots must be int64 \\[2\\] on meta"):
            fused.delta_decode(rows, slab, slots, (2, 8, 16), 4, "signed", (40503, 65521))
    with pytest.raises(ValueError, match="modulus 65537 must lie in 1..65536"):  # (a word's product: int32)
        fused.delta_encode(x, slab[:2], None, 4, "signed", (40503, 65537), 1)
    with pytest.raises(ValueError, match="in place only into a slab's rows"):
        fused.delta_encode(x, slab[:2], None, 4, "signed", (40503, 65521), 1, in_place=True)
    other = torch.empty(5, 16, 8, device="meta", dtype=torch.float16)  # (as many values a row, another shape)
    with pytest.raises(ValueError, match="m\\(xi\\) rows of shape \\(16, 8\\) for samples of shape \\(8, 16\\)"):
        fused.delta_decode(rows, other, torch.empty(2, dtype=torch.int64, device="meta"), (2, 8, 16), 4, "signed",
                           (40503, 65521))


def test_the_kernels_apply_on_a_gpu_unless_switched_off_or_without_triton(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fused, "_kernels", lambda: object())
    assert fused.fusable(cuda, (4, 128, 576), 3, "channel", "signed")
    assert fused.fusable(cuda, (4, 2, 64, 8), 8, "channel", "uniform")
    monkeypatch.setenv("AQPIPE_FUSED_KERNELS", "0")
    assert not fused.fusable(cuda, (4, 128, 576), 3, "channel", "signed")
    monkeypatch.delenv("AQPIPE_FUSED_KERNELS")
    monkeypatch.setattr(fused, "_kernels", lambda: None)
    assert not fused.fusable(cuda, (4, 128, 576), 3, "channel", "signed")


def test_aqsgds_delta_step_is_fused_by_default_from_a_million_values(monkeypatch):
    """Below `DELTA_MIN_ELEMENTS` a fused delta step was no faster on a GPU (a message's time is its launches and
    waits there), above it up to twice as fast; AQPIPE_FUSED_AQSGD=1 fuses every size, 0 none."""
    cuda, fp16 = torch.device("cuda"), torch.float16
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(fused.DELTA_SWITCH, raising=False)
    monkeypatch.setattr(fused, "_kernels", lambda: object())
    small, smollm2_gpu_batch = (4, 128, 576), (8, 1024, 576)
    assert fused.DELTA_MIN_ELEMENTS == 1 << 20 and math.prod(small) < fused.DELTA_MIN_ELEMENTS
    assert not fused.delta_fusable(cuda, small, fp16, 3, "channel", "signed")
    assert fused.delta_fusable(cuda, smollm2_gpu_batch, fp16, 3, "channel", "signed")
    assert fused.delta_fusable(cuda, (1, 1024, 1024), torch.bfloat16, 3, "channel", "signed")  # exactly the bound
    assert not fused.delta_fusable(cuda, (1, 1023, 1024), torch.bfloat16, 3, "channel", "signed")
    assert not fused.delta_fusable(cuda, smollm2_gpu_batch, torch.float32, 3, "channel", "signed")  # fp32 m(ξ)
    assert not fused.delta_fusable(torch.device("cpu"), smollm2_gpu_batch, fp16, 3, "channel", "signed")
    monkeypatch.setenv(fused.DELTA_SWITCH, "1")
    assert fused.delta_fusable(cuda, small, fp16, 3, "channel", "signed")
    monkeypatch.setenv(fused.DELTA_SWITCH, "0")
    assert not fused.delta_fusable(cuda, smollm2_gpu_batch, fp16, 3, "channel", "signed")


def test_decode_refuses_rows_of_the_wrong_width():
    if fused._kernels() is None:
        pytest.skip("Triton is not installed")
    with pytest.raises(ValueError, match="cannot hold"):
        fused.decode(torch.zeros(2, 10, dtype=torch.uint8), (2, 4, 8), 4, "signed")


def _unlaunchable_kernels(monkeypatch) -> None:
    """Kernels that Triton cannot launch (as where it cannot compile for the GPU), standing for the real ones; a CPU
    tensor counts as theirs (the interpreter's switch), and no failure is remembered yet."""
    class Unlaunchable:
        def __getitem__(self, grid):
            raise RuntimeError("no compiler for this GPU")

    kernels = SimpleNamespace(scales_kernel=Unlaunchable(), codes_kernel=Unlaunchable(), decode_kernel=Unlaunchable(),
                              verdicts_kernel=Unlaunchable(), SCALE_T=32, SCALE_C=32, TILE_T=16, TILE_C=64,
                              VERDICT_P=256, VERDICT_C=256, OPTIONS={},
                              WARPS=dict.fromkeys(("scales", "codes", "decode", "delta_decode", "verdicts"), 4))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused, "_kernels", lambda: kernels)
    monkeypatch.setattr(fused, "_failed", [])


def test_kernels_that_fail_to_launch_turn_off_with_one_warning_and_the_torch_ops_code(monkeypatch, caplog):
    from aqpipe.compress.link.options import QuantOptions
    from aqpipe.compress.link.sample_coders import QuantCoder

    _unlaunchable_kernels(monkeypatch)
    coder = QuantCoder(4, QuantOptions())
    x = torch.randn(2, 8, 16)
    assert fused.failure() is None
    with caplog.at_level("WARNING", logger="aqpipe.compress.gpu.fused"):
        rows, values = coder._encode(x, values=True)
        decoded = coder._decode(rows, tuple(x.shape))
        coder._encode(x, values=False)
    assert [r.message for r in caplog.records] == [
        "fused codec kernels off, the torch ops code from now on: RuntimeError: no compiler for this GPU"]
    assert fused.failure() == "RuntimeError: no compiler for this GPU"
    assert not fused.fusable(x.device, tuple(x.shape), 4, "channel", "signed")
    monkeypatch.setenv("AQPIPE_FUSED_KERNELS", "0")
    assert torch.equal(rows, coder._encode(x, values=False)[0])
    assert torch.equal(decoded, values)


@pytest.mark.parametrize("proven", [set(), {"encode", "decode"}], ids=["first-run", "in-place"])
def test_aqsgds_delta_step_falls_back_to_the_torch_ops_when_its_kernels_fail_to_launch(monkeypatch, caplog, proven):
    """The first delta message finds the kernels unlaunchable: it goes through the torch ops, with the same bytes
    and the same m(ξ) on both sides as a link that never tried them, and so does every message after it — whether
    the kernels would have written m(ξ) apart or (having run in the process before, say for another shape) in place
    over a slab's rows, from the step's graph (a failure before anything is written is no divergence)."""
    from aqpipe.compress.link.factory import build_codec
    from aqpipe.compress.link.options import QuantOptions
    from aqpipe.pipeline.links.transport import Header
    from aqpipe.storage import StoreView
    from aqpipe.storage.slab import SlabStore

    _unlaunchable_kernels(monkeypatch)
    monkeypatch.setattr(fused, "_proven", set(proven))
    monkeypatch.setenv(fused.DELTA_SWITCH, "1")
    links = []
    for _ in range(2):
        stores = SlabStore(torch.float16, "cpu"), SlabStore(torch.float16, "cpu")
        links.append([build_codec("aqsgd:3", "fw", StoreView(store, 0, side), QuantOptions())
                      for store, side in zip(stores, ("send", "recv"))] + list(stores))
    x, ids = torch.randn(3, 4, 16), torch.tensor([2, 0, 1])
    with caplog.at_level("WARNING", logger="aqpipe.compress.gpu.fused"):
        for visit in range(3):
            sent = []
            for switch, (sender, receiver, _, _) in zip(("1", "0"), links):
                monkeypatch.setenv("AQPIPE_FUSED_KERNELS", switch)
                e = sender.encode(x + 0.1 * visit, ids, compress=True)
                sent.append((e.payload, receiver.decode(Header.for_encoded(e, sender.code), e.payload, ids)))
            assert all(torch.equal(a, b) for a, b in zip(*sent)), visit
    assert [r.message for r in caplog.records] == [
        "fused codec kernels off, the torch ops code from now on: RuntimeError: no compiler for this GPU"]
    for store, side in ((2, "send"), (3, "recv")):
        assert torch.equal(torch.stack(links[0][store].get(0, side, [0, 1, 2])),
                           torch.stack(links[1][store].get(0, side, [0, 1, 2])))
