"""The GPT-2 adapter: the pipeline layers compute exactly what HF's GPT2LMHeadModel computes."""

import pytest
import torch
from torch import nn

from aqpipe.stages import gpt2
from aqpipe.stages.models import build_spec, classify_model
from aqpipe.stages.spec import SpecError


def hf_model(vocab=300):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_layer=3, n_embd=32, n_head=4, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).eval()


def test_layers_are_embeddings_blocks_and_head():
    spec = gpt2.gpt2_spec(gpt2.gpt2_config("gpt2-tiny", 500))
    layers = [spec.build_layer(i) for i in range(len(spec))]
    assert len(layers) == 4 + 2
    assert isinstance(layers[0], gpt2.GPT2Embeddings) and isinstance(layers[-1], gpt2.GPT2Head)
    assert all(isinstance(layer, gpt2.GPT2BlockLayer) for layer in layers[1:-1])


def test_pretrained_directory_gives_hf_logits(tmp_path):
    model = hf_model()
    model.save_pretrained(tmp_path / "ckpt")
    spec = gpt2.pretrained_gpt2_spec(str(tmp_path / "ckpt"))
    pipeline = nn.Sequential(*(spec.build_layer(i) for i in range(len(spec)))).eval()
    ids = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        want = model(ids).logits
        got = pipeline(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the causal mask is in force: a later token does not change earlier logits
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % 300
    with torch.no_grad():
        torch.testing.assert_close(pipeline(ids2)[:, :-1], got[:, :-1])


def test_pretrained_loading_reads_only_the_stage_tensors(tmp_path, monkeypatch):
    hf_model().save_pretrained(tmp_path / "ckpt")
    spec = gpt2.pretrained_gpt2_spec(str(tmp_path / "ckpt"))
    asked = []
    original = gpt2.CheckpointWeights.__call__
    monkeypatch.setattr(gpt2.CheckpointWeights, "__call__", lambda self, prefix: asked.append(prefix) or original(self, prefix))
    spec.build_layer(2)
    assert asked == ["transformer.h.1."]


def test_random_init_is_the_same_on_every_rank():
    spec = build_spec("gpt2-tiny", vocab_size=400, seq_len=32)
    a, b = spec.build_layer(3, seed=7), spec.build_layer(3, seed=7)
    c = spec.build_layer(3, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize("preset,params_millions", [("gpt2-small", 124), ("gpt2-medium", 355), ("gpt2-large", 774),
                                                    ("gpt2-xl", 1558)])
def test_presets_have_gpt2_sizes_counted_without_allocating(preset, params_millions):
    spec = build_spec(preset, vocab_size=50257, seq_len=1024)
    total = sum(spec.parameter_counts())
    tied_head = 50257 * gpt2.PRESETS[preset]["n_embd"]  # the pipeline unties the LM head from the embedding
    assert abs((total - tied_head) / 1e6 - params_millions) / params_millions < 0.01


def test_model_kinds(tmp_path):
    assert classify_model("gpt2-xl").kind == "preset"
    assert classify_model("mypkg.models:build").kind == "callable"
    assert classify_model("openai-community/gpt2").kind == "hub"
    hf_model().save_pretrained(tmp_path / "ckpt")
    assert classify_model(str(tmp_path / "ckpt")).kind == "directory"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match="without config.json"):
        classify_model(str(tmp_path / "empty"))
    with pytest.raises(SpecError, match="unknown --model"):
        classify_model("gpt5")
