"""Data-parallel gradient synchronisation: one compressor per stage DP group, picked by `--grad-sync`."""

from aqpipe.compress.grad.base import DPGroup, GradSync
from aqpipe.compress.grad.registry import GradSpecError, build_grad_sync, check_pairing, parse_grad_spec

__all__ = ["DPGroup", "GradSpecError", "GradSync", "build_grad_sync", "check_pairing", "parse_grad_spec"]
