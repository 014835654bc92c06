"""Merge the stages' weights into one Hugging Face checkpoint directory (`save_pretrained` + tokenizer).

The result loads with `AutoModelForCausalLM.from_pretrained` (GPT-2, whose LM head is saved untied since the
pipeline trained it apart from the token embedding; Llama-family decoders, saved tied when the model ties them —
the pipeline kept the two copies one tensor) or `AutoModelForSequenceClassification.from_pretrained` (BERT family).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from aqpipe.stages.llama import FAMILIES, Family

if TYPE_CHECKING:  # importing transformers' modeling code costs every rank seconds; only an export needs it
    from transformers import PreTrainedModel


class ExportError(RuntimeError):
    """A model that cannot be exported as an HF checkpoint."""


def _gpt2_key(layer: int, last: int, key: str) -> str:
    if layer == 0:
        return "transformer." + key
    if layer == last:
        return key if key.startswith("lm_head.") else "transformer." + key
    return f"transformer.h.{layer - 1}." + key.removeprefix("block.")


def _bert_key(layer: int, last: int, key: str) -> str:
    if layer == 0:
        return "bert." + key
    if layer == last:
        return "bert." + key if key.startswith("pooler.") else key
    return f"bert.encoder.layer.{layer - 1}." + key.removeprefix("layer.")


def _deberta_key(layer: int, last: int, key: str) -> str:
    if layer == 0:
        return "deberta." + key
    if layer == last:
        return key
    if key.startswith("rel."):  # every layer's copy of the shared table is the same tensor (tied gradients)
        return "deberta.encoder." + key.removeprefix("rel.")
    if key.startswith("conv."):
        return "deberta.encoder." + key
    return f"deberta.encoder.layer.{layer - 1}." + key.removeprefix("layer.")


def _decoder_key(family: Family, layer: int, last: int, key: str) -> str:
    if layer == 0:
        return family.key("embedding") + key.removeprefix("embed_tokens.")
    if layer == last:
        if key.startswith("lm_head."):
            return family.key("head") + key.removeprefix("lm_head.")
        return family.key("final_norm") + key.removeprefix("norm.")
    return f"{family.key('layers')}{layer - 1}." + key.removeprefix("layer.")


_KEYS: dict[str, Callable[[int, int, str], str]] = {"gpt2": _gpt2_key, "bert": _bert_key, "deberta-v2": _deberta_key,
         **{kind: partial(_decoder_key, family) for kind, family in FAMILIES.items()}}


def merged_state(stage_states: list[dict[str, torch.Tensor]], bounds: list[int], architecture: str) -> dict:
    """One HF-named state dict from each stage's state dict (keys `<local layer>.<name>`)."""
    if architecture not in _KEYS:
        raise ExportError(f"cannot export a {architecture!r} model as an HF checkpoint ({', '.join(_KEYS)} can be)")
    rename, last = _KEYS[architecture], bounds[-1] - 1
    merged = {}
    for stage, state in enumerate(stage_states):
        for key, value in state.items():
            match = re.match(r"(\d+)\.(.*)", key)
            if match is None:
                raise ExportError(f"stage {stage} weight {key!r} is not named by its layer")
            merged[rename(bounds[stage] + int(match.group(1)), last, match.group(2))] = value
    return merged


def build_hf_model(hf_config: dict, architecture: str, state: dict):
    """The `transformers` model with `state` loaded; every weight must be accounted for."""
    model: PreTrainedModel
    if architecture == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config.from_dict({**hf_config, "tie_word_embeddings": False})
        model = GPT2LMHeadModel(config)
    elif architecture == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        model = BertForSequenceClassification(BertConfig.from_dict(hf_config))
    elif architecture == "deberta-v2":
        from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

        model = DebertaV2ForSequenceClassification(DebertaV2Config.from_dict(hf_config))
    elif architecture in FAMILIES:
        family = FAMILIES[architecture]
        config = family.config_class().from_dict(hf_config)
        if config.tie_word_embeddings and not torch.equal(state[family.key("embedding") + "weight"],
                                                          state[family.key("head") + "weight"]):
            raise ExportError("the tied input embedding and LM head differ between the first and the last stage")
        model = family.cls("ForCausalLM")(config)
        # a checkpoint may name the head otherwise than the model does (GPT-NeoX's embed_out is transformers'
        # lm_head, renamed as it loads and back as it saves)
        head = family.key("head") + "weight"
        if head in state and head not in model.state_dict() and "lm_head.weight" in model.state_dict():
            state = {("lm_head.weight" if k == head else k): v for k, v in state.items()}
    else:
        raise ExportError(f"cannot export a {architecture!r} model as an HF checkpoint ({', '.join(_KEYS)} can be)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(("attn.bias", "attn.masked_bias", "position_ids", "token_type_ids"))]
    if missing or unexpected:
        raise ExportError(f"the stages' weights do not make a whole {architecture} model: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    return model.eval()


def export_hf(stage_states: list[dict], bounds: list[int], architecture: str, hf_config: dict, out_dir: str | Path,
              tokenizer=None, label_names: list[str] | None = None) -> Path:
    """Write `out_dir` as an HF checkpoint directory (model, config, and the tokenizer when given)."""
    model = build_hf_model(hf_config, architecture, merged_state(stage_states, bounds, architecture))
    if label_names:
        model.config.id2label = dict(enumerate(label_names))
        model.config.label2id = {name: i for i, name in enumerate(label_names)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


ADAPTER_DIR_NAMES = ("adapter_config.json", "adapter_model.safetensors")


def export_adapter(adapter_states: list[dict], bounds: list[int], architecture: str, settings, base_model: str,
                   out_dir: str | Path) -> Path:
    """Write `out_dir` as a peft adapter directory for the causal LM at `base_model` (adapter_config.json and
    adapter_model.safetensors): `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model),
    out_dir)` then computes what the pipeline's adapted stages compute. `adapter_states` hold each stage's adapter
    weights under its layer-local names (peft's adapter name included)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    from aqpipe.stages.lora import ADAPTER

    if architecture == "gpt2" or architecture in FAMILIES:
        task_type = "CAUSAL_LM"
    else:
        raise ExportError(f"--export-adapter writes adapters of causal LMs, not of a {architecture!r} classifier (its "
                          "head trains whole); the merged export in export/ holds the trained model")
    named = merged_state(adapter_states, bounds, architecture)
    # peft's saved names: under base_model.model., without the adapter's name
    weights = {"base_model.model." + key.replace(f".{ADAPTER}.", "."): value.contiguous() for key, value in named.items()}
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.targets), fan_in_fan_out=settings.fan_in_fan_out,
                        base_model_name_or_path=str(base_model), task_type=task_type)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(weights, str(out / "adapter_model.safetensors"))
    return out
