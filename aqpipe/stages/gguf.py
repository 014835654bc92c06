"""GGUF files as pretrained models: converted once (transformers' GGUF loader, weights de-quantized to fp32) into
an HF checkpoint directory cached under `$AQPIPE_CACHE`, which every rank then reads stage by stage."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import hashlib
import json
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from aqpipe.stages.spec import SpecError

# GGUF's `general.architecture` -> the transformers model type the decoder adapter reads (Mistral GGUFs say llama).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma3": "gemma3_text",
                      "phi3": "phi3"}
FINGERPRINT_BYTES = 8 << 20  # read from each end of the file for the cache key (a 7B GGUF is several GB)
_LIBRARIES_PATCHED = threading.Lock()  # one conversion at a time replaces the libraries' names (and puts them back)


def gguf_architecture(path: str) -> str:
    """The `general.architecture` a GGUF file declares; SpecError when it is not a readable GGUF file."""
    try:
        import gguf  # noqa: F401 - transformers' GGUF loader needs it
    except ImportError:
        raise SpecError(f"--model {path} is a GGUF file: install the gguf package (pip install gguf accelerate)") from None
    try:
        return _read_architecture(path)
    except Exception as e:  # noqa: BLE001 - truncated, not GGUF, no architecture key
        raise SpecError(f"--model {path} is not a readable GGUF file: {type(e).__name__}: {e}") from None


def _read_architecture(path: str) -> str:
    """`general.architecture` from a GGUF file's metadata, its string arrays (the tokenizer's vocabulary) left unread
    where transformers' reader is there to skip them (0.03 s for SmolLM2's file, against 4-5 s for gguf's reader,
    which reads everything)."""
    try:
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:  # (transformers before its own GGUF reader)
        from gguf import GGUFReader

        field = GGUFReader(path).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    return read_gguf_metadata(path)[0]["general.architecture"]


def fingerprint(path: str) -> str:
    """A short key of a GGUF file's content: its size and its first and last bytes."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, size - FINGERPRINT_BYTES))
        digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]


def converted_directory(path: str) -> str:
    """The HF checkpoint directory of a GGUF file (model, config and tokenizer with its chat template), converting
    it on first use; SpecError for an architecture the decoder adapter does not cover."""
    from aqpipe.data.tokenizer import cache_dir

    target = cache_dir() / f"gguf-{Path(path).stem}-{fingerprint(path)}"
    if (target / "config.json").is_file():  # converted before, so its architecture was checked then
        return str(target)
    # Parsing the metadata takes seconds (a tokenizer's whole vocabulary is in it): only before a conversion.
    architecture = gguf_architecture(path)
    if architecture not in GGUF_ARCHITECTURES:
        raise SpecError(f"--model {path} is a GGUF of architecture {architecture!r}; aqpipe's decoder adapter covers "
                        f"{', '.join(GGUF_ARCHITECTURES)} GGUFs (or give module:function returning a PipelineSpec)")
    with open(cache_dir() / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks and launches converting the same file wait for the first one
        if not (target / "config.json").is_file():
            _convert(path, target)
    return str(target)


def _convert(path: str, target: Path) -> None:
    """Load the GGUF with transformers and save it as safetensors plus tokenizer files under `target`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from aqpipe.disk import writing

    directory, name = os.path.split(os.path.abspath(path))
    print(f"converting {path} to an HF checkpoint under {target.parent} (once)", flush=True)
    tmp = target.with_name(f".{target.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # a cache may be shared
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _metadata_parsed_once():
            # (the config read once: a model load without one parses the file's whole metadata for it again)
            config = AutoConfig.from_pretrained(directory, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        tmp.mkdir(parents=True)
        # save_pretrained refuses a model loaded from GGUF, so the de-quantized tensors are written directly
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # one tensor in the model, stored once
        with writing(tmp, sum(t.numel() * t.element_size() for t in state.values())):
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config = model.config.to_dict()
            config.pop("quantization_config", None)  # the saved tensors are plain fp32: nothing to de-quantize
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def _metadata_parsed_once() -> Iterator[None]:
    """Within a conversion, transformers' GGUF reader parses a file's metadata once, not once for the config and
    again for the tokenizer, and gguf builds its table of tensor names once per architecture, not once per module of
    the model (together about a third of converting SmolLM2-135M: seconds, the whole vocabulary is in the metadata).
    Each caller gets its own copy of what was parsed; where either library names these otherwise, nothing changes."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader

    with _LIBRARIES_PATCHED:
        originals = {(loader, "load_gguf_checkpoint"): getattr(loader, "load_gguf_checkpoint", None),
                     (gguf, "get_tensor_name_map"): getattr(gguf, "get_tensor_name_map", None)}
        parse, names = originals.values()
        if parse is None or names is None:
            yield
            return
        parsed: dict[str, dict] = {}

        @functools.wraps(parse)
        def parse_once(path, return_tensors=False, *args, **kwargs):
            if return_tensors or args or kwargs:  # the weights: read once anyway, by the model's load
                return parse(path, return_tensors, *args, **kwargs)
            if path not in parsed:
                parsed[path] = parse(path, return_tensors=False)
            return copy.deepcopy(parsed[path])

        # (both are looked up by their modules' names when called, so replacing the names reaches every caller)
        replaced = {(loader, "load_gguf_checkpoint"): parse_once, (gguf, "get_tensor_name_map"): functools.cache(names)}
        for (module, attribute), value in replaced.items():
            setattr(module, attribute, value)
        try:
            yield
        finally:
            for (module, attribute), value in originals.items():
                setattr(module, attribute, value)
