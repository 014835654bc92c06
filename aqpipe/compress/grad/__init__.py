"""Data-parallel gradient synchronisation: one compressor per stage DP group, picked by `--grad-sync`.

The methods by name, one row each, and the parser of a `--grad-sync` value (`methods`, no torch import); where a row
becomes its class and what the capacity plan reads from it (`registry`); what a sync hands to the network, sized before
anything runs (`wire`). The interface, the DP group and the plain fp32 all-reduce (`base`); what the compressors are
made of: error feedback (`feedback`), all-gathered payloads (`gather`) and ring collectives of packed codes (`ring`).
One module per method: half-precision averages (`cast`), B-bit codes with error feedback (`quantized`), top-k
(`topk`), FFT sparsification (`fft`), SIDCo (`sidco`), all-reducible signSGD (`signsgd`), Marsit (`marsit`),
QuantizedAdam (`qadam`) and PowerSGD through torch's own hook (`powersgd`).

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
