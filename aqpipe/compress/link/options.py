"""How quantizing codecs round and scale, as a run's configuration asks (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aqpipe.compress.grids import DEFAULT_GRID


@dataclass
class QuantOptions:
    """How quantizing codecs round and scale."""

    per: str = "channel"  # scale granularity: channel or token
    stochastic: bool = False
    seed: int = 0
    grid: str = DEFAULT_GRID  # which levels a code stands for (aqpipe.compress.quantize.GRIDS)

    @classmethod
    def of(cls, cfg: Any, rank: int = 0) -> QuantOptions:
        """The options a run's configuration asks for (`--quant-scales/-rounding/-grid`, `--seed`), for `rank`
        (each rank's stochastic rounding draws from a stream of its own)."""
        return cls(per=cfg.quant_scales, stochastic=cfg.quant_rounding == "stochastic", seed=cfg.seed + rank,
                   grid=cfg.quant_grid)
