"""Evaluation metrics, which held-out samples each replica evaluates, and held-out activations through the
evaluation codec."""

import json
import math

import pytest
import torch

from aqpipe.config import RunConfig, resolve
from aqpipe.launch.job import run_job
from aqpipe.pipeline.execution.evaluate import classification_metrics, eval_batches, held_out_samples
from tests import warm


def test_binary_mcc_matches_its_textbook_formula():
    tp, tn, fp, fn = 30, 50, 10, 5
    confusion = torch.tensor([[tn, fp], [fn, tp]])  # rows: true 0, true 1
    got = classification_metrics(confusion)
    expected = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert got["accuracy"] == pytest.approx(80 / 95)
    assert got["mcc"] == pytest.approx(expected)


def test_mcc_is_one_for_perfect_minus_one_for_inverted_and_zero_for_constant_predictions():
    assert classification_metrics(torch.tensor([[7, 0], [0, 3]]))["mcc"] == pytest.approx(1.0)
    assert classification_metrics(torch.tensor([[0, 7], [3, 0]]))["mcc"] == pytest.approx(-1.0)
    constant = classification_metrics(torch.tensor([[0, 7], [0, 3]]))  # always predicts class 1
    assert constant["mcc"] == 0.0 and constant["accuracy"] == pytest.approx(0.3)


def test_multiclass_mcc_of_a_random_classifier_is_near_zero():
    g = torch.Generator().manual_seed(0)
    truth, guess = torch.randint(0, 3, (30000,), generator=g), torch.randint(0, 3, (30000,), generator=g)
    confusion = torch.bincount(truth * 3 + guess, minlength=9).view(3, 3)
    assert abs(classification_metrics(confusion)["mcc"]) < 0.02


def test_replicas_evaluate_every_held_out_sample_exactly_once():
    seen = torch.cat([torch.cat(eval_batches(103, r, 3, 8)) for r in range(3)])
    assert sorted(seen.tolist()) == list(range(103))
    batches = eval_batches(10, 0, 1, 4)
    assert [b.numel() for b in batches] == [4, 4, 2]  # the last micro-batch may be short, never dropped


def test_a_pass_runs_on_the_first_eval_samples_of_the_split():
    assert held_out_samples(50, None) == 50 and held_out_samples(50, 8) == 8 and held_out_samples(5, 8) == 5


def eval_config(out, **kw) -> RunConfig:
    settings = dict(model="llama-tiny", pp=3, seq_len=32, micro_batch_size=2, micro_batches=2, steps=6, lr=3e-3,
                    warmup_steps=1, seed=3, max_samples=96, device="cpu", out=str(out), fw="aqsgd:4", eval_every=3)
    settings.update(kw)
    return resolve(RunConfig(**settings))


def eval_records(out) -> list[dict]:
    return [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in r]


@pytest.fixture(scope="module")
def fp32_and_compressed_evaluations(tmp_path_factory):
    """The same training run twice: its held-out activations sent in fp32, and with the default evaluation codec."""
    runs = {}
    for name, codec in (("fp32", "fp32"), ("default", RunConfig().eval_codec)):
        out = tmp_path_factory.mktemp(name) / "run"
        assert run_job(eval_config(out, eval_codec=codec), progress=False, starter=warm.ranks()) == 0
        runs[name] = out
    return runs


def test_evaluation_through_the_default_codec_is_within_0_3_percent_of_fp32_links(fp32_and_compressed_evaluations):
    fp32, default = (eval_records(fp32_and_compressed_evaluations[k]) for k in ("fp32", "default"))
    assert [r["step"] for r in fp32] == [r["step"] for r in default] == [3, 6]
    for exact, coded in zip(fp32, default):
        assert exact["loss"] == coded["loss"]  # evaluation never touches training
        assert exact["eval_samples"] == coded["eval_samples"] > 0
        assert coded["eval_loss"] != exact["eval_loss"]  # the held-out activations really were coded
        assert abs(coded["eval_loss"] - exact["eval_loss"]) <= 0.003 * exact["eval_loss"]
        assert coded["eval_bytes"] * 3 < exact["eval_bytes"]  # (7-bit tiles, and the tied rows it looks up)


def test_eval_samples_caps_every_pass(tmp_path):
    out = tmp_path / "run"
    assert run_job(eval_config(out, steps=2, eval_every=1, eval_samples=5), progress=False, starter=warm.ranks()) == 0
    assert [r["eval_samples"] for r in eval_records(out)] == [5, 5]


@pytest.mark.parametrize("codec", ["rtqo:7", "rtq:4", "directq:8"])
def test_a_held_out_activation_is_coded_alike_inside_a_stages_autocast(codec):
    """Evaluation sends and receives inside the stage's autocast (bf16/fp16 runs): the codec must code and decode
    there exactly as outside it, in fp32 (a Hadamard rotation run in half precision would lose what it rotates)."""
    import socket

    from aqpipe.compress.link.options import QuantOptions
    from aqpipe.compress.link.specs import LOSSLESS, check_eval_codec
    from aqpipe.pipeline.links.link_ends import ActivationIn, ActivationOut
    from aqpipe.pipeline.links.transport import KIND_ACTIVATION, SIDE_MASK, Inbox, Outbox
    from aqpipe.runtime.rank.assemble import evaluation_codec

    ours, theirs = socket.socketpair()
    cpu = torch.device("cpu")
    out = ActivationOut(0, KIND_ACTIVATION, evaluation_codec(LOSSLESS, QuantOptions(), cpu), Outbox(ours, "next", 5.0),
                        eval_codec=evaluation_codec(check_eval_codec(codec), QuantOptions(), cpu))
    inn = ActivationIn(0, KIND_ACTIVATION, evaluation_codec(LOSSLESS, QuantOptions(), cpu), Inbox(theirs, "prev", 5.0,
                       cpu), cpu, 2, (SIDE_MASK,), eval_codec=evaluation_codec(check_eval_codec(codec), QuantOptions(), cpu))
    try:
        x = torch.randn(2, 8, 96, generator=torch.Generator().manual_seed(0)) * 3
        x[:, 0, 5] = 3000.0  # a massive activation, as an attention sink's
        ids = torch.tensor([4, 9])
        received = []
        for mb, autocasting in enumerate((False, True)):
            inn.post_eval(0, mb, 2)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocasting):
                out.send_eval(0, mb, x, ids, None)
                received.append(inn.receive_eval()[0])
        assert received[1].dtype == torch.float32 and torch.equal(received[0], received[1])
    finally:
        out.close(abort=True)
        inn.close()
