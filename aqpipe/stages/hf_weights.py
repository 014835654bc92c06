"""Reading Hugging Face checkpoint directories tensor by tensor, so a stage loads only its own layers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch


def model_type(directory: str) -> str | None:
    """The `model_type` of an HF checkpoint directory's config.json, or None when it has none or is unreadable."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def holds_weights(directory: str | Path) -> bool:
    """Whether an HF checkpoint directory holds weights (safetensors, or pytorch_model*.bin), not a config alone."""
    return any(Path(directory).glob("*.safetensors")) or any(Path(directory).glob("pytorch_model*.bin"))


class CheckpointWeights:
    """The tensors of an HF checkpoint directory (safetensors, or pytorch_model*.bin) under a key prefix.

    `normalise` maps each stored key to one naming scheme (checkpoints of the bare and the task model name the
    same tensor differently); `weights(prefix)` returns the tensors under a normalised prefix, prefix stripped.
    Safetensors files are read tensor by tensor, so a stage never materialises another stage's weights. A directory
    holding a config alone fails on the first read (a stage sized on the meta device reads none: `--dry-run` plans it).
    """

    def __init__(self, directory: str, normalise: Callable[[str], str] = lambda key: key) -> None:
        self.directory = Path(directory)
        self.normalise = normalise
        self._bin_state: dict | None = None
        self._key_map: dict[str, tuple[str, str]] | None = None
        self.safetensor_files = sorted(self.directory.glob("*.safetensors"))

    def _keys(self) -> dict[str, tuple[str, str]]:
        """Normalised key → (file, key as stored)."""
        from safetensors import safe_open

        if self._key_map is None:
            self._key_map = {}
            for path in self.safetensor_files:
                with safe_open(str(path), framework="pt") as f:
                    for k in f.keys():
                        self._key_map[self.normalise(k)] = (str(path), k)
        return self._key_map

    def __call__(self, prefix: str) -> dict[str, torch.Tensor]:
        if not holds_weights(self.directory):
            raise FileNotFoundError(f"{self.directory} holds no model.safetensors or pytorch_model.bin (a config.json "
                                    "alone can be planned with --dry-run, not trained)")
        if self.safetensor_files:
            from safetensors import safe_open

            out = {}
            for key, (path, original) in self._keys().items():
                if key.startswith(prefix):
                    with safe_open(path, framework="pt") as f:
                        out[key[len(prefix):]] = f.get_tensor(original)
            return out
        if self._bin_state is None:
            state = {}
            for bin_path in sorted(self.directory.glob("pytorch_model*.bin")):
                state.update(torch.load(bin_path, map_location="cpu", weights_only=True, mmap=True))
            self._bin_state = {self.normalise(k): v for k, v in state.items()}
        return {k[len(prefix):]: v for k, v in self._bin_state.items() if k.startswith(prefix)}
