"""Data-parallel gradient synchronisation: one object per stage DP group, picked by `--grad-sync`."""

from aqpipe.compress.grad.base import GradSync, build_grad_sync

__all__ = ["GradSync", "build_grad_sync"]
