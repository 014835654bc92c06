"""LoRA through peft: low-rank adapters on a stage's layers, the base weights frozen, merged back for the export.

Each pipeline layer gets its adapters separately (peft's `inject_adapter_in_model` on the layer), under an RNG seeded
by the layer's index in the whole model — so whichever rank builds a layer, its adapters start the same, and a
pipeline trains exactly what one process would. Only adapter weights (and the parameters of a layer that asks to be
trained whole: a classifier head made for the task) require gradients: the optimizer, the grad sync and the
checkpoints see nothing else. The export writes base + B·A·alpha/r under the base weights' own names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from aqpipe.stages.llama import FAMILIES
from aqpipe.stages.spec import PipelineSpec, SpecError, Stage, host_rng

# the module names adapted by default, per architecture (spec.extras["architecture"])
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    **{kind: family.lora_targets for kind, family in FAMILIES.items()},
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "bert": ("query", "key", "value", "dense"),
    "deberta-v2": ("query_proj", "key_proj", "value_proj", "dense"),
}
ADAPTER = "default"  # peft's adapter name
_SEED_SALT = 7_654_321  # adapters draw from a stream apart from the layer's own initialization


@dataclass(frozen=True)
class LoraSettings:
    """The adapters of a run: rank, scaling numerator, dropout and the module names they attach to."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    fan_in_fan_out: bool = False  # the adapted weights are stored [in, out] (GPT-2's Conv1D)


def require_peft() -> None:
    """SpecError naming the install where peft, an optional package, is missing."""
    if importlib.util.find_spec("peft") is None:
        raise SpecError("--lora needs peft: pip install peft (aqpipe's llm extra)")


def lora_settings(rank: int, alpha: float | None, dropout: float, targets: str | None, spec: PipelineSpec
                  ) -> LoraSettings:
    """The settings for `--lora` and its companions on this model; alpha defaults to 2 x rank, the targets to the
    architecture's table row (a custom model must name them)."""
    if targets:
        names = tuple(t.strip() for t in targets.split(",") if t.strip())
    else:
        architecture = spec.extras.get("architecture")
        if architecture not in DEFAULT_TARGETS:
            raise SpecError(f"--lora: no default target modules for a {architecture or spec.name} model; name them "
                            "with --lora-targets (comma list of module names, e.g. q_proj,v_proj)")
        names = DEFAULT_TARGETS[architecture]
    return LoraSettings(rank, float(alpha if alpha is not None else 2 * rank), dropout, names,
                        fan_in_fan_out=spec.extras.get("architecture") == "gpt2")


def _leaf_names(module: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in module.named_modules() if name}


def check_targets(spec: PipelineSpec, settings: LoraSettings) -> None:
    """Refuse targets that name no module of the model, listing the Linear-like modules it has."""
    found: set[str] = set()
    linear: set[str] = set()
    for i in range(len(spec)):
        try:
            with torch.device("meta"):
                layer = spec.build_layer(i)
        except Exception:  # noqa: BLE001 - a factory that cannot run on meta is built for real
            layer = spec.build_layer(i)
        found |= _leaf_names(layer)
        linear |= {name.rsplit(".", 1)[-1] for name, sub in layer.named_modules()
                   if name and hasattr(sub, "weight") and getattr(sub.weight, "ndim", 0) == 2}
    unknown = [t for t in settings.targets if t not in found]
    if len(unknown) == len(settings.targets):
        raise SpecError(f"--lora-targets {','.join(settings.targets)} names no module of {spec.name}; its weight "
                        f"modules are {', '.join(sorted(linear))}")


def apply_lora(stage: Stage, first_layer: int, settings: LoraSettings, seed: int) -> int:
    """Add adapters to the stage's layers (the first being layer `first_layer` of the model) and freeze everything
    else; returns how many layers got adapters."""
    require_peft()
    from peft import LoraConfig, inject_adapter_in_model
    # peft's scaling is lora_alpha / r (its annotation says int; a float alpha works and is what --lora-alpha takes)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,  # type: ignore[arg-type]
                        target_modules=list(settings.targets), fan_in_fan_out=settings.fan_in_fan_out)
    adapted = 0
    for offset, layer in enumerate(stage):
        trains_whole = getattr(layer, "lora_trains_whole", False)
        if not trains_whole and _leaf_names(layer) & set(settings.targets):
            with host_rng(seed * 1_000_003 + first_layer + offset + _SEED_SALT):
                inject_adapter_in_model(config, layer, adapter_name=ADAPTER)
            adapted += 1
        for name, p in layer.named_parameters():
            p.requires_grad_(trains_whole or ".lora_" in f".{name}")
    stage.adapted = True
    return adapted


def is_adapted(module: nn.Module) -> bool:
    """Whether `apply_lora` ran on this stage."""
    return bool(getattr(module, "adapted", False))


def checkpointed_names(module: nn.Module) -> set[str] | None:
    """The state-dict names a checkpoint keeps of a stage: None for all of them, under LoRA only what trains (the
    frozen base comes from the pretrained weights again on resume)."""
    if not is_adapted(module):
        return None
    return {name for name, p in module.named_parameters() if p.requires_grad}


def training_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of a stage's weights (see `checkpointed_names`), on the host."""
    keep = checkpointed_names(module)
    return {k: v.detach().cpu() for k, v in module.state_dict().items() if keep is None or k in keep}


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's adapter weights alone (what a peft adapter directory holds), on the host."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items() if ".lora_" in k}


def merged_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's weights with every adapter merged into its base weight, under the names the layer had before
    adapters were added (what the export reads)."""
    if not is_adapted(module):
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    deltas = {f"{name}.base_layer.weight": getattr(sub, "get_delta_weight")(ADAPTER)  # noqa: B009 - untyped in peft
              for name, sub in module.named_modules() if isinstance(sub, LoraLayer) and ADAPTER in sub.lora_A}
    merged = {}
    for key, value in module.state_dict().items():
        if ".lora_" in key:
            continue
        if key in deltas:
            value = value + deltas[key].to(value.dtype)
        merged[key.replace(".base_layer.", ".")] = value.detach().cpu()
    return merged
