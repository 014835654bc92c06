"""Relative MSE of one quantization on each grid, Gaussian and Laplace data, per-channel and per-token scales.

    python benchmarks/grid_mse.py
"""

from __future__ import annotations

import torch

from aqpipe.compress.quantize import GRIDS, dequantize, quantize


def main() -> None:
    torch.manual_seed(0)
    data = {"Gaussian": torch.randn(8, 128, 256),
            "Laplace": torch.distributions.Laplace(0.0, 1.0).sample((8, 128, 256))}
    print("| data | scales | bits | rounding | " + " | ".join(GRIDS) + " |")
    print("|---|---|---|---|" + "---|" * len(GRIDS))
    for name, x in data.items():
        for per in ("channel", "token"):
            for bits in (1, 2, 3, 4):
                for stochastic in (False, True):
                    cells = []
                    for grid in GRIDS:
                        q = quantize(x, bits, per, stochastic, torch.Generator().manual_seed(0), grid)
                        y = dequantize(q, tuple(x.shape))
                        cells.append(f"{float(((x - y) ** 2).sum() / (x ** 2).sum()):.3f}")
                    rounding = "stochastic" if stochastic else "nearest"
                    print(f"| {name} | {per} | {bits} | {rounding} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
