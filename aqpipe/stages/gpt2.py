"""GPT-2 as pipeline layers: embeddings, each transformer block, and final norm + LM head (HF `transformers`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from aqpipe.stages.hf_weights import CheckpointWeights
from aqpipe.stages.spec import PipelineSpec

# Architectures by name; weights are randomly initialised (pretrained weights come from a directory or hub id).
PRESETS: dict[str, dict] = {
    "gpt2-tiny": dict(n_layer=4, n_embd=128, n_head=4, n_positions=256),
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20, n_positions=1024),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25, n_positions=1024),
}
# The tiny test size trains without dropout so that runs are reproducible bit for bit; larger presets keep GPT-2's.
PRESET_DROPOUT = {"gpt2-tiny": 0.0}


def gpt2_config(preset: str, vocab_size: int, dropout: float | None = None):
    """A `GPT2Config` for a preset name with the given vocabulary size."""
    from transformers import GPT2Config

    if dropout is None:
        dropout = PRESET_DROPOUT.get(preset, 0.1)
    special = 50256 if vocab_size > 50256 else 0  # aqpipe's own BPE puts <|endoftext|> at id 0
    return GPT2Config(
        vocab_size=vocab_size, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        bos_token_id=special, eos_token_id=special, **PRESETS[preset],
    )


class GPT2Embeddings(nn.Module):
    """Token plus position embeddings: token ids [B, T] → hidden states [B, T, H]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class GPT2BlockLayer(nn.Module):
    """One causal transformer block: hidden states → hidden states."""

    def __init__(self, config, index: int) -> None:
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config._attn_implementation = "sdpa"  # with no mask given, SDPA applies GPT-2's causal mask itself
        self.block = GPT2Block(config, layer_idx=index)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class GPT2Head(nn.Module):
    """Final layer norm and the LM head: hidden states → logits [B, T, V].

    The head is untied from the token embedding because the two live on different stages.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; `targets` are the inputs shifted by one."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _init_like_hf(module: nn.Module, config) -> None:
    """GPT-2's initialisation: normal(0, initializer_range) weights, zero biases, unit norms, scaled projections."""
    std = config.initializer_range
    from transformers.pytorch_utils import Conv1D

    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding, Conv1D)):
            sub.weight.data.normal_(0.0, std)
            bias = getattr(sub, "bias", None)
            if bias is not None:
                bias.data.zero_()
        elif isinstance(sub, nn.LayerNorm):
            sub.weight.data.fill_(1.0)
            sub.bias.data.zero_()
    for name, p in module.named_parameters():
        if name.endswith("c_proj.weight"):
            p.data.normal_(0.0, std / (2 * config.n_layer) ** 0.5)


def _build(kind: str, config, index: int, weights: Callable[[str], dict] | None) -> nn.Module:
    layer: nn.Module
    if kind == "embed":
        layer, prefix = GPT2Embeddings(config), "transformer."
    elif kind == "block":
        layer, prefix = GPT2BlockLayer(config, index), f"transformer.h.{index}."
    else:
        layer, prefix = GPT2Head(config), "transformer."
    if torch.empty(0).is_meta:  # being sized on the meta device (partitioning): nothing to initialise or load
        return layer
    if weights is None:
        _init_like_hf(layer, config)
        return layer
    state = weights(prefix)
    if kind == "block":
        state = {"block." + k: v for k, v in state.items()}
    elif kind == "head":
        state = {k: v for k, v in state.items() if k.startswith("ln_f.")}
        state["lm_head.weight"] = weights("lm_head.").get("weight", weights("transformer.")["wte.weight"])
    else:
        state = {k: v for k, v in state.items() if k.startswith(("wte.", "wpe."))}
    missing, _unexpected = layer.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith(("attn.bias", "attn.masked_bias"))]
    if missing:
        raise ValueError(f"the checkpoint lacks weights for {kind} layer {index}: {', '.join(missing[:5])}")
    return layer


def gpt2_spec(config, weights: Callable[[str], dict] | None = None, name: str = "gpt2") -> PipelineSpec:
    """The pipeline layers of a GPT-2 LM: [embeddings, block 0 … block n-1, norm + head].

    `weights(prefix)` returns the checkpoint tensors under a prefix (with it stripped); without it, random init.
    """
    layers = [partial(_build, "embed", config, 0, weights)]
    layers += [partial(_build, "block", config, i, weights) for i in range(config.n_layer)]
    layers.append(partial(_build, "head", config, 0, weights))
    return PipelineSpec(layers=layers, loss=lm_loss, name=name, extras={"hf_config": config.to_dict(), "task": "lm",
                                                                       "architecture": "gpt2"})


def _normalise(key: str) -> str:
    """Every GPT-2 key under `transformer.` or `lm_head.`, whether the checkpoint saved the bare or the LM model."""
    if key.startswith(("transformer.", "lm_head.")):
        return key
    return "transformer." + key


def pretrained_gpt2_spec(directory: str, dropout: float | None = None) -> PipelineSpec:
    """A GPT-2 spec whose layers load their own weights from a local HF checkpoint directory."""
    from transformers import GPT2Config

    config = GPT2Config.from_pretrained(directory)
    if dropout is not None:
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = dropout
    weights = CheckpointWeights(directory, normalise=_normalise)
    return gpt2_spec(config, weights, name=os.path.basename(os.path.normpath(directory)))
