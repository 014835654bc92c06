"""The quantization grids, by name: the one table `--quant-grid`, the codecs and the stores read (no torch import,
so the configuration can check a name cheaply). `aqpipe.compress.quantize` says what each grid is."""

from __future__ import annotations

GRIDS = ("signed", "fit", "symmetric", "uniform")  # the first is the default
DEFAULT_GRID = GRIDS[0]
