"""Real rows (`--link-rows real`): only the positions a sample's mask marks cross a link, in every codec and both
directions; m(ξ) keeps only them; the padded batch is rebuilt on the other side; with fp32 links the trained model is
the padded links' bit for bit."""

import json
import socket
import struct

import pytest
import torch

from aqpipe.cli import main
from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.config import RunConfig, resolve
from aqpipe.launch.job import run_job
from aqpipe.pipeline.links import real_rows
from aqpipe.pipeline.links.link_ends import ActivationIn, ActivationOut, GradientIn, GradientOut
from aqpipe.pipeline.links.real_rows import RealRows
from aqpipe.pipeline.links.transport import (
    KIND_ACTIVATION,
    KIND_GRADIENT,
    SIDE_MASK,
    SIDE_RESEED,
    Inbox,
    Outbox,
    TransportError,
)
from aqpipe.storage import MemoryStore, StoreView
from tests import warm

CPU = torch.device("cpu")
CODECS = ["fp32", "bf16", "directq:8", "directq:3", "rtq:4", "rtqo:5", "tahq", "aqsgd:3", "aqsgd-rtq:3"]


def masks() -> dict[str, torch.Tensor]:
    """Right padding, left padding, a mask with a hole (BERT-style pairs), and a sample with no real row."""
    right = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 2 + [0] * 6, [1] * 5 + [0] * 3], dtype=torch.uint8)
    return {"right": right, "left": right.flip(1), "holes": torch.tensor(
        [[1, 1, 0, 1, 1, 0, 0, 1], [1] * 8, [0, 1, 1, 1, 0, 0, 0, 0], [1, 0] * 4], dtype=torch.uint8),
        "a fully padded sample": torch.tensor([[1] * 3 + [0] * 5, [0] * 8, [1] * 8, [0] * 8], dtype=torch.uint8)}


@pytest.mark.parametrize("name", list(masks()))
def test_the_groups_hold_each_samples_real_rows_in_order_and_scatter_rebuilds_the_batch(name):
    mask = masks()[name]
    x = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(1))
    rows = RealRows.of(mask, tuple(x.shape))
    assert rows is not None and rows.real_count() == int(mask.sum())
    seen = []
    for (index, positions), part in zip(rows.groups, rows.gather(x)):
        assert len(set(positions.shape[1:])) == 1 and part.shape == (index.numel(), positions.shape[1], 6)
        for j, i in enumerate(index.tolist()):
            seen.append(i)
            assert torch.equal(positions[j], mask[i].nonzero()[:, 0])
            assert torch.equal(part[j], x[i][mask[i] != 0])
    assert sorted(seen) == [i for i in range(4) if mask[i].any()]
    rebuilt = rows.scatter(rows.gather(x))
    assert torch.equal(rebuilt, x * (mask != 0)[:, :, None])


@pytest.mark.parametrize("mask,shape", [
    (None, (4, 8, 6)),
    (torch.ones(4, 8, dtype=torch.uint8), (4, 8, 6)),  # nothing padded
    (torch.zeros(4, 8, dtype=torch.uint8), (4, 8, 6)),  # nothing real
    (torch.ones(4, 7, dtype=torch.uint8), (4, 8, 6)),  # a mask of another batch
    (torch.ones(4, 8, dtype=torch.uint8), (4, 8)),  # one value a sample
])
def test_a_batch_that_is_not_padded_goes_as_an_ordinary_message(mask, shape):
    assert RealRows.of(mask, shape) is None


class Link:
    """Both ends of one link over a socket pair: activations one way, gradients the other, each end's codec made
    of `spec` (AQ-SGD with its two m(ξ) copies)."""

    def __init__(self, spec: str, real: bool = True):
        direction = "bw" if spec in ("directq:3", "rtq:4") else "fw"
        self.stores = MemoryStore(torch.float32), MemoryStore(torch.float32)
        views = StoreView(self.stores[0], 0, "send"), StoreView(self.stores[1], 0, "recv")
        options = QuantOptions(per="token")

        def codec(side):
            return build_codec(spec, "fw" if spec.startswith("aqsgd") or spec == "tahq" else direction,
                               views[side] if spec.startswith("aqsgd") else None, options, first_sight="rtq:4")

        a, b = socket.socketpair()
        c, d = socket.socketpair()
        self.out = ActivationOut(0, KIND_ACTIVATION, codec(0), Outbox(a, "stage 1", 5.0), real_rows=real)
        self.inn = ActivationIn(0, KIND_ACTIVATION, codec(1), Inbox(b, "stage 0", 5.0, CPU), CPU, 4, (SIDE_MASK,))
        self.grad_out = GradientOut(0, KIND_GRADIENT, build_codec("fp32", "bw"), Outbox(c, "stage 0", 5.0),
                                    real_rows=real)
        self.grad_in = GradientIn(0, KIND_GRADIENT, build_codec("fp32", "bw"), Inbox(d, "stage 1", 5.0, CPU), CPU, 4,
                                  (SIDE_RESEED,))

    def activation(self, step, x, ids, mask):
        self.inn.post(step, 0)
        self.out.send(step, 0, x, ids, mask, compress=True)
        return self.inn.receive()

    def close(self):
        for end in (self.out, self.grad_out):
            end.close(abort=True)
        for end in (self.inn, self.grad_in):
            end.close()


def coded_alone(codec, rows: torch.Tensor) -> torch.Tensor:
    """What a stateless `codec` makes of one sample's rows [1, L, H] sent on their own."""
    from aqpipe.pipeline.links.transport import Header

    encoded = codec.encode(rows, torch.tensor([0]))
    return codec.decode(Header.for_encoded(encoded, codec.code, n_ids=1), encoded.payload, torch.tensor([0]))


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("name", list(masks()))
def test_every_codec_sends_only_the_real_rows_and_the_receiver_rebuilds_the_padded_batch(spec, name):
    """What arrives at a real position is what the codec makes of the sample's real rows alone; padded positions
    arrive as zeros; the payload is the real rows' (AQ-SGD: both m(ξ) copies identical, each only real rows)."""
    mask = masks()[name]
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([10, 11, 12, 13])
    real, padded = Link(spec), Link(spec, real=False)
    try:
        for step in range(3):  # (AQ-SGD: first sights, then deltas)
            x = x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + step))
            got, got_ids, got_mask = real.activation(step, x, ids, mask)
            full, _, _ = padded.activation(step, x, ids, mask)
            assert torch.equal(got_ids, ids) and torch.equal(got_mask.view(4, 8), mask)
            assert torch.equal(got[mask == 0], torch.zeros_like(got[mask == 0]))
            error = (got - x)[mask != 0].norm() / x[mask != 0].norm()
            assert error < (1e-6 if spec == "fp32" else 0.3), error
            if spec == "fp32":
                assert torch.equal(got[mask != 0], full[mask != 0])
            if not spec.startswith("aqsgd"):  # a stateless codec: each real row is its sample's real rows coded alone
                for i in range(4):
                    if mask[i].any():
                        coded = coded_alone(real.out.codec, x[i][mask[i] != 0][None])
                        assert torch.equal(got[i][mask[i] != 0], coded[0]), (spec, i)
        counters = real.out.counters, padded.out.counters
        assert counters[0].payload_bytes < counters[1].payload_bytes * (int(mask.sum()) / mask.numel() + 0.15)
        if spec.startswith("aqsgd"):  # (a sample without a real row has no m(ξ), and no re-seed asks for one)
            assert real.inn.missing([*ids.tolist(), 99]) == [99]  # (99: never seen)
            for i, sample in enumerate(ids.tolist()):
                kept = [store._values.get((0, side, sample)) for store, side in zip(real.stores, ("send", "recv"))]
                if not mask[i].any():
                    assert kept == [None, None]
                    continue
                assert kept[0].shape == (int(mask[i].sum()), 64) and torch.equal(kept[0], kept[1])
    finally:
        real.close()
        padded.close()


def test_a_gradient_is_rebuilt_where_the_mask_its_activation_went_with_says():
    link = Link("fp32")
    try:
        mask = masks()["left"]
        grad = torch.randn(4, 8, 16) * (mask != 0)[:, :, None]
        link.grad_in.post(0, 0)
        link.grad_out.send(0, 0, grad, torch.arange(4), True, [7, 9], mask=mask)
        assert link.grad_out.counters.payload_bytes == int(mask.sum()) * 16 * 4
        assert link.grad_out.counters.elements == int(mask.sum()) * 16
        got, reseed = link.grad_in.receive(mask)
        assert torch.equal(got, grad) and reseed == [7, 9]
    finally:
        link.close()


def test_a_real_rows_message_that_does_not_fit_its_mask_is_refused_naming_the_peer():
    link = Link("fp32")
    try:
        mask = masks()["right"]
        link.grad_in.post(0, 0)
        link.grad_out.send(0, 0, torch.randn(4, 8, 16), torch.arange(4), True, mask=mask)
        other = torch.ones(4, 8, dtype=torch.uint8)
        other[:, 7] = 0  # every sample 7 real rows: one group, where the sender made three
        with pytest.raises(TransportError, match="stage 1.*real rows do not match the 1 groups"):
            link.grad_in.receive(other)
    finally:
        link.close()
    link = Link("fp32")
    try:
        link.grad_in.post(0, 0)
        link.grad_out.send(0, 0, torch.randn(4, 8, 16), torch.arange(4), True, mask=masks()["right"])
        with pytest.raises(TransportError, match="without a mask"):
            link.grad_in.receive(None)
    finally:
        link.close()


def test_a_group_whose_directory_entry_disagrees_with_the_codec_is_refused():
    codec = build_codec("directq:8", "fw")
    mask = masks()["right"]
    rows = RealRows.of(mask, (4, 8, 16))
    grouped = real_rows.encode(codec, torch.randn(4, 8, 16), torch.arange(4), True, rows)
    header = real_rows.header_of(grouped, codec, KIND_ACTIVATION, 0, 0, (4, 8, 16), 4, SIDE_MASK)
    payload = torch.cat([grouped.directory, *(part.host for part in grouped.parts)])
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    grouped = real_rows.encode(codec, x, torch.arange(4), True, rows)
    payload = torch.cat([grouped.directory, *(part.host for part in grouped.parts)])
    decoded = real_rows.decode(codec, header, payload, torch.arange(4), mask, "p")
    assert torch.equal(decoded[mask == 0], torch.zeros(int((mask == 0).sum()), 16))
    assert (decoded - x)[mask != 0].norm() < 0.02 * x[mask != 0].norm()
    bad = payload.clone()
    bad[: real_rows.ENTRY.size] = torch.frombuffer(bytearray(real_rows.ENTRY.pack(
        grouped.parts[0].payload_len, 0, 3 << 8, 4)), dtype=torch.uint8)  # 3 bits: another codec
    with pytest.raises(TransportError, match="a group of its real rows: the peer sends codec"):
        real_rows.decode(codec, header, bad, torch.arange(4), mask, "p")
    assert real_rows.accepting(codec)(header) is None
    other = build_codec("directq:4", "fw")
    assert "decodes directq:4" in real_rows.accepting(other)(header)
    assert struct.calcsize("<qIIB7x") == real_rows.ENTRY.size


# -- whole runs ------------------------------------------------------------------------------------------------------

def run(tmp_path, name, **kw) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Train a run through the launcher's job; its step records and its final weights."""
    from safetensors.torch import load_file

    assert run_job(resolve(RunConfig(out=str(tmp_path / name), **kw)), progress=False, starter=warm.ranks()) == 0
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return records, load_file(tmp_path / name / "export" / "model.safetensors")


@pytest.mark.parametrize("model,kw", [
    ("llama-tiny", dict(data="builtin-instruct", seq_len=64, max_samples=48)),  # a causal LM, right padding
    ("bert-tiny", dict(task="classify", seq_len=32, max_samples=64)),  # a classifier, a bidirectional mask
])
def test_real_rows_train_the_padded_links_model_bit_for_bit_with_fp32_links(tmp_path, monkeypatch, model, kw):
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    common = dict(model=model, pp=3, fw="fp32", bw="fp32", epochs=1, micro_batch_size=4, micro_batches=2, **kw)
    real = run(tmp_path, "real", link_rows="real", **common)
    padded = run(tmp_path, "padded", link_rows="padded", **common)
    assert [r["loss"] for r in real[0]] == [r["loss"] for r in padded[0]]
    assert real[0][-1]["eval_loss"] == padded[0][-1]["eval_loss"]  # (the held-out pass after the last step)
    assert [r.get("eval_loss") for r in real[0]] == [r.get("eval_loss") for r in padded[0]]
    assert real[1].keys() == padded[1].keys()
    for key in real[1]:
        assert torch.equal(real[1][key], padded[1][key]), key
    for direction in ("fwd_bytes", "bwd_bytes"):
        assert sum(r[direction] for r in real[0]) < 0.9 * sum(r[direction] for r in padded[0]), direction


def test_a_stage_computes_the_same_real_rows_and_gradients_from_zeros_at_left_padded_positions():
    """What real rows change at a stage: its input's padded positions are zeros, not what the stage before computed
    there, and its output's padded positions get a zero gradient (exactly what padded links carry there). With left
    padding (fully masked queries at the start) the real outputs and every parameter's gradient stay bit for bit."""
    from aqpipe.stages.llama import PRESETS, decoder_spec, llama_config

    spec = decoder_spec(llama_config("llama-tiny", 50))
    mask = masks()["left"]
    hidden = torch.randn(4, 8, PRESETS["llama-tiny"]["hidden_size"], generator=torch.Generator().manual_seed(4))
    results = []
    for zeros in (False, True):
        torch.manual_seed(0)
        stage = spec.build_stage(1, 3)
        x = (hidden * (mask != 0)[:, :, None] if zeros else hidden).clone().requires_grad_(True)
        out = stage(x, mask)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)) * (mask != 0)[:, :, None]
        out.backward(grad)
        results.append((out[mask != 0], {n: p.grad.clone() for n, p in stage.named_parameters()},
                        x.grad[mask != 0], x.grad[mask == 0]))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][2], results[1][2])
    assert not bool(results[0][3].any())  # what padded links carry back at padded positions: exact zeros
    for name, g in results[0][1].items():
        assert torch.equal(g, results[1][1][name]), name


def test_a_bad_link_rows_value_exits_2_with_one_line(tmp_path, capsys):
    assert main(["launch", "--model", "llama-tiny", "--link-rows", "some", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["aqpipe: error: --link-rows 'some' is not one of real, padded"], err


def test_real_rows_resume_bit_exact_and_both_lmdb_copies_of_m_hold_each_samples_real_rows(tmp_path, monkeypatch):
    """AQ-SGD over real rows with m(ξ) on disk: a run stopped at its checkpoint and resumed ends with the uninterrupted
    run's weights bit for bit; `store verify` finds both copies identical, and each kept m(ξ) is its sample's real
    rows (the store holds no padded position)."""
    from safetensors.torch import load_file

    from aqpipe.data.dataset import prepare_instruct_dataset
    from aqpipe.storage.lmdb_store import LMDBStore, store_path

    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    common = ["--model", "llama-tiny", "--data", "builtin-instruct", "--pp", "3", "--max-samples", "32", "--seq-len",
              "64", "--micro-batch-size", "4", "--micro-batches", "2", "--fw", "aqsgd:3", "--store", "lmdb",
              "--checkpoint-every", "4", "--eval-every", "0", "--no-progress"]
    straight = warm.run("launch", *common, "--steps", "8", "--out", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = warm.run("launch", *common, "--steps", "4", "--out", str(tmp_path / "run"))
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = warm.run("launch", "--resume", str(tmp_path / "run"), "--steps", "8", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    weights = [load_file(tmp_path / name / "export" / "model.safetensors") for name in ("straight", "run")]
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
    verify = warm.run("store", "verify", str(tmp_path / "run"))
    assert verify.returncode == 0 and "0 mismatch(es) in 64 m(xi) entries" in verify.stdout, verify.stdout
    lengths = prepare_instruct_dataset("builtin-instruct", 64, max_samples=32).train.attention.sum(dim=1)
    assert int(lengths.min()) < 64  # (the run's samples are padded)
    for rank in range(3):
        store = LMDBStore(store_path(tmp_path / "run", rank), readonly=True)
        try:
            kept = list(store.items())
        finally:
            store.close()
        assert kept and all(value.shape == (int(lengths[sample]), 64) for (_, _, sample), value in kept)


def test_a_run_recorded_before_link_rows_existed_resumes_padded_bit_for_bit(tmp_path, monkeypatch):
    """A run directory written before `--link-rows` (no such key in its config.json or its checkpoint's record; its
    rank files' digests made without it) is a padded run: `--resume` and the same command typed again continue it
    with padded links, its in-memory m(ξ) restored, to the weights of an uninterrupted padded run bit for bit."""
    from safetensors.torch import load_file

    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    common = ["--model", "llama-tiny", "--data", "builtin-instruct", "--pp", "3", "--max-samples", "32", "--seq-len",
              "64", "--micro-batch-size", "4", "--micro-batches", "2", "--checkpoint-every", "4", "--eval-every", "0",
              "--no-progress"]
    straight = warm.run("launch", *common, "--link-rows", "padded", "--steps", "8", "--out", str(tmp_path / "ref"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    for name in ("resumed", "again"):
        run = tmp_path / name
        first = warm.run("launch", *common, "--link-rows", "padded", "--steps", "4", "--out", str(run))
        assert first.returncode == 0, first.stderr[-2000:]
        for record, key in ((run / "config.json", None), (run / "checkpoints" / "step-00000004" / "run.json", "config")):
            data = json.loads(record.read_text())
            (data[key] if key else data).pop("link_rows")
            record.write_text(json.dumps(data, indent=2))
    resumed = warm.run("launch", "--resume", str(tmp_path / "resumed"), "--steps", "8", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = warm.run("launch", *common, "--link-rows", "padded", "--steps", "8", "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "re-seed" not in resumed.stderr + again.stderr, resumed.stderr + again.stderr
    reference = load_file(tmp_path / "ref" / "export" / "model.safetensors")
    for name in ("resumed", "again"):
        weights = load_file(tmp_path / name / "export" / "model.safetensors")
        for key in reference:
            assert torch.equal(weights[key], reference[key]), (name, key)


def test_a_padded_batchs_groups_are_coded_op_by_op_never_captured_as_cuda_graphs(monkeypatch):
    """Each group's shape (its samples, their real rows) changes from message to message: on a GPU the codec runs it
    op by op, in encoding and decoding, and graphs go on replaying everything else."""
    import threading

    from aqpipe.compress.gpu import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "_replays_on", lambda device: True)  # (as on a GPU)
    cuda = torch.device("cuda")
    assert cuda_graphs.may_replay(cuda)
    codec = build_codec("directq:8", "fw")
    seen = []
    def spying(real):
        def spy(*args, **kwargs):
            seen.append(cuda_graphs.may_replay(cuda))
            return real(*args, **kwargs)
        return spy

    for name in ("encode", "decode"):
        monkeypatch.setattr(codec, name, spying(getattr(codec, name)))
    mask = masks()["right"]
    rows = RealRows.of(mask, (4, 8, 16))
    grouped = real_rows.encode(codec, torch.randn(4, 8, 16), torch.arange(4), True, rows)
    header = real_rows.header_of(grouped, codec, KIND_ACTIVATION, 0, 0, (4, 8, 16), 4, SIDE_MASK)
    payload = torch.cat([grouped.directory, *(part.host for part in grouped.parts)])
    real_rows.decode(codec, header, payload, torch.arange(4), mask, "p")
    assert seen == [False] * (2 * len(rows.groups)) and cuda_graphs.may_replay(cuda)
    other = []  # (another thread, meanwhile, still replays)
    with cuda_graphs.op_by_op():
        thread = threading.Thread(target=lambda: other.append(cuda_graphs.may_replay(cuda)))
        thread.start()
        thread.join()
    assert other == [True]
