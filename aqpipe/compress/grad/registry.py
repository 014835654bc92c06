"""Where a --grad-sync value becomes its method's class (the table: `aqpipe.compress.grad.methods`): the sync of one
DP group, and what the capacity plan reads before anything runs — a replica's bytes per step and its memory."""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence

from aqpipe.compress.grad.base import Compressor, DPGroup, GradSync
from aqpipe.compress.grad.methods import METHODS, GradSpec, as_grad_spec
from aqpipe.compress.grad.wire import SyncBytes


def method_class(method: str) -> type[Compressor]:
    """The class that implements a --grad-sync method (its row's `implementation`, imported on first use); a
    TypeError where the class is not what its row says it is."""
    kind = METHODS[method]
    module, _, name = kind.implementation.partition(":")
    implementation = getattr(importlib.import_module(module), name)
    says = (kind.sign_based, kind.clippable, kind.own_optimizer)
    does = (implementation.sign_based, implementation.clippable,
            implementation.own_optimizer is not Compressor.own_optimizer)
    if not issubclass(implementation, Compressor) or says != does:
        raise TypeError(f"--grad-sync {method}: its row says (sign-based, clippable, own optimizer) = {says}, its "
                        f"class {kind.implementation} does {does}")
    return implementation


def build_grad_sync(grad_sync: GradSpec | str, dp: DPGroup, seed: int = 0, freeze_after: int = 1,
                    momentum: float = 0.0) -> GradSync:
    """The compressor of one stage's DP group for a --grad-sync value (qadam freezes v after `freeze_after` steps; the
    sign-based methods vote on a local momentum when `momentum` > 0)."""
    spec = as_grad_spec(grad_sync)
    return method_class(spec.method).from_spec(spec, dp, seed, freeze_after, momentum)


def sync_step_bytes(grad_sync: GradSpec | str, dp: int, shapes: Sequence[tuple[int, ...]], freeze_after: int = 1) -> SyncBytes:
    """What one replica of `dp` hands to the network in an optimizer step for synchronized parameters of `shapes`
    (qadam exchanging fp32 averages for `freeze_after` steps): exact for the formats' fixed sizes, sidco's at
    its target fraction, the sign-based methods' with every row active (at most what they send). Nothing without
    replicas. tests/test_grad_methods.py holds it to the bytes the code counts."""
    spec = as_grad_spec(grad_sync)
    if dp < 2 or sum(math.prod(shape) for shape in shapes) == 0:
        return SyncBytes(0, 0)
    return method_class(spec.method).step_bytes(spec, dp, shapes, freeze_after)


def sync_copies(grad_sync: GradSpec | str, dp: int) -> tuple[float, float]:
    """fp32 copies of a stage's trained parameters one replica's grad sync holds where its collectives run: (what it
    keeps from step to step, the most it holds at once while it runs, that included)."""
    spec = as_grad_spec(grad_sync)
    return method_class(spec.method).memory_copies(spec, dp)


def gloo_gpu_copies(grad_sync: GradSpec | str) -> float:
    """fp32 copies of the trained parameters a grad sync staged through the host holds on the GPU at its peak."""
    return method_class(as_grad_spec(grad_sync).method).gloo_gpu_copies
