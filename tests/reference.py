"""A plain single-process trainer: the ground truth a pipeline run must reproduce."""

from __future__ import annotations

import torch
from torch import nn

from aqpipe.config import RunConfig
from aqpipe.pipeline.numerics.optim import build_optimizer
from aqpipe.pipeline.numerics.tied import local_copies
from aqpipe.runtime.plan import make_plan
from aqpipe.stages.lora import apply_lora
from aqpipe.stages.spec import Stage


def train_single_process(cfg: RunConfig) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    """Train the whole model in this process on the same data order; returns (losses per step, params, bounds).

    Runs on one thread like each pipeline worker here: a different thread count changes the summation order inside
    matmuls, and Adam magnifies that rounding noise in parameters whose true gradient is zero (GPT-2's key biases).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(cfg)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: RunConfig) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    plan = make_plan(cfg)
    spec = plan.spec
    model = Stage(*(spec.build_layer(i, cfg.seed) for i in range(len(spec))))
    if plan.lora is not None:
        apply_lora(model, 0, plan.lora, cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, schedule = build_optimizer(params, cfg.optimizer, cfg.lr, cfg.weight_decay,
                                          cfg.warmup_steps, plan.total_steps)
    replicas = [plan.epoch_plan(r) for r in range(cfg.dp)]
    data = plan.dataset.train
    n = cfg.micro_batches * cfg.dp
    losses = []
    for step in range(plan.total_steps):
        total = 0.0
        replica_grads = []
        step_tokens = _step_tokens(data, [ids for r in replicas for ids in r.micro_batches_of(step)])
        for replica in replicas:  # data parallelism done by hand: each replica's mean gradient, then their mean
            micro_batches = replica.micro_batches_of(step)
            weights = _loss_weights(data, micro_batches, step_tokens, cfg.dp)
            for ids, weight in zip(micro_batches, weights):
                loss = spec.loss(model(data.inputs(ids), data.mask(ids)), data.targets(ids))
                (loss * weight if hasattr(data, "loss_tokens") else loss / cfg.micro_batches).backward()
                total += float(loss.detach()) * (weight * cfg.micro_batches if hasattr(data, "loss_tokens") else 1.0)
            replica_grads.append([p.grad.clone() for p in params])
            optimizer.zero_grad(set_to_none=True)
        for p, *grads in zip(params, *replica_grads):
            p.grad = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0) / len(grads)
        tied = _sum_tied(model) if plan.lora is None else []
        if cfg.clip > 0:
            clip_in_float64(params, cfg.clip, tied)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / n)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, plan.bounds


def _step_tokens(data, every_micro_batch) -> int:
    """Response tokens in the whole step, every replica's micro-batches together (instruction data)."""
    return sum(data.loss_tokens(ids) for ids in every_micro_batch) if hasattr(data, "loss_tokens") else 0


def _loss_weights(data, micro_batches, step_tokens: int, replicas: int) -> list[float]:
    """Instruction data: each micro-batch's share of the whole step's response tokens, times the replica count
    (the replicas' gradients are averaged): the step's gradient is that of the mean over all its response tokens."""
    if not hasattr(data, "loss_tokens"):
        return [1.0] * len(micro_batches)
    return [data.loss_tokens(ids) * replicas / step_tokens for ids in micro_batches]


def _sum_tied(model: nn.Module) -> list[list[nn.Parameter]]:
    """Every copy of a tied tensor gets the sum of the copies' gradients (one tensor in the model); returns the
    copies of each group."""
    groups = list(local_copies(model).values())
    for copies in groups:
        for params in zip(*copies):
            total = torch.stack([p.grad.float() for p in params]).sum(0)
            for p in params:
                p.grad = total.clone()
    return groups


def clip_in_float64(params, max_norm: float, tied: list[list[list[nn.Parameter]]] | None = None) -> None:
    """Global-norm clipping with per-tensor fp32 norms combined in float64, as the pipeline combines its stages'
    shares (torch's clip_grad_norm_ combines in float32, and that last-bit difference in the coefficient is
    again magnified by Adam where gradients are zero). A tied tensor's gradient counts once."""
    copies = [p for group in tied or [] for copy in group for p in copy]
    once = [p for group in tied or [] for p in group[0]]
    grads = [p.grad for p in params if p.grad is not None and all(p is not c for c in copies)]
    grads += [p.grad for p in once]
    norm = sum(float(torch.linalg.vector_norm(g)) ** 2 for g in grads) ** 0.5
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient)
