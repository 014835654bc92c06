"""The quantizers' vocabularies, by name: the grids (`--quant-grid`), the scale granularities (`--quant-scales`) and
the roundings (`--quant-rounding`), the one table each that the configuration, the codecs and the stores read (no torch
import, so the configuration can check a name cheaply). `aqpipe.compress.quantize` says what each grid is."""

from __future__ import annotations

GRIDS = ("signed", "fit", "symmetric", "uniform")  # the first is the default
DEFAULT_GRID = GRIDS[0]
SCALES = ("channel", "token")  # one scale per sample and channel, or per sample and token; the first is the default
ROUNDINGS = ("nearest", "stochastic")  # deterministic, or unbiased stochastic; the first is the default
