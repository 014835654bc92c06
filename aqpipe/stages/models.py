"""Turn `--model` (a preset, a checkpoint directory, a hub id, or `module:function`) into a `PipelineSpec`."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass

from aqpipe.stages import gpt2
from aqpipe.stages.spec import PipelineSpec, SpecError


@dataclass(frozen=True)
class ModelSource:
    """What `--model` names: kind is "preset", "directory", "hub" or "callable"."""

    kind: str
    value: str


def classify_model(name: str) -> ModelSource:
    """Decide what kind of model `name` refers to, or raise SpecError with a hint."""
    if name in gpt2.PRESETS:
        return ModelSource("preset", name)
    if ":" in name and not os.path.exists(name):
        return ModelSource("callable", name)
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise SpecError(f"--model {name!r} is a directory without config.json, not an HF checkpoint")
        if not gpt2.is_gpt2_checkpoint(name):
            raise SpecError(f"--model {name!r} is not a GPT-2 checkpoint; this release adapts GPT-2 models only")
        return ModelSource("directory", name)
    if "/" in name and not os.path.exists(name) and not name.startswith((".", "/")):
        return ModelSource("hub", name)
    presets = ", ".join(gpt2.PRESETS)
    raise SpecError(
        f"unknown --model {name!r}: use a preset ({presets}), a checkpoint directory, a hub id like "
        "openai-community/gpt2, or module:function"
    )


def load_callable(target: str):
    """Import `module:function` (the current directory is importable, as for `python -m`)."""
    module_name, _, func_name = target.partition(":")
    if not module_name or not func_name:
        raise SpecError(f"--model {target!r} must look like module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
        raise SpecError(f"cannot import module {module_name!r} for --model {target}: {type(e).__name__}: {e}") from None
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        raise SpecError(f"module {module_name!r} has no callable {func_name!r} for --model {target}")
    return func


def call_spec_factory(factory, **context) -> PipelineSpec:
    """Call a user's spec factory with the context arguments it declares (vocab_size, seq_len, …)."""
    params = inspect.signature(factory).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in context.items() if takes_all or k in params}
    spec = factory(**kwargs)
    if not isinstance(spec, PipelineSpec):
        raise SpecError(f"{getattr(factory, '__name__', factory)!r} returned {type(spec).__name__}, not a PipelineSpec")
    return spec


def hub_snapshot(repo_id: str) -> str:
    """Download (or find in the local HF cache) a hub checkpoint and return its directory."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "merges.txt"])
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, …
        raise SpecError(f"cannot fetch --model {repo_id!r} from the Hugging Face hub: {type(e).__name__}: {e}") from None


def tokenizer_directory(name: str) -> str | None:
    """The directory whose tokenizer the model brings, or None when aqpipe must train one."""
    source = classify_model(name)
    if source.kind == "directory":
        return name
    if source.kind == "hub":
        return hub_snapshot(name)
    return None


def build_spec(name: str, vocab_size: int, seq_len: int, dropout: float | None = None, spec_factory=None) -> PipelineSpec:
    """The `PipelineSpec` for `--model name` (or for a spec factory given from Python)."""
    if spec_factory is not None:
        return call_spec_factory(spec_factory, vocab_size=vocab_size, seq_len=seq_len)
    source = classify_model(name)
    if source.kind == "preset":
        config = gpt2.gpt2_config(name, vocab_size, dropout)
        if seq_len > config.n_positions:
            raise SpecError(f"--seq-len {seq_len} exceeds {name}'s {config.n_positions} positions")
        return gpt2.gpt2_spec(config, name=name)
    if source.kind == "callable":
        return call_spec_factory(load_callable(name), vocab_size=vocab_size, seq_len=seq_len)
    directory = name if source.kind == "directory" else hub_snapshot(name)
    return gpt2.pretrained_gpt2_spec(directory, dropout)
