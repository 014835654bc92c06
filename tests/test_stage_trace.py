"""What each stage holds, traced: the micro-batches a schedule holds at once, and the optimizer state per trained
parameter (the activations traced against a real run: tests/test_capacity.py)."""

import pytest
import torch

from aqpipe.pipeline.vocab.schedule import SCHEDULES
from aqpipe.runtime.capacity import stage_trace
from tests.test_capacity import SMALL, flags_to_config


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_micro_batches_held_follow_the_schedule(schedule):
    bound = {"gpipe": lambda pp, s, m: m, "1f1b": lambda pp, s, m: min(pp - s, m),
             "eager-1f1b": lambda pp, s, m: min(2 * (pp - s) - 1, m)}[schedule]
    for pp in range(1, 7):
        for m in (1, 3, 8):
            for s in range(pp):
                assert stage_trace.micro_batches_held(schedule, s, pp, m) == bound(pp, s, m)


@pytest.mark.parametrize("optimizer,momentum,grad_sync", [("adamw", None, "none"), ("sgd", None, "none"),
                                                           ("sgd", "0", "none"), ("sgd", None, "signsgd")])
def test_optimizer_state_counts_what_the_optimizer_keeps(tmp_path, optimizer, momentum, grad_sync):
    """The plan's optimizer bytes per trained parameter equal what AdamW/SGD (default momentum 0.9, or none) keeps
    after a real step, plus a sign-based grad sync's vote momentum."""
    from aqpipe.compress.grad.methods import parse_grad_spec
    from aqpipe.pipeline.numerics.optim import build_optimizer, momenta

    flags = [*SMALL, "--model", "gpt2-tiny", "--optimizer", optimizer, "--grad-sync", grad_sync]
    flags += ["--momentum", momentum] if momentum is not None else []
    cfg = flags_to_config(flags, tmp_path / "run")
    layer = torch.nn.Linear(8, 8)
    optimizer_momentum, vote_momentum = momenta(cfg.momentum, parse_grad_spec(cfg.grad_sync).sign_based)
    opt, _ = build_optimizer(list(layer.parameters()), cfg.optimizer, 0.1, 0.0, 0, 10, momentum=optimizer_momentum)
    layer(torch.randn(2, 8)).sum().backward()
    opt.step()
    kept = sum(t.numel() for state in opt.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    assert stage_trace.state_copies(cfg) == kept // sum(p.numel() for p in layer.parameters()) + (vote_momentum > 0)
