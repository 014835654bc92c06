"""DeBERTa-v2/v3 encoders as pipeline layers for sequence classification (HF `transformers`).

DeBERTa's disentangled attention reads one relative-position table (and its layer norm) in every layer. In a
pipeline each encoder layer holds its own copy of that table, declared as *tied*: the runtime sums the copies'
gradients across all stages before the optimizer step, so every copy takes the same update and stays equal to
the others (checked in the tests), exactly as the single shared table would.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from aqpipe.stages.bert import classifier_config, classify_loss, init_like_bert, load_head
from aqpipe.stages.hf_weights import CheckpointWeights
from aqpipe.stages.spec import PipelineSpec, SpecError, host_rng

PRESETS: dict[str, dict] = {
    "deberta-tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
}
TIE_NAME = "deberta.encoder.rel_embeddings"
MODEL_TYPES = ("deberta-v2",)


def deberta_config(preset: str, vocab_size: int, num_labels: int, dropout: float | None = None):
    """A DeBERTa-v3-style `DebertaV2Config` (relative attention, position buckets) for a preset name."""
    from transformers import DebertaV2Config

    settings: dict[str, Any] = dict(
        vocab_size=vocab_size, num_labels=num_labels, pad_token_id=0, max_position_embeddings=512,
        relative_attention=True, position_buckets=64, norm_rel_ebd="layer_norm", pos_att_type=["p2c", "c2p"],
        position_biased_input=False, type_vocab_size=0, **PRESETS[preset])
    if dropout is not None:
        settings.update(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return DebertaV2Config(**settings)


class DebertaEmbeddingsLayer(nn.Module):
    """Word (and, if configured, position and token-type) embeddings, layer norm and the padding mask."""

    takes_mask = True

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.deberta_v2.modeling_deberta_v2 import DebertaV2Embeddings

        self.embeddings = DebertaV2Embeddings(config)

    def forward(self, inputs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        ids, types = (inputs[:, 0], inputs[:, 1]) if inputs.dim() == 3 else (inputs, None)
        if mask is None:
            mask = torch.ones_like(ids)
        return self.embeddings(input_ids=ids, token_type_ids=types, mask=mask.to(ids.dtype))


class RelativePositions(nn.Module):
    """The relative-position table every encoder layer reads (normalised when the config says so)."""

    def __init__(self, config) -> None:
        super().__init__()
        buckets = getattr(config, "position_buckets", -1)
        max_relative = getattr(config, "max_relative_positions", -1)
        if max_relative < 1:
            max_relative = config.max_position_embeddings
        self.position_buckets, self.max_relative_positions = buckets, max_relative
        self.rel_embeddings = nn.Embedding(buckets * 2 if buckets > 0 else max_relative * 2, config.hidden_size)
        norms = [x.strip() for x in getattr(config, "norm_rel_ebd", "none").lower().split("|")]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps) if "layer_norm" in norms else None

    def forward(self) -> torch.Tensor:
        table = self.rel_embeddings.weight
        return self.LayerNorm(table) if self.LayerNorm is not None else table


class DebertaEncoderLayer(nn.Module):
    """One disentangled-attention layer (the first also carries the optional convolution of DeBERTa-v2-xlarge)."""

    takes_mask = True

    def __init__(self, config, index: int) -> None:
        super().__init__()
        from transformers.models.deberta_v2.modeling_deberta_v2 import ConvLayer, DebertaV2Layer

        if not getattr(config, "relative_attention", False):
            raise SpecError("DeBERTa checkpoints without relative attention are not supported")
        self.layer = DebertaV2Layer(config)
        self.rel = RelativePositions(config)
        self.conv = ConvLayer(config) if index == 0 and getattr(config, "conv_kernel_size", 0) > 0 else None

    def tied_parameters(self) -> dict[str, list[nn.Parameter]]:
        """Parameters that are one tensor in the model, copied into every encoder layer."""
        return {TIE_NAME: list(self.rel.parameters())}

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

        if mask is None:
            mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        mask = mask.to(torch.long)
        pair_mask = mask[:, None, None, :] * mask[:, None, :, None]  # [B, 1, T, T], as DebertaV2Encoder builds it
        relative_pos = build_relative_position(hidden, hidden, bucket_size=self.rel.position_buckets,
                                               max_position=self.rel.max_relative_positions)
        out = self.layer(hidden, pair_mask, relative_pos=relative_pos, rel_embeddings=self.rel())
        out = out[0] if isinstance(out, tuple) else out
        if self.conv is not None:
            out = self.conv(hidden, out, mask)
        return out


class DebertaClassifierHead(nn.Module):
    """DeBERTa's context pooler (first token, dense, activation), dropout and a linear classifier."""

    lora_trains_whole = True  # made for the task: under --lora it trains whole, with no adapters

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.deberta_v2.modeling_deberta_v2 import ContextPooler

        self.pooler = ContextPooler(config)
        dropout = getattr(config, "cls_dropout", None)
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(self.pooler.output_dim, config.num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(hidden)))


def _build(kind: str, config, index: int, weights: Callable[[str], dict] | None) -> nn.Module:
    layer: nn.Module
    if kind == "embed":
        layer = DebertaEmbeddingsLayer(config)
    elif kind == "layer":
        layer = DebertaEncoderLayer(config, index)
    else:
        layer = DebertaClassifierHead(config)
    if torch.empty(0).is_meta:
        return layer
    init_like_bert(layer, config.initializer_range)
    if isinstance(layer, DebertaEncoderLayer):  # every copy of the tied table starts equal, whichever rank builds it
        with host_rng(1_000_003):
            init_like_bert(layer.rel, config.initializer_range)
    if weights is None:
        return layer
    if kind == "embed":
        state = {"embeddings." + k: v for k, v in weights("deberta.embeddings.").items() if k != "position_ids"}
    elif kind == "layer":
        state = {"layer." + k: v for k, v in weights(f"deberta.encoder.layer.{index}.").items()}
        shared = weights("deberta.encoder.")
        state.update({"rel." + k: v for k, v in shared.items() if k.startswith(("rel_embeddings.", "LayerNorm."))})
        if layer.conv is not None:
            state.update({"conv." + k[len("conv."):]: v for k, v in shared.items() if k.startswith("conv.")})
    else:
        return load_head(layer, weights, "pooler.", config.num_labels)
    missing, _ = layer.load_state_dict(state, strict=False)
    if missing:
        raise SpecError(f"the checkpoint lacks weights for DeBERTa {kind} {index}: {', '.join(missing[:5])}")
    return layer


def tie_shapes(config) -> dict[str, list[tuple[int, ...]]]:
    """The shapes of each tied group's parameters (every stage must know them, holder or not)."""
    probe = RelativePositions(config)
    return {TIE_NAME: [tuple(p.shape) for p in probe.parameters()]}


def deberta_spec(config, weights: Callable[[str], dict] | None = None, name: str = "deberta") -> PipelineSpec:
    """The pipeline layers of a DeBERTa-v2 classifier: [embeddings, layer 0 … layer n-1, pooler + classifier]."""
    config._attn_implementation = "eager"
    layers = [partial(_build, "embed", config, 0, weights)]
    layers += [partial(_build, "layer", config, i, weights) for i in range(config.num_hidden_layers)]
    layers.append(partial(_build, "head", config, 0, weights))
    return PipelineSpec(layers=layers, loss=classify_loss, name=name,
                        extras={"hf_config": config.to_dict(), "task": "classify", "architecture": "deberta-v2",
                                "tied": tie_shapes(config), "tied_copies": {TIE_NAME: config.num_hidden_layers}})


def _normalise(key: str) -> str:
    if key.startswith(("deberta.", "classifier.", "pooler.")):
        return key
    return "deberta." + key


def pretrained_deberta_spec(directory: str, num_labels: int, dropout: float | None = None) -> PipelineSpec:
    """A DeBERTa-v2 classifier spec whose layers load their own weights from a local HF checkpoint directory."""
    from transformers import DebertaV2Config

    config = classifier_config(DebertaV2Config.from_pretrained(directory), num_labels, dropout)
    return deberta_spec(config, CheckpointWeights(directory, normalise=_normalise),
                        name=os.path.basename(os.path.normpath(directory)))

