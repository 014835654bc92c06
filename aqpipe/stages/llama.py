"""Llama-family decoders (Llama, Qwen2, Mistral, SmolLM) as pipeline layers, through `transformers`' own classes.

Layers: token embedding, each decoder layer (RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP), and
final norm + LM head. Each decoder layer computes its rotary cos/sin from the sequence length on its own stage (no
positions cross a link) and builds the causal mask from the padding mask that travels losslessly beside the
activations. When the model ties its input embedding and LM head (SmolLM2, Qwen2.5-0.5B, Llama 3.2 1B) the two live
on the first and the last stage: each declares the tensor as a tied copy, so the runtime sums their gradients and they
stay one tensor.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from aqpipe.stages.gpt2 import lm_loss
from aqpipe.stages.hf_weights import CheckpointWeights, model_type
from aqpipe.stages.spec import PipelineSpec, SpecError, host_rng

TIE_NAME = "embed_tokens"  # the tied group of the input embedding and the LM head


@dataclass(frozen=True)
class Family:
    """One `transformers` model family this adapter drives: where its classes live and their name prefix."""

    module: str
    prefix: str

    def cls(self, suffix: str):
        """The family's class `<prefix><suffix>` (e.g. LlamaDecoderLayer)."""
        return getattr(importlib.import_module(self.module), self.prefix + suffix)


# model_type (config.json, GGUF architecture) -> family. Everything else reads this table.
FAMILIES: dict[str, Family] = {
    "llama": Family("transformers.models.llama.modeling_llama", "Llama"),
    "qwen2": Family("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "mistral": Family("transformers.models.mistral.modeling_mistral", "Mistral"),
}

# Architectures by name, randomly initialised (pretrained weights come from a directory, a GGUF file or the hub).
# The tiny ones are test sizes; the *-arch ones give real shapes (their real vocabulary size at least: rows past the
# run's tokenizer stay unused) for capacity planning and from-scratch runs.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(model_type="llama", hidden_size=64, intermediate_size=172,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True),
    "qwen2-tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=160,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False),
    "mistral-tiny": dict(model_type="mistral", hidden_size=64, intermediate_size=160,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                         sliding_window=16, tie_word_embeddings=False),
    "smollm2-360m-arch": dict(model_type="llama", vocab_size=49152, hidden_size=960, intermediate_size=2560,
                              num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=8192,
                              tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b-arch": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                              num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                              tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b-arch": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                              tie_word_embeddings=False, rope_theta=500000.0),
    "qwen2.5-0.5b-arch": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                              num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                              tie_word_embeddings=True, rope_theta=1000000.0),
    "mistral-7b-arch": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                            tie_word_embeddings=False, rope_theta=1000000.0, sliding_window=None),
}


def family_of(kind: str | None, where: str) -> Family:
    """The family of a model type, or SpecError naming it and the supported ones."""
    if kind not in FAMILIES:
        raise SpecError(f"{where} is a {kind or 'unknown'} model; the decoder adapter covers "
                        f"{', '.join(FAMILIES)} (and aqpipe adapts gpt2, bert and deberta-v2 checkpoints)")
    return FAMILIES[kind]


def llama_config(preset: str, vocab_size: int, dropout: float | None = None):
    """The `transformers` config of a preset, with the given vocabulary size (aqpipe's BPE or a model's tokenizer)."""
    settings = dict(PRESETS[preset])
    kind = settings.pop("model_type")
    vocab_size = max(vocab_size, settings.pop("vocab_size", 0))
    theta = settings.pop("rope_theta", 10000.0)
    config = family_of(kind, f"preset {preset}").cls("Config")(vocab_size=vocab_size, pad_token_id=0, bos_token_id=0,
                                                              eos_token_id=0, **settings)
    config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    if dropout is not None:
        config.attention_dropout = dropout
    return config


def _prepare(config) -> None:
    config._attn_implementation = "sdpa"
    config.use_cache = False


class DecoderEmbedding(nn.Module):
    """The token embedding: token ids [B, T] → hidden states [B, T, H]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.tied = bool(config.tie_word_embeddings)

    def tied_parameters(self) -> dict[str, list[nn.Parameter]]:
        """The embedding is the LM head's weight too when the model ties them."""
        return {TIE_NAME: [self.embed_tokens.weight]} if self.tied else {}  # type: ignore[list-item]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderLayer(nn.Module):
    """One decoder layer: (hidden states, padding mask [B, T] of 0/1 or None) → hidden states.

    Rotary position embeddings come from the sequence length (positions 0…T−1); the causal mask (sliding-window
    where the family's layer uses one) from the padding mask.
    """

    takes_mask = True

    def __init__(self, config, index: int, family: Family) -> None:
        super().__init__()
        self.config = config
        self.layer = family.cls("DecoderLayer")(config, layer_idx=index)
        self.rotary = family.cls("RotaryEmbedding")(config)
        layer_types = getattr(config, "layer_types", None)
        kind = layer_types[index] if layer_types else "full_attention"
        self.sliding = kind == "sliding_attention" or bool(config.model_type == "mistral" and config.sliding_window)

    # The last causal mask built, per kind (full / sliding): the layers of one stage get the same padding-mask tensor,
    # so they share one [B, 1, T, T] mask (and SDPA keeps it for backward once, not once per layer).
    _last_mask: ClassVar[dict[bool, tuple]] = {}

    def _attention_mask(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        key = (tuple(hidden.shape[:2]), hidden.dtype, hidden.device, getattr(self.config, "sliding_window", None))
        cached = self._last_mask.get(self.sliding)
        if cached is not None and cached[0] is mask and cached[1] == key:  # `is`: the cache holds the tensor alive
            return cached[2]
        build = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        # the cache goes by position: transformers named it past_key_values up to 5.17 and cache after
        attention = build(self.config, hidden, None if mask is None else mask.to(torch.bool), None,
                          position_ids=positions)
        self._last_mask[self.sliding] = (mask, key, attention)
        return attention

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        attention = self._attention_mask(hidden, mask, positions)
        out = self.layer(hidden, attention_mask=attention, position_ids=positions,
                         position_embeddings=self.rotary(hidden, positions))
        return out[0] if isinstance(out, tuple) else out


class DecoderHead(nn.Module):
    """The final RMSNorm and the LM head: hidden states → logits [B, T, V]."""

    def __init__(self, config, family: Family) -> None:
        super().__init__()
        self.norm = family.cls("RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied = bool(config.tie_word_embeddings)

    def tied_parameters(self) -> dict[str, list[nn.Parameter]]:
        """The LM head is the input embedding's weight too when the model ties them."""
        return {TIE_NAME: [self.lm_head.weight]} if self.tied else {}  # type: ignore[list-item]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def init_like_hf(module: nn.Module, std: float) -> None:
    """The Llama family's initialisation: normal(0, initializer_range) weights, zero biases, unit norms."""
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            sub.weight.data.normal_(0.0, std)
            bias = getattr(sub, "bias", None)
            if bias is not None:
                bias.data.zero_()
        elif type(sub).__name__.endswith("RMSNorm"):
            sub.weight.data.fill_(1.0)  # type: ignore[operator]


def _tied_init(weight: torch.Tensor, std: float) -> None:
    """Both copies of a tied embedding start equal, whichever rank builds them."""
    with host_rng(1_000_003):
        weight.data.normal_(0.0, std)


def _build(kind: str, config, index: int, weights: Callable[[str], dict] | None) -> nn.Module:
    _prepare(config)
    family = FAMILIES[config.model_type]
    layer: nn.Module
    if kind == "embed":
        layer = DecoderEmbedding(config)
    elif kind == "layer":
        layer = DecoderLayer(config, index, family)
    else:
        layer = DecoderHead(config, family)
    if torch.empty(0).is_meta:  # being sized on the meta device (partitioning): nothing to initialise or load
        return layer
    if weights is None:
        init_like_hf(layer, config.initializer_range)
        if isinstance(layer, DecoderEmbedding) and layer.tied:
            _tied_init(layer.embed_tokens.weight, config.initializer_range)
        elif isinstance(layer, DecoderHead) and layer.tied:
            _tied_init(layer.lm_head.weight, config.initializer_range)
        return layer
    if kind == "embed":  # each weights(prefix) call reads only the tensors under that prefix
        state = {"embed_tokens." + k: v for k, v in weights("model.embed_tokens.").items()}
    elif kind == "layer":
        state = {"layer." + k: v for k, v in weights(f"model.layers.{index}.").items()}
    else:
        state = {"norm." + k: v for k, v in weights("model.norm.").items()}
        head = None if config.tie_word_embeddings else weights("lm_head.").get("weight")
        if head is None:  # a tied checkpoint stores the shared tensor once, as the embedding
            head = weights("model.embed_tokens.").get("weight")
        if head is not None:
            state["lm_head.weight"] = head
    missing, _unexpected = layer.load_state_dict(state, strict=False)
    if missing:
        raise SpecError(f"the checkpoint lacks weights for decoder {kind} {index}: {', '.join(missing[:5])}")
    return layer


def decoder_spec(config, weights: Callable[[str], dict] | None = None, name: str = "llama") -> PipelineSpec:
    """The pipeline layers of a Llama-family causal LM: [embedding, layer 0 … layer n-1, norm + LM head].

    `weights(prefix)` returns checkpoint tensors under an HF key prefix (stripped); without it, random init.
    """
    family_of(config.model_type, name)
    layers = [partial(_build, "embed", config, 0, weights)]
    layers += [partial(_build, "layer", config, i, weights) for i in range(config.num_hidden_layers)]
    layers.append(partial(_build, "head", config, 0, weights))
    extras: dict[str, Any] = {"hf_config": config.to_dict(), "task": "lm", "architecture": config.model_type}
    if config.tie_word_embeddings:
        extras.update(tied={TIE_NAME: [(config.vocab_size, config.hidden_size)]}, tied_copies={TIE_NAME: 2},
                      tied_rows=[TIE_NAME])  # the embedding looks rows up; the head uses all of them
    return PipelineSpec(layers=layers, loss=lm_loss, name=name, extras=extras)


def _normalise(key: str) -> str:
    """Every key under `model.` or `lm_head.`, whether the checkpoint saved the bare or the causal-LM model."""
    if key.startswith(("model.", "lm_head.")):
        return key
    return "model." + key


def pretrained_decoder_spec(directory: str, dropout: float | None = None) -> PipelineSpec:
    """A Llama-family spec whose layers load their own weights from a local HF checkpoint directory."""
    family = family_of(model_type(directory), f"--model {directory!r}")
    config = family.cls("Config").from_pretrained(directory)
    if dropout is not None:
        config.attention_dropout = dropout
    return decoder_spec(config, CheckpointWeights(directory, normalise=_normalise),
                        name=os.path.basename(os.path.normpath(directory)))
