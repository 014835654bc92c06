"""topk:F with error feedback, and the all-gather of payloads of different sizes."""

import torch

from aqpipe.compress.grad import DPGroup
from aqpipe.compress.grad.gather import all_gather_bytes_payloads
from aqpipe.compress.grad.topk import TopK
from tests.distributed import run_ranks


def _sync(rank: int, world: int):
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    param = torch.nn.Parameter(torch.zeros(1000))
    param.grad = grad.clone()
    sync = TopK(DPGroup(None, tuple(range(world)), rank), fraction=0.05)
    sync.synchronize([param])
    return grad, param.grad, sync.feedback.residual, sync.bytes_sent


def test_replicas_average_their_top_k_and_keep_the_rest():
    results = run_ranks(_sync, 2)
    assert all(status == "ok" for status, _ in results), results
    sparse = []
    for _, (grad, _, residual, sent) in results:
        kept = grad - residual
        assert int((kept != 0).sum()) == 50
        smallest_kept = float(kept[kept != 0].abs().min())
        assert float(residual.abs().max()) <= smallest_kept  # the 50 largest went, the rest stayed
        assert sent == 8 + 50 * 8  # one length, then 50 fp32 values and 50 int32 indices
        sparse.append(kept)
    for _, (_, out, _, _) in results:
        assert torch.allclose(out, (sparse[0] + sparse[1]) / 2)


def _uneven(rank: int, world: int):
    payload = torch.full((3 + 5 * rank,), rank, dtype=torch.uint8)
    got, sent = all_gather_bytes_payloads(DPGroup(None, tuple(range(world)), rank), payload)
    return [g.tolist() for g in got], sent


def test_all_gather_returns_payloads_of_different_sizes_intact():
    results = run_ranks(_uneven, 3)
    assert all(status == "ok" for status, _ in results), results
    for _, (got, sent) in results:
        assert got == [[r] * (3 + 5 * r) for r in range(3)]
        assert sent == 2 * (8 + 13)
