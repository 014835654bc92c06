"""BERT-family encoders (BERT, MiniLM) as pipeline layers for sequence classification (HF `transformers`).

Layers: embeddings (token ids and token types → hidden states), each encoder layer, and pooler + classifier
(hidden states → logits). The encoder layers take the attention mask, which the runtime sends losslessly
beside the activations, so no stage but the first needs the data.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aqpipe.stages.hf_weights import CheckpointWeights
from aqpipe.stages.spec import PipelineSpec, SpecError

# Architectures by name, randomly initialised; pretrained weights come from a checkpoint directory or the hub.
PRESETS: dict[str, dict] = {
    "bert-tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
    "bert-mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
    "bert-small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
    "bert-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096),
}
# Model types whose checkpoints this adapter reads (MiniLM checkpoints say "bert").
MODEL_TYPES = ("bert",)


def bert_config(preset: str, vocab_size: int, num_labels: int, dropout: float | None = None):
    """A `BertConfig` for a preset name, vocabulary size and number of classes."""
    from transformers import BertConfig

    settings: dict[str, Any] = dict(vocab_size=vocab_size, num_labels=num_labels, pad_token_id=0,
                                    max_position_embeddings=512, **PRESETS[preset])
    if dropout is not None:
        settings.update(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertConfig(**settings)


def _prepare(config) -> None:
    config._attn_implementation = "sdpa"
    config.is_decoder = False


class BertEmbeddingsLayer(nn.Module):
    """Word, position and token-type embeddings: inputs [B, 2, T] (token ids, token types) or [B, T] → [B, T, H]."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.bert.modeling_bert import BertEmbeddings

        self.embeddings = BertEmbeddings(config)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dim() == 3:
            return self.embeddings(input_ids=inputs[:, 0], token_type_ids=inputs[:, 1])
        return self.embeddings(input_ids=inputs)


class BertEncoderLayer(nn.Module):
    """One bidirectional transformer layer: (hidden states, attention mask [B, T] of 0/1) → hidden states."""

    takes_mask = True

    def __init__(self, config, index: int) -> None:
        super().__init__()
        from transformers.models.bert.modeling_bert import BertLayer

        self.config = config
        self.layer = BertLayer(config, layer_idx=index)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        if mask is not None:
            mask = mask.to(torch.bool)
        attention = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask)
        out = self.layer(hidden, attention)
        return out[0] if isinstance(out, tuple) else out


class BertClassifierHead(nn.Module):
    """BERT's pooler (dense + tanh on the first token), dropout and a linear classifier: → logits [B, C]."""

    lora_trains_whole = True  # made for the task: under --lora it trains whole, with no adapters

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.bert.modeling_bert import BertPooler

        self.pooler = BertPooler(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(hidden)))


def classify_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of class logits [B, C] against labels [B]."""
    return F.cross_entropy(logits.float(), labels)


def init_like_bert(module: nn.Module, std: float) -> None:
    """BERT's initialisation: normal(0, initializer_range) weights, zero biases and padding rows, unit norms."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.weight.data.normal_(0.0, std)
            if sub.bias is not None:
                sub.bias.data.zero_()
        elif isinstance(sub, nn.Embedding):
            sub.weight.data.normal_(0.0, std)
            if sub.padding_idx is not None:
                sub.weight.data[sub.padding_idx].zero_()
        elif isinstance(sub, nn.LayerNorm):
            sub.weight.data.fill_(1.0)
            sub.bias.data.zero_()


def _build(kind: str, config, index: int, weights: Callable[[str], dict] | None) -> nn.Module:
    _prepare(config)
    layer: nn.Module
    if kind == "embed":
        layer, prefix, inner = BertEmbeddingsLayer(config), "bert.embeddings.", "embeddings."
    elif kind == "layer":
        layer, prefix, inner = BertEncoderLayer(config, index), f"bert.encoder.layer.{index}.", "layer."
    else:
        layer, prefix, inner = BertClassifierHead(config), "", ""
    if torch.empty(0).is_meta:  # being sized on the meta device (partitioning): nothing to initialise or load
        return layer
    init_like_bert(layer, config.initializer_range)
    if weights is None:
        return layer
    if kind == "head":
        return load_head(layer, weights, "bert.pooler.", config.num_labels)
    state = {inner + k: v for k, v in weights(prefix).items() if k not in ("position_ids", "token_type_ids")}
    missing, _unexpected = layer.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith(("position_ids", "token_type_ids"))]
    if missing:
        raise SpecError(f"the checkpoint lacks weights for {kind} {index}: {', '.join(missing[:5])}")
    return layer


def load_head(head: nn.Module, weights: Callable[[str], dict], pooler_prefix: str, num_labels: int) -> nn.Module:
    """Load a classifier head's pretrained pooler, and its classifier only when the checkpoint's has `num_labels`
    classes (a pretrained encoder brings no head for a new task: that part keeps its fresh initialisation)."""
    state = {"pooler." + k: v for k, v in weights(pooler_prefix).items()}
    classifier = weights("classifier.")
    if classifier.get("weight") is not None and classifier["weight"].shape[0] == num_labels:
        state.update({"classifier." + k: v for k, v in classifier.items()})
    head.load_state_dict(state, strict=False)
    return head


def classifier_config(config, num_labels: int, dropout: float | None):
    """A checkpoint's config set up for `num_labels` classes (and a dropout override)."""
    config.num_labels = num_labels
    if dropout is not None:
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = dropout
    return config


def bert_spec(config, weights: Callable[[str], dict] | None = None, name: str = "bert") -> PipelineSpec:
    """The pipeline layers of a BERT classifier: [embeddings, layer 0 … layer n-1, pooler + classifier].

    `weights(prefix)` returns checkpoint tensors under a prefix (stripped); without it, random initialisation.
    """
    layers = [partial(_build, "embed", config, 0, weights)]
    layers += [partial(_build, "layer", config, i, weights) for i in range(config.num_hidden_layers)]
    layers.append(partial(_build, "head", config, 0, weights))
    return PipelineSpec(layers=layers, loss=classify_loss, name=name,
                        extras={"hf_config": config.to_dict(), "task": "classify", "architecture": "bert"})


def _normalise(key: str) -> str:
    """Every key under `bert.` or `classifier.`, whether the checkpoint saved the bare or the task model."""
    if key.startswith(("bert.", "classifier.")):
        return key
    return "bert." + key


def pretrained_bert_spec(directory: str, num_labels: int, dropout: float | None = None) -> PipelineSpec:
    """A BERT classifier spec whose layers load their own weights from a local HF checkpoint directory."""
    from transformers import BertConfig

    config = classifier_config(BertConfig.from_pretrained(directory), num_labels, dropout)
    weights = CheckpointWeights(directory, normalise=_normalise)
    return bert_spec(config, weights, name=os.path.basename(os.path.normpath(directory)))
