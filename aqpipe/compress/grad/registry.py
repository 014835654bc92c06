"""Building the compressor of one DP group from a `--grad-sync` value (the names: `aqpipe.compress.grad.methods`)."""

from __future__ import annotations

import torch

from aqpipe.compress.grad.base import AllReduceMean, DPGroup, GradSync
from aqpipe.compress.grad.methods import parse_grad_spec


def build_grad_sync(text: str, dp: DPGroup, seed: int = 0, freeze_after: int = 1, momentum: float = 0.0) -> GradSync:
    """The compressor of one stage's DP group for a --grad-sync value (qadam freezes v after `freeze_after` steps; the
    sign-based methods vote on a local momentum when `momentum` > 0)."""
    from aqpipe.compress.grad.cast import CastAllReduce
    from aqpipe.compress.grad.fft import FFTSparsifier
    from aqpipe.compress.grad.marsit import Marsit
    from aqpipe.compress.grad.powersgd import PowerSGD
    from aqpipe.compress.grad.qadam import QAdamSync
    from aqpipe.compress.grad.quantized import ErrorFeedbackQuantized
    from aqpipe.compress.grad.sidco import SIDCo
    from aqpipe.compress.grad.signsgd import SignSGD
    from aqpipe.compress.grad.topk import TopK

    spec = parse_grad_spec(text)
    builders = {
        "none": lambda: AllReduceMean(dp),
        "fp16": lambda: CastAllReduce(dp, torch.float16),
        "bf16": lambda: CastAllReduce(dp, torch.bfloat16),
        "powersgd": lambda: PowerSGD(dp, int(spec.args[0]), seed=seed),
        "ef": lambda: ErrorFeedbackQuantized(dp, *spec.args),
        "qadam": lambda: QAdamSync(dp, int(spec.args[0]), warmup_steps=freeze_after),
        "topk": lambda: TopK(dp, *spec.args),
        "sidco": lambda: SIDCo(dp, *spec.args),
        "fft": lambda: FFTSparsifier(dp, *spec.args),
        "signsgd": lambda: SignSGD(dp, seed=seed, momentum=momentum),
        "marsit": lambda: Marsit(dp, int(spec.args[0]), seed=seed, momentum=momentum),
    }
    return builders[spec.method]()
