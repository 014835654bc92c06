"""Optimizer, linear warm-up then linear decay, and clipping on the gradient norm of the whole model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

SGD_MOMENTUM = 0.9


def momenta(momentum: float | None, sign_based: bool) -> tuple[float, float]:
    """(the SGD optimizer's momentum, the sign-based grad sync's local momentum) for a --momentum value: by default
    SGD keeps 0.9, but a sign method runs as its paper specifies (lr·sign, no momentum); asked-for momentum under a
    sign method goes before the vote (Signum), never onto the signs."""
    if sign_based:
        return 0.0, momentum or 0.0
    return (SGD_MOMENTUM if momentum is None else momentum), 0.0


def build_optimizer(
    params: Sequence[torch.nn.Parameter], name: str, lr: float, weight_decay: float, warmup_steps: int, total_steps: int,
    grad_sync=None, momentum: float = SGD_MOMENTUM,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW or SGD (with `momentum`) with a linear warm-up over `warmup_steps`, then linear decay to 0 at
    `total_steps`. With the qadam grad sync, AdamW is its QuantizedAdam, which exchanges the momentum through that
    sync (`GradSync.own_optimizer`)."""
    # one group, given as a group so that a stage with nothing to train (an embedding-only stage under LoRA) still
    # gets an optimizer: torch refuses an empty parameter list, not an empty group
    params = [{"params": list(params)}]  # type: ignore[list-item]
    own = grad_sync.own_optimizer(params, name, lr, weight_decay) if grad_sync is not None else None
    if own is not None:
        optimizer: torch.optim.Optimizer = own
    elif name == "adamw":
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    elif name == "sgd":
        optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup_steps, total_steps))
    return optimizer, schedule


def continue_schedule(schedule: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer) -> None:
    """After loading a checkpoint's optimizer and schedule state: set every learning rate to what *this* run's
    schedule gives at the step reached. The saved rates belong to the saved schedule: a finished run extended with
    more steps would otherwise take its first new step at the old schedule's final rate (0)."""
    step = schedule.last_epoch
    rates = [base * fn(step) for base, fn in zip(schedule.base_lrs, schedule.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    schedule._last_lr = rates  # what get_last_lr() reports


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base learning rate at `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    remaining = total_steps - step
    span = max(1, total_steps - warmup_steps)
    return max(0.0, remaining / span)


def local_grad_sq_norm(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient entries of `params`: per-tensor norms in the gradients' dtype, squared and summed in
    float64 (each square exact; the stages' shares are then added in stage order, `comm.ordered_sum`, since even
    float64 sums round by order). On the gradients' device (nothing is read: the caller adds the tied tables' shares
    before the one copy the collective needs)."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack([n.reshape(()) for n in torch._foreach_norm(grads)])
    return norms.double().pow(2).sum()


def clip_by_global_norm(params: Sequence[torch.nn.Parameter], max_norm: float, global_sq_norm: torch.Tensor) -> float:
    """Scale gradients so the whole model's norm is at most `max_norm` (0 = no clipping); returns the norm before."""
    norm = float(global_sq_norm.sqrt())
    if max_norm > 0:
        coefficient = min(1.0, max_norm / (norm + 1e-6))
        if coefficient < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
    return norm
