"""`--grad-sync sidco:{exp|gamma|gpareto}:F`: SIDCo threshold sparsification (Abdelmoniem et al., MLSys 2021).

Instead of sorting for the top F·d gradient values, SIDCo fits a sparsity-inducing distribution to |g| and reads
the threshold off its closed-form quantile. For aggressive ratios it fits in stages (peak over threshold): stage 1
fits the chosen distribution to all of |g| for ratio δ1 = 0.25; each later stage fits the exceedances over the
previous threshold, shifted by it — exponential again for `exp` (Corollary 2.1), a generalized Pareto for
`gamma` and `gpareto` (Lemma 2) — for ratio (F/δ1)^(1/(M−1)), so the stage ratios multiply to F. Every Q = 5
calls the number of stages M moves by one when the average selected count left [k(1−ε), k(1+ε)], ε = 0.2
(Algorithm 1, Adapt_Stages). The printed Adapt_Stages lowers M on an overshoot; but an exponential fitted to
heavier-tailed data overshoots less with more stages (|g| ~ gamma(0.5), δ = 0.001: 8.7·k selected at M = 1, 1.5·k
at M = 2, 1.1·k at M = 3), so here M moves the way that last shrank the error. Error feedback keeps what was
not sent; replicas all-gather their (value, index) lists, whose lengths differ.

Closed forms (δ the stage ratio; μ, σ² mean and variance of the fitted magnitudes):
  exp      η = μ·log(1/δ)                                   (6), (10)
  gamma    η = β·Q⁻¹(α, δ), α = (3 − s + √((s−3)² + 24s)) / 12s, s = log μ − mean(log|g|), β = μ/α   (16); the
           paper's (15) approximates this quantile by −β(log δ + log Γ(α)), which turns negative for heavy tails (α ≲
           0.2 at δ = 0.25) and for large α, so the fitted gamma's exact quantile is computed instead
  gpareto  η = β/α·(δ^−α − 1), α = ½(1 − μ²/σ²), β = ½μ(μ²/σ² + 1)      (28), (29); + the previous threshold (7)
"""

from __future__ import annotations

import math

import torch

from aqpipe.compress.grad.base import DPGroup
from aqpipe.compress.grad.gather import all_gather_bytes_payloads
from aqpipe.compress.grad.topk import SparseFeedback, scatter_payloads, sparse_payload

DISTRIBUTIONS = ("exp", "gamma", "gpareto")
FIRST_STAGE_RATIO = 0.25
ADAPT_EVERY = 5
TOLERANCE = 0.2
MAX_STAGES = 10


def exponential_threshold(magnitudes: torch.Tensor, ratio: float) -> float:
    """η = μ·log(1/δ): the (1−δ) quantile of an exponential fitted by maximum likelihood."""
    return float(magnitudes.sum(dtype=torch.float64)) / magnitudes.numel() * math.log(1.0 / ratio)


def gamma_threshold(magnitudes: torch.Tensor, ratio: float) -> float:
    """The (1 − δ) quantile of a gamma fitted with Minka's closed-form shape estimate (the paper's (16))."""
    positive = magnitudes > 0
    count = int(positive.sum())
    if count == 0:
        return 0.0
    # float32 logs, float64 sums: the statistics of 25M values without a float64 copy of them
    mu = float(magnitudes.sum(dtype=torch.float64)) / count
    logs = torch.where(positive, magnitudes, torch.ones(())).log_()
    s = math.log(mu) - float(logs.sum(dtype=torch.float64)) / count
    if s <= 0:  # all magnitudes equal: no spread to fit
        return mu
    alpha = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
    beta = mu / alpha
    # the paper's −β(log δ + log Γ(α)) approximates this quantile only near α = 1: at the first stage's δ = 0.25 it
    # turns negative for α ≲ 0.2 (selecting nearly everything) and for large α; the exact quantile does neither
    return beta * gamma_quantile(alpha, 1.0 - ratio)


def gamma_quantile(alpha: float, probability: float) -> float:
    """x with P(X ≤ x) = probability for X ~ Gamma(shape α, scale 1): bisection on the regularized incomplete gamma
    function (float64), on a log scale because heavy-tailed quantiles span many orders of magnitude."""
    shape = torch.tensor(alpha, dtype=torch.float64)
    tail = 1.0 - probability
    low, high = -60.0, math.log(max(1.0, alpha)) + 10.0
    while float(torch.special.gammaincc(shape, torch.tensor(math.exp(high), dtype=torch.float64))) > tail:
        high += 5.0
    for _ in range(100):
        middle = (low + high) / 2
        if float(torch.special.gammaincc(shape, torch.tensor(math.exp(middle), dtype=torch.float64))) > tail:
            low = middle
        else:
            high = middle
    return math.exp((low + high) / 2)


def pareto_threshold(magnitudes: torch.Tensor, ratio: float) -> float:
    """η = β/α·(δ^−α − 1) with moment-matched shape α and scale β (the paper's (28)–(29), location 0)."""
    n = magnitudes.numel()
    mu = float(magnitudes.sum(dtype=torch.float64)) / n
    var = float(magnitudes.square().sum(dtype=torch.float64)) / n - mu * mu
    if var <= 0:
        return mu
    alpha = 0.5 * (1 - mu * mu / var)
    beta = 0.5 * mu * (mu * mu / var + 1)
    if abs(alpha) < 1e-6:  # the exponential limit
        return beta * math.log(1.0 / ratio)
    return beta / alpha * (math.exp(-alpha * math.log(ratio)) - 1)


def stage_ratios(target: float, stages: int) -> list[float]:
    """δ1 = 0.25 then equal ratios whose product with δ1 is the target (one stage: the target itself)."""
    if stages == 1 or target >= FIRST_STAGE_RATIO:
        return [target]
    rest = (target / FIRST_STAGE_RATIO) ** (1.0 / (stages - 1))
    return [FIRST_STAGE_RATIO] + [rest] * (stages - 1)


def estimate_threshold(flat: torch.Tensor, target: float, distribution: str, stages: int) -> float:
    """The multi-stage threshold for keeping a fraction `target` of |flat|."""
    magnitudes = flat.abs()
    threshold = 0.0
    for m, ratio in enumerate(stage_ratios(target, stages)):
        if m == 0:
            fit = {"exp": exponential_threshold, "gamma": gamma_threshold, "gpareto": pareto_threshold}[distribution]
            threshold = fit(magnitudes, ratio)
        else:
            exceed = magnitudes[magnitudes > threshold] - threshold
            if exceed.numel() < 2:
                break
            fit = exponential_threshold if distribution == "exp" else pareto_threshold
            threshold = threshold + fit(exceed, ratio)
    return threshold


class SIDCo(SparseFeedback):
    """Statistical threshold sparsification with adaptive stages and error feedback; all-gather pattern."""

    def __init__(self, dp: DPGroup, distribution: str, ratio: float) -> None:
        super().__init__(dp)
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"SIDCo fits one of {DISTRIBUTIONS}, not {distribution!r}")
        self.distribution, self.ratio = distribution, ratio
        self.name = f"sidco:{distribution}:{ratio:g}"
        self.stages = 1
        self.direction = 1
        self.last_error: float | None = None
        self.selected_since_adapt: list[int] = []

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        """Indices of the values at or above the estimated threshold; adapts the stage count every Q calls."""
        threshold = estimate_threshold(flat, self.ratio, self.distribution, self.stages)
        indices = (flat.abs() >= threshold).nonzero().view(-1)
        if indices.numel() == 0:  # never send nothing: keep the largest value
            indices = flat.abs().argmax().view(1)
        self.selected_since_adapt.append(indices.numel())
        if len(self.selected_since_adapt) == ADAPT_EVERY:
            self.adapt(sum(self.selected_since_adapt) / ADAPT_EVERY, flat.numel())
            self.selected_since_adapt = []
        return indices

    def adapt(self, average_selected: float, length: int) -> None:
        """Adapt_Stages: when the average count over the last Q calls is off k by more than ε, move the stage count
        by one — in the direction that last reduced the error (starting with more stages; at a bound, turn)."""
        error = average_selected / (self.ratio * length) - 1
        if abs(error) <= TOLERANCE:
            return
        if self.last_error is not None and abs(error) > abs(self.last_error):
            self.direction = -self.direction
        self.last_error = error
        moved = min(max(self.stages + self.direction, 1), MAX_STAGES)
        if moved == self.stages:  # at a bound: the other way is the only way
            self.direction = -self.direction
            moved = min(max(self.stages + self.direction, 1), MAX_STAGES)
        self.stages = moved

    def combine(self, flat: torch.Tensor) -> torch.Tensor:
        compensated = self.feedback.compensate(flat)
        indices = self.select(compensated)
        values = compensated[indices]
        self.feedback.update(compensated, torch.zeros_like(compensated).index_put_((indices,), values))
        payloads, sent = all_gather_bytes_payloads(self.dp, sparse_payload(values, indices))
        self.bytes_sent += sent
        return scatter_payloads(payloads, flat.numel())

    def state_dict(self) -> dict:
        return dict(super().state_dict(), stages=self.stages, direction=self.direction, last_error=self.last_error,
                    selected=list(self.selected_since_adapt))

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.stages = int(state.get("stages", 1))
        self.direction = int(state.get("direction", 1))
        self.last_error = state.get("last_error")
        self.selected_since_adapt = [int(x) for x in state.get("selected", [])]
