"""Optimizer construction: SGD momentum defaults, and what the sign-based grad syncs run by default."""

import torch

from aqpipe.pipeline.numerics.optim import SGD_MOMENTUM, build_optimizer, momenta


def test_sign_methods_run_plain_sgd_by_default_and_signum_when_asked():
    """`--optimizer sgd` always added momentum 0.9, so neither signSGD (lr*sign) nor Marsit's Algorithm 2 ran."""
    assert momenta(None, sign_based=True) == (0.0, 0.0)
    assert momenta(0.9, sign_based=True) == (0.0, 0.9)  # the momentum goes before the vote, never onto the signs
    assert momenta(None, sign_based=False) == (SGD_MOMENTUM, 0.0)
    assert momenta(0.5, sign_based=False) == (0.5, 0.0)


def test_plain_sgd_moves_by_exactly_lr_times_the_gradient():
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer, _ = build_optimizer([p], "sgd", 0.1, 0.0, 0, 10, momentum=0.0)
    for _ in range(3):
        p.grad = torch.tensor([1.0, -1.0, 1.0])
        optimizer.step()
    assert torch.allclose(p.detach(), torch.tensor([-0.3, 0.3, -0.3]))


def test_a_resumed_schedule_gives_this_runs_rate_at_the_step_reached():
    """A finished 12-step run extended to 13 steps: its first new step gets the 13-step schedule's rate, not the
    12-step schedule's final 0."""
    from aqpipe.pipeline.numerics.optim import continue_schedule

    param = torch.nn.Parameter(torch.ones(3))
    optimizer, schedule = build_optimizer([param], "adamw", 1e-3, 0.0, 2, 12)
    for _ in range(12):
        param.grad = torch.ones(3)
        optimizer.step()
        schedule.step()
    assert schedule.get_last_lr() == [0.0]
    saved = optimizer.state_dict(), schedule.state_dict()

    param2 = torch.nn.Parameter(param.detach().clone())
    optimizer2, schedule2 = build_optimizer([param2], "adamw", 1e-3, 0.0, 2, 13)
    optimizer2.load_state_dict(saved[0])
    schedule2.load_state_dict(saved[1])
    continue_schedule(schedule2, optimizer2)
    want = 1e-3 * 1 / 11  # step 12 (0-based) of 13, decaying over the 11 steps after warm-up
    assert abs(schedule2.get_last_lr()[0] - want) < 1e-12
    assert abs(optimizer2.param_groups[0]["lr"] - want) < 1e-12
    before = param2.detach().clone()
    param2.grad = torch.ones(3)
    optimizer2.step()
    assert not torch.equal(param2, before)  # the extended step moves the weights
