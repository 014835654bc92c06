"""fp16 / bf16 grad sync: the average, in half the bytes of fp32."""

import pytest
import torch

from aqpipe.compress.grad import DPGroup
from aqpipe.compress.grad.base import AllReduceMean
from aqpipe.compress.grad.cast import CastAllReduce
from tests.distributed import run_ranks


def _sync(rank: int, world: int, kind: str):
    grad = torch.randn(500, generator=torch.Generator().manual_seed(rank)) * 1e3
    param = torch.nn.Parameter(torch.zeros(500))
    param.grad = grad.clone()
    dp = DPGroup(None, tuple(range(world)), rank)
    sync = AllReduceMean(dp) if kind == "none" else CastAllReduce(dp, getattr(torch, kind))
    sync.synchronize([param])
    return grad, param.grad, sync.bytes_sent


@pytest.mark.parametrize("kind, rtol, width", [("none", 1e-6, 4), ("float16", 2e-3, 2), ("bfloat16", 2e-2, 2)])
def test_result_is_the_mean_at_the_precision_of_the_wire(kind, rtol, width):
    results = run_ranks(_sync, 3, kind)
    assert all(status == "ok" for status, _ in results), results
    mean = torch.stack([g for _, (g, _, _) in results]).mean(0)
    for _, (_, out, sent) in results:
        assert torch.allclose(out, mean, rtol=rtol, atol=rtol * float(mean.abs().max()))
        assert sent == 2 * 2 * width * 500 // 3  # a ring all-reduce member sends 2(n-1)/n of the buffer
