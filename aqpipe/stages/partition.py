"""Split a `PipelineSpec` into contiguous stages: by parameter count, by profiled time, or explicitly."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from aqpipe.stages.spec import PipelineSpec, SpecError


def balanced_bounds(costs: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of `costs` into `stages` non-empty parts minimising the largest part's sum.

    Returns stage boundaries [0, b1, …, len(costs)].
    """
    n = len(costs)
    if stages < 1:
        raise SpecError(f"the number of stages must be at least 1, got {stages}")
    if stages > n:
        raise SpecError(f"cannot split {n} layers into {stages} stages: each stage needs at least one layer")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest possible max-stage cost splitting the first i layers into k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def explicit_bounds(layers_per_stage: Sequence[int], total_layers: int) -> list[int]:
    """Boundaries from an explicit count of layers per stage, which must add up to the model's layers."""
    if any(c < 1 for c in layers_per_stage):
        raise SpecError(f"every stage needs at least one layer: {list(layers_per_stage)}")
    if sum(layers_per_stage) != total_layers:
        raise SpecError(
            f"the explicit partition {','.join(map(str, layers_per_stage))} covers {sum(layers_per_stage)} layers "
            f"but the model has {total_layers}"
        )
    bounds = [0]
    for c in layers_per_stage:
        bounds.append(bounds[-1] + c)
    return bounds


def profile_layer_times(
    spec: PipelineSpec, example_input: torch.Tensor, example_target: torch.Tensor, repeats: int = 3, seed: int = 0
) -> list[float]:
    """Forward+backward seconds of each layer on a real micro-batch, building one layer at a time: the fastest of
    `repeats` runs after a warm-up (a run the process was descheduled in only ever takes longer)."""
    times = []
    x = example_input
    for i in range(len(spec)):
        layer = spec.build_layer(i, seed)
        layer.train()
        samples = []
        for _ in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if i == len(spec) - 1:
                spec.loss(out, example_target).backward()
            elif out.is_floating_point():
                out.backward(torch.ones_like(out))
            samples.append(time.perf_counter() - start)
        times.append(min(samples[1:]))
        with torch.no_grad():
            x = layer(x.detach())
        del layer
    return times


def partition(
    spec: PipelineSpec,
    stages: int,
    method: str | Sequence[int] = "parameters",
    example: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[int]:
    """Stage boundaries for `spec` over `stages` stages.

    `method` is "parameters", "time" (needs `example` = (input, target) of one micro-batch) or a list of layers
    per stage. Returns [0, b1, …, len(spec)]; stage k runs layers [bounds[k], bounds[k+1]).
    """
    n = len(spec)
    if stages > n:
        raise SpecError(f"cannot split {n} layers into {stages} stages: use at most {n} stages or a deeper model")
    if not isinstance(method, str):
        if len(method) != stages:
            raise SpecError(f"the explicit partition lists {len(method)} stages but {stages} were asked for")
        return explicit_bounds(method, n)
    if method == "parameters":
        return balanced_bounds(spec.parameter_counts(), stages)
    if method == "time":
        if example is None:
            raise SpecError("partition by time needs an example micro-batch (input, target)")
        return balanced_bounds(profile_layer_times(spec, *example), stages)
    raise SpecError(f"unknown partition method {method!r}: use 'parameters', 'time' or a list of layer counts")
