"""Optimizer construction: SGD momentum defaults, and what the sign-based grad syncs run by default."""

import torch

from aqpipe.runtime.optim import SGD_MOMENTUM, build_optimizer, momenta


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
