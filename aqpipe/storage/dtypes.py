"""The store dtypes, by name: the one table `--store-dtype`, the stores, the capacity estimate and the CLI help
read (no torch import, so the configuration and the help can use it cheaply)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoreDtype:
    """How m(ξ) is kept: its code in an LMDB value's header, the float type a codec holds it in, the bytes per
    value on disk or in memory (scales aside), its bits when quantized, and whether the memory store can keep it."""

    code: int
    float_name: str  # the torch dtype's name: float32, float16 or bfloat16
    value_bytes: float
    bits: int = 0  # 0: a float encoding; else quantized to this many bits per value
    in_memory: bool = True
    summary: str = ""


STORE_DTYPES: dict[str, StoreDtype] = {
    "fp32": StoreDtype(1, "float32", 4.0, summary="exact"),
    "fp16": StoreDtype(2, "float16", 2.0, summary="half the bytes; the default"),
    "bf16": StoreDtype(3, "bfloat16", 2.0, summary="half the bytes, fp32's range"),
    "q8": StoreDtype(8, "float32", 1.0, bits=8, in_memory=False, summary="8-bit codes (lmdb)"),
    "q4": StoreDtype(4, "float32", 0.5, bits=4, in_memory=False, summary="4-bit codes (lmdb)"),
    "q2": StoreDtype(6, "float32", 0.25, bits=2, in_memory=False, summary="2-bit codes (lmdb)"),
}
MEMORY_DTYPES = tuple(name for name, d in STORE_DTYPES.items() if d.in_memory)


def describe_store_dtypes() -> str:
    """The store dtypes for --help."""
    return "; ".join(f"{name} ({d.summary})" for name, d in STORE_DTYPES.items())
