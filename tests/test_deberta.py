"""DeBERTa-v2: pipeline layers equal the HF classifier, the relative-position table shared by every layer stays one
tensor across stages (tied gradients), and a 3-stage run trains and exports."""

import json

import pytest
import torch

from aqpipe.pipeline.numerics.tied import TiedGroup, sum_tied_grads, tied_sq_norm
from aqpipe.stages import deberta
from tests import warm


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small random DeBERTa-v3-style classifier saved as an HF directory, with aqpipe's BPE as its tokenizer."""
    from transformers import DebertaV2ForSequenceClassification, PreTrainedTokenizerFast

    from aqpipe.data.corpus import builtin_corpus
    from aqpipe.data.tokenizer import train_bpe

    directory = tmp_path_factory.mktemp("deberta")
    torch.manual_seed(0)
    model = DebertaV2ForSequenceClassification(deberta.deberta_config("deberta-tiny", 512, 2, dropout=0.0))
    model.save_pretrained(directory)
    special = "<|endoftext|>"
    PreTrainedTokenizerFast(tokenizer_object=train_bpe(builtin_corpus(), 512).tokenizer, cls_token=special,
                            sep_token=special, pad_token=special, unk_token=special).save_pretrained(directory)
    return directory


def test_pipeline_stages_reproduce_the_hf_classifier(checkpoint):
    from transformers import DebertaV2ForSequenceClassification

    spec = deberta.pretrained_deberta_spec(str(checkpoint), num_labels=2, dropout=0.0)
    stages = [spec.build_stage(0, 2).eval(), spec.build_stage(2, len(spec)).eval()]
    ids = torch.randint(1, 512, (3, 24))
    mask = torch.ones(3, 24, dtype=torch.uint8)
    mask[1, 10:] = 0
    inputs = torch.stack([ids, torch.zeros_like(ids)], dim=1)
    hf = DebertaV2ForSequenceClassification.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        hidden = inputs
        for stage in stages:
            hidden = stage(hidden, mask)
        reference = hf(input_ids=ids, attention_mask=mask.long()).logits
    assert torch.allclose(hidden, reference, atol=1e-5)
    rel = [layer.rel.rel_embeddings.weight for stage in stages for layer in stage if hasattr(layer, "rel")]
    assert len(rel) == 2 and torch.equal(rel[0], rel[1])  # each layer holds the same table


def test_tied_copies_take_the_sum_of_their_gradients_and_count_once_in_the_norm():
    spec = deberta.deberta_spec(deberta.deberta_config("deberta-tiny", 100, 2))
    stage = spec.build_stage(1, 3)  # both encoder layers: two copies of the table in one stage
    copies = [layer.rel.rel_embeddings.weight for layer in stage]
    assert torch.equal(copies[0], copies[1])  # randomly initialised alike, whichever rank builds them
    grads = [torch.randn_like(copies[0]), torch.randn_like(copies[0])]
    for copy, g in zip(copies, grads):
        copy.grad = g.clone()
    group = TiedGroup(deberta.TIE_NAME, tuple(tuple(p.shape) for p in stage[0].rel.parameters()), copies=2)
    sum_tied_grads(stage, [group], None, pp=1, device=torch.device("cpu"))
    share = tied_sq_norm(stage, [group])
    assert torch.allclose(copies[0].grad, grads[0] + grads[1]) and torch.equal(copies[0].grad, copies[1].grad)
    assert float(share) == pytest.approx(float((grads[0] + grads[1]).double().pow(2).sum()), rel=1e-6)


def test_a_three_stage_run_keeps_every_copy_equal_and_exports(checkpoint, tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "run"
    proc = warm.run("launch", "--model", str(checkpoint), "--pp", "3",
                           "--partition", "1,1,2", "--steps", "12", "--seq-len", "32", "--max-samples", "256",
                           "--lr", "1e-3", "--fw", "aqsgd:4", "--warmup-epochs", "0", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = [torch.load(out / "checkpoints" / "final" / f"stage-{k}.pt", weights_only=True) for k in range(3)]
    tables = [state[key] for state in stages for key in state if key.endswith("rel.rel_embeddings.weight")]
    assert len(tables) == 2 and torch.equal(tables[0], tables[1])  # one stage's copy each, updated identically
    initial = deberta.pretrained_deberta_spec(str(checkpoint), 2).build_layer(1).rel.rel_embeddings.weight
    assert not torch.equal(tables[0], initial)  # and really trained
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_samples"] > 0 and 0.0 <= summary["eval_accuracy"] <= 1.0
    model = AutoModelForSequenceClassification.from_pretrained(out / "export")
    assert torch.equal(model.deberta.encoder.rel_embeddings.weight, tables[0])
