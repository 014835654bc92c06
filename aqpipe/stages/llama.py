"""Decoder-only LMs as pipeline layers, through `transformers`' own classes: one adapter for every family whose
model is an embedding, a stack of decoder layers fed rotary tables, a final norm and an LM head (Llama, Qwen2, Qwen3,
Mistral, Gemma 3, Phi-3, OLMo 2, GPT-NeoX, SmolLM), each family one row of `FAMILIES`.

Layers: token embedding, each decoder layer, and final norm + LM head. Each decoder layer computes its rotary cos/sin
from the sequence length on its own stage (no positions cross a link; one table per layer type where the family has
local and global ones) and builds its causal mask (sliding-window where the layer slides) from the padding mask that
travels losslessly beside the activations. When the model ties its input embedding and LM head (SmolLM2,
Qwen2.5-0.5B, Llama 3.2 1B, Gemma 3) the two live on the first and the last stage: each declares the tensor as a tied
copy, so the runtime sums their gradients and they stay one tensor.
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


_DECODER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """One `transformers` decoder family this adapter drives: where its classes live, what a checkpoint calls its
    parts, and what its layers need beyond hidden states and the padding mask."""

    module: str
    prefix: str  # its classes' name prefix (LlamaDecoderLayer, LlamaConfig, …)
    config: str = "Config"  # its config class, after the prefix
    layer: str = "DecoderLayer"  # its decoder layer class, after the prefix
    base: str = "model"  # the base model's key prefix in a checkpoint
    embedding: str = "embed_tokens"  # the token embedding's name in the base model
    final_norm: str = "norm"  # the final norm's name in the base model
    head: str = "lm_head"  # the LM head's name beside the base model
    norm: str = "RMSNorm"  # the final norm's class after the prefix ("LayerNorm": torch's, with a bias)
    norm_init: float = 1.0  # a norm weight's random init (Gemma's norms scale by 1 + weight: 0)
    scaled_embedding: bool = False  # the embedding's output is multiplied by √hidden (Gemma)
    rotary_by_layer_type: bool = False  # one rotary table per layer type (Gemma 3: sliding layers have their own)
    slides_when_configured: bool = False  # every layer slides when config.sliding_window is set (Mistral, Phi-3)
    lora_targets: tuple[str, ...] = _DECODER_TARGETS  # the module names `--lora` adapts by default

    def cls(self, suffix: str):
        """The family's class `<prefix><suffix>` (e.g. LlamaDecoderLayer)."""
        return getattr(importlib.import_module(self.module), self.prefix + suffix)

    def config_class(self):
        """The family's config class."""
        return self.cls(self.config)

    def key(self, part: str) -> str:
        """The checkpoint key prefix of a part: "embedding", "final_norm", "head" or "layers"."""
        if part == "head":
            return f"{self.head}."
        return f"{self.base}.{dict(embedding=self.embedding, final_norm=self.final_norm, layers='layers')[part]}."


# model_type (config.json, GGUF architecture) -> family. Everything else reads this table: a new family is a row.
FAMILIES: dict[str, Family] = {
    "llama": Family("transformers.models.llama.modeling_llama", "Llama"),
    "qwen2": Family("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": Family("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "mistral": Family("transformers.models.mistral.modeling_mistral", "Mistral", slides_when_configured=True),
    "gemma3_text": Family("transformers.models.gemma3.modeling_gemma3", "Gemma3", config="TextConfig", norm_init=0.0,
                          scaled_embedding=True, rotary_by_layer_type=True),
    "phi3": Family("transformers.models.phi3.modeling_phi3", "Phi3", slides_when_configured=True,
                   lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "olmo2": Family("transformers.models.olmo2.modeling_olmo2", "Olmo2"),
    "gpt_neox": Family("transformers.models.gpt_neox.modeling_gpt_neox", "GPTNeoX", layer="Layer", base="gpt_neox",
                       embedding="embed_in", final_norm="final_layer_norm", head="embed_out", norm="LayerNorm",
                       lora_targets=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")),
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
                        f"{', '.join(FAMILIES)} (and aqpipe adapts gpt2, bert and deberta-v2 checkpoints); for "
                        "another, give --model module:function returning a PipelineSpec")
    return FAMILIES[kind]


def llama_config(preset: str, vocab_size: int, dropout: float | None = None):
    """The `transformers` config of a preset, with the given vocabulary size (aqpipe's BPE or a model's tokenizer)."""
    settings = dict(PRESETS[preset])
    kind = settings.pop("model_type")
    vocab_size = max(vocab_size, settings.pop("vocab_size", 0))
    theta = settings.pop("rope_theta", 10000.0)
    config = family_of(kind, f"preset {preset}").config_class()(vocab_size=vocab_size, pad_token_id=0, bos_token_id=0,
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

    def __init__(self, config, family: Family | None = None) -> None:
        super().__init__()
        family = family or FAMILIES[config.model_type]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.tied = bool(config.tie_word_embeddings)
        # (as the family's own scaled embedding does: √hidden in fp32, cast to the weight's dtype)
        self.scale = config.hidden_size ** 0.5 if family.scaled_embedding else None

    def tied_parameters(self) -> dict[str, list[nn.Parameter]]:
        """The embedding is the LM head's weight too when the model ties them."""
        return {TIE_NAME: [self.embed_tokens.weight]} if self.tied else {}  # type: ignore[list-item]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.scale is not None:
            hidden = hidden * torch.tensor(self.scale).to(hidden.dtype)
        return hidden


class DecoderLayer(nn.Module):
    """One decoder layer: (hidden states, padding mask [B, T] of 0/1 or None) → hidden states.

    Rotary position embeddings come from the sequence length (positions 0…T−1); the causal mask (sliding-window
    where the family's layer uses one) from the padding mask.
    """

    takes_mask = True

    def __init__(self, config, index: int, family: Family) -> None:
        super().__init__()
        self.config = config
        self.layer = family.cls(family.layer)(config, layer_idx=index)
        self.rotary = family.cls("RotaryEmbedding")(config)
        layer_types = getattr(config, "layer_types", None)
        self.kind = layer_types[index] if layer_types else "full_attention"
        self.rotary_args = (self.kind,) if family.rotary_by_layer_type else ()
        self.sliding = self.kind == "sliding_attention" or bool(
            family.slides_when_configured and getattr(config, "sliding_window", None))

    # The last causal mask built, per kind (full / sliding): the layers of one stage get the same padding-mask tensor,
    # so they share one [B, 1, T, T] mask (and SDPA keeps it for backward once, not once per layer). It is another
    # layer's only for the same padding mask (or none), model configuration and fake-tensor mode (the capacity plan
    # traces stages with fake tensors: a mask built there is fake).
    _last_mask: ClassVar[dict[bool, tuple]] = {}

    def _attention_mask(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        key = (tuple(hidden.shape[:2]), hidden.dtype, hidden.device, getattr(self.config, "sliding_window", None))
        owners = (mask, self.config, getattr(hidden, "fake_mode", None))
        cached = self._last_mask.get(self.sliding)
        # `is`: the cache holds the mask, configuration and mode alive, so no other object takes their identity
        if cached is not None and all(a is b for a, b in zip(cached[0], owners)) and cached[1] == key:
            return cached[2]
        build = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        # the cache goes by position: transformers named it past_key_values up to 5.17 and cache after
        attention = build(self.config, hidden, None if mask is None else mask.to(torch.bool), None,
                          position_ids=positions)
        self._last_mask[self.sliding] = (owners, key, attention)
        return attention

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        attention = self._attention_mask(hidden, mask, positions)
        out = self.layer(hidden, attention_mask=attention, position_ids=positions,
                         position_embeddings=self.rotary(hidden, positions, *self.rotary_args))
        return out[0] if isinstance(out, tuple) else out


class DecoderHead(nn.Module):
    """The final norm and the LM head: hidden states → logits [B, T, V] (soft-capped where the family caps them)."""

    def __init__(self, config, family: Family) -> None:
        super().__init__()
        if family.norm == "LayerNorm":
            self.norm: nn.Module = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        else:
            self.norm = family.cls(family.norm)(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied = bool(config.tie_word_embeddings)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def tied_parameters(self) -> dict[str, list[nn.Parameter]]:
        """The LM head is the input embedding's weight too when the model ties them."""
        return {TIE_NAME: [self.lm_head.weight]} if self.tied else {}  # type: ignore[list-item]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def init_like_hf(module: nn.Module, std: float, norm_init: float = 1.0) -> None:
    """The decoder families' initialisation: normal(0, initializer_range) weights, zero biases, norms at `norm_init`
    (a LayerNorm at 1 with a zero bias)."""
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            sub.weight.data.normal_(0.0, std)
            bias = getattr(sub, "bias", None)
            if bias is not None:
                bias.data.zero_()
        elif isinstance(sub, nn.LayerNorm):
            sub.reset_parameters()
        elif type(sub).__name__.endswith("RMSNorm"):
            sub.weight.data.fill_(norm_init)  # type: ignore[operator]


def _tied_init(weight: torch.Tensor, std: float) -> None:
    """Both copies of a tied embedding start equal, whichever rank builds them."""
    with host_rng(1_000_003):
        weight.data.normal_(0.0, std)


def _build(kind: str, config, index: int, weights: Callable[[str], dict] | None) -> nn.Module:
    _prepare(config)
    family = FAMILIES[config.model_type]
    layer: nn.Module
    if kind == "embed":
        layer = DecoderEmbedding(config, family)
    elif kind == "layer":
        layer = DecoderLayer(config, index, family)
    else:
        layer = DecoderHead(config, family)
    if torch.empty(0).is_meta:  # being sized on the meta device (partitioning): nothing to initialise or load
        return layer
    if weights is None:
        init_like_hf(layer, config.initializer_range, family.norm_init)
        if isinstance(layer, DecoderEmbedding) and layer.tied:
            _tied_init(layer.embed_tokens.weight, config.initializer_range)
        elif isinstance(layer, DecoderHead) and layer.tied:
            _tied_init(layer.lm_head.weight, config.initializer_range)
        return layer
    if kind == "embed":  # each weights(prefix) call reads only the tensors under that prefix
        state = {"embed_tokens." + k: v for k, v in weights(family.key("embedding")).items()}
    elif kind == "layer":
        state = {"layer." + k: v for k, v in weights(f"{family.key('layers')}{index}.").items()}
    else:
        state = {"norm." + k: v for k, v in weights(family.key("final_norm")).items()}
        head = None if config.tie_word_embeddings else weights(family.key("head")).get("weight")
        if head is None:  # a tied checkpoint stores the shared tensor once, as the embedding
            head = weights(family.key("embedding")).get("weight")
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


def _normalise(family: Family, key: str) -> str:
    """Every key under the base model's prefix or the head's, whether the checkpoint saved the bare or the causal-LM
    model."""
    if key.startswith((f"{family.base}.", f"{family.head}.")):
        return key
    return f"{family.base}.{key}"


def pretrained_decoder_spec(directory: str, dropout: float | None = None) -> PipelineSpec:
    """A Llama-family spec whose layers load their own weights from a local HF checkpoint directory."""
    family = family_of(model_type(directory), f"--model {directory!r}")
    config = family.config_class().from_pretrained(directory)
    if dropout is not None:
        config.attention_dropout = dropout
    return decoder_spec(config, CheckpointWeights(directory, normalise=partial(_normalise, family)),
                        name=os.path.basename(os.path.normpath(directory)))
