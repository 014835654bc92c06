"""Export: the stages' weights merge into an HF checkpoint that computes what the pipeline computes."""

import pytest
import torch

from aqpipe.stages.export import ExportError, export_hf, merged_state
from aqpipe.stages.gpt2 import gpt2_config, gpt2_spec


def test_gpt2_stages_export_to_a_causal_lm_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    spec = gpt2_spec(gpt2_config("gpt2-tiny", vocab_size=300))
    bounds = [0, 2, 4, 6]
    stages = [spec.build_stage(bounds[k], bounds[k + 1], seed=3) for k in range(3)]
    with torch.no_grad():
        for stage in stages:  # make the head differ from the embedding, as after training untied
            for p in stage.parameters():
                p.add_(0.01 * torch.randn_like(p))
    export_hf([s.state_dict() for s in stages], bounds, "gpt2", spec.extras["hf_config"], tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        hidden = tokens
        for stage in stages:
            hidden = stage.eval()(hidden)
        assert torch.allclose(model(tokens).logits, hidden, atol=1e-5)
    assert not torch.equal(model.lm_head.weight, model.transformer.wte.weight)  # saved untied


def test_layer_names_map_to_hf_names():
    states = [{"0.embeddings.word_embeddings.weight": 1, "1.layer.attention.self.query.weight": 2},
              {"0.layer.output.dense.bias": 3, "1.pooler.dense.weight": 4, "1.classifier.bias": 5}]
    merged = merged_state(states, [0, 2, 4], "bert")
    assert merged == {"bert.embeddings.word_embeddings.weight": 1, "bert.encoder.layer.0.attention.self.query.weight": 2,
                      "bert.encoder.layer.1.output.dense.bias": 3, "bert.pooler.dense.weight": 4, "classifier.bias": 5}


def test_models_without_an_hf_form_or_with_missing_weights_are_refused():
    with pytest.raises(ExportError, match="cannot export a 'custom' model"):
        merged_state([{}], [0, 1], "custom")
    spec = gpt2_spec(gpt2_config("gpt2-tiny", vocab_size=300))
    stages = [spec.build_stage(0, 3), spec.build_stage(3, 6)]
    with pytest.raises(ExportError, match="missing"):
        export_hf([stages[0].state_dict()], [0, 3], "gpt2", spec.extras["hf_config"], "/tmp/never")
