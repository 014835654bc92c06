"""Evaluation on the held-out split: a forward-only pass through the pipeline.

Held-out activations cross the links through the evaluation codec (`--eval-codec`), one that codes each sample
alone and keeps nothing, under a message kind of their own: they never touch m(ξ), so training's codecs and stores
are left exactly as they were (the AQ-SGD authors' code sends them uncompressed, as `--eval-codec fp32` does).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from aqpipe.pipeline import present
from aqpipe.pipeline.execution.worker import StageWorker
from aqpipe.pipeline.links.tied_rows import FOR_EVALUATION
from aqpipe.pipeline.numerics.mixed_precision import autocast
from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import Grid, gather_rows


def held_out_samples(available: int, cap: int | None) -> int:
    """How many held-out samples an evaluation pass runs on: the first `cap` of the `available` (all without one)."""
    return available if cap is None else min(available, cap)


def eval_batches(num_samples: int, replica: int, replicas: int, micro_batch_size: int) -> list[torch.Tensor]:
    """The held-out sample ids one replica evaluates (every `replicas`-th, none dropped), in micro-batches."""
    return list(torch.arange(replica, num_samples, replicas).split(micro_batch_size))


@dataclass
class EvalTotals:
    """What one rank counted in one evaluation: summed losses (each batch's mean times its loss terms), the loss
    terms (samples, or response tokens of instruction data), samples, and (classification) the confusion matrix, rows
    = true label, columns = predicted."""

    loss_sum: float = 0.0
    terms: float = 0.0
    samples: int = 0
    confusion: torch.Tensor | None = None
    bytes_sent: int = 0


def evaluate_stage(worker: StageWorker, step: int, batches: list[torch.Tensor], samples, num_labels: int,
                   on_batch: Callable[[int, int], None] | None = None) -> EvalTotals:
    """Run this stage's part of one evaluation pass (every rank of a replica calls it with the same batches);
    `on_batch(done, total)` after each batch."""
    grid, links = worker.grid, worker.links
    totals = EvalTotals(confusion=torch.zeros(num_labels, num_labels, dtype=torch.int64) if num_labels else None)
    if links.act_in is not None:
        for mb, ids in enumerate(batches):
            links.act_in.post_eval(step, mb, ids.numel())
    if links.tied_rows is not None:  # the first stage looks up the held-out tokens' rows of a tied table
        before = links.tied_rows.bytes_sent
        links.tied_rows.begin(step, [samples.inputs(ids) for ids in batches], FOR_EVALUATION)
        totals.bytes_sent += links.tied_rows.bytes_sent - before
    was_training = worker.module.training
    worker.module.eval()
    try:
        with torch.no_grad(), autocast(worker.device, worker.precision):
            for mb, ids in enumerate(batches):
                if grid.is_first_stage:
                    x, mask = samples.inputs(ids), samples.mask(ids)
                else:
                    x, ids, mask = present(links.act_in, "the incoming activation link").receive_eval()
                out = worker.module(x.to(worker.device), None if mask is None else mask.to(worker.device))
                if grid.is_last_stage:
                    terms = samples.loss_tokens(ids) if hasattr(samples, "loss_tokens") else ids.numel()
                    _count(totals, out, samples.targets(ids).to(worker.device), worker.loss_fn, terms)
                else:
                    out_link = present(links.act_out, "the outgoing activation link")
                    totals.bytes_sent += out_link.send_eval(step, mb, out, ids, mask)
                if on_batch is not None:
                    on_batch(mb + 1, len(batches))
            if links.act_out is not None:
                links.act_out.flush()
    finally:
        worker.module.train(was_training)
        if links.tied_rows is not None:
            links.tied_rows.end_evaluation()
    return totals


def _count(totals: EvalTotals, out: torch.Tensor, targets: torch.Tensor, loss_fn, terms: int) -> None:
    n = targets.shape[0]
    if terms:
        totals.loss_sum += float(loss_fn(out, targets)) * terms
    totals.terms += terms
    totals.samples += n
    if totals.confusion is not None:
        predicted = out.argmax(dim=-1).cpu()
        flat = targets.cpu() * totals.confusion.shape[0] + predicted
        totals.confusion += torch.bincount(flat, minlength=totals.confusion.numel()).view_as(totals.confusion)


def gather_eval(totals: EvalTotals, grid: Grid, num_labels: int, device: torch.device | None = None) -> dict | None:
    """Sum every rank's totals on rank 0 and turn them into metrics (None on other ranks)."""
    confusion = totals.confusion if totals.confusion is not None else torch.zeros(0, dtype=torch.int64)
    mine = torch.cat([torch.tensor([totals.loss_sum, float(totals.samples), totals.terms, float(totals.bytes_sent)],
                                   dtype=torch.float64), confusion.reshape(-1).to(torch.float64)])
    rows = gather_rows(mine, grid, device or torch.device("cpu"), comm.EVALUATION)
    if rows is None:
        return None
    total = rows.sum(dim=0)
    loss_sum, count, terms = float(total[0]), int(total[1]), float(total[2])
    gathered = (grid.world_size - 1) * mine.numel() * mine.element_size()
    result: dict = {"loss": loss_sum / terms if terms else float("nan"), "samples": count,
                    "bytes": int(total[3]) + gathered}  # every message and gather the pass sent
    if num_labels:
        result.update(classification_metrics(total[4:].round().to(torch.int64).view(num_labels, num_labels)))
    else:
        result["perplexity"] = math.exp(min(result["loss"], 700.0))
    return result


def classification_metrics(confusion: torch.Tensor) -> dict:
    """Accuracy and Matthews correlation (the multi-class form; for two classes the usual MCC) of a confusion
    matrix with true labels on rows."""
    c = confusion.to(torch.float64)
    n = float(c.sum())
    correct = float(c.diagonal().sum())
    true_counts, predicted_counts = c.sum(dim=1), c.sum(dim=0)
    covariance = correct * n - float((true_counts * predicted_counts).sum())
    denominator = math.sqrt((n * n - float((predicted_counts ** 2).sum())) * (n * n - float((true_counts ** 2).sum())))
    return {"accuracy": correct / n if n else float("nan"), "mcc": covariance / denominator if denominator else 0.0,
            "confusion": confusion.tolist()}
