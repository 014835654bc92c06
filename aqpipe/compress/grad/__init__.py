"""Data-parallel gradient synchronisation: one compressor per stage DP group, picked by `--grad-sync`.

Names are imported on first use, so `aqpipe.compress.grad.methods` (the vocabulary the configuration and the CLI
help read) loads without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"DPGroup": "base", "GradSync": "base", "GradSpecError": "methods", "check_pairing": "methods",
            "parse_grad_spec": "methods", "build_grad_sync": "registry"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"aqpipe.compress.grad.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'aqpipe.compress.grad' has no attribute {name!r}")
