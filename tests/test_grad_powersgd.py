"""powersgd:R runs torch's own hook: a plain average first, then low-rank; rank-1 gradients come through exactly."""

import torch

from aqpipe.compress.grad import DPGroup
from aqpipe.compress.grad.powersgd import PowerSGD
from tests.distributed import run_ranks


def _steps(rank: int, world: int, tmp: str):
    u = torch.randn(40, 1, generator=torch.Generator().manual_seed(0))
    v = torch.randn(1, 30, generator=torch.Generator().manual_seed(1))
    sync = PowerSGD(DPGroup(None, tuple(range(world)), rank), rank=1, seed=0)
    params = [torch.nn.Parameter(torch.zeros(40, 30)), torch.nn.Parameter(torch.zeros(30))]
    outs, sent = [], []
    for step in range(4):
        scale = float(rank + 1 + step)
        params[0].grad = (u @ v) * scale  # rank 1 on every replica
        params[1].grad = torch.full((30,), scale)
        before = sync.bytes_sent
        sync.synchronize(params)
        outs.append((params[0].grad.clone(), params[1].grad.clone()))
        sent.append(sync.bytes_sent - before)
    torch.save(sync.state_dict(), f"{tmp}/psgd-{rank}.pt")
    loaded = PowerSGD(DPGroup(None, tuple(range(world)), rank), rank=1, seed=0)
    loaded.load_state_dict(torch.load(f"{tmp}/psgd-{rank}.pt", weights_only=True))
    return outs, sent, (u @ v), loaded.state.iter == sync.state.iter


def test_plain_averages_then_exact_rank_one_in_fewer_bytes(tmp_path):
    results = run_ranks(_steps, 2, str(tmp_path))
    assert all(status == "ok" for status, _ in results), results
    outs, sent, m, restored = results[0][1]
    for step, (matrix, vector) in enumerate(outs):
        mean_scale = (1 + step + 2 + step) / 2
        assert torch.allclose(matrix, m * mean_scale, rtol=1e-4, atol=1e-4)
        assert torch.allclose(vector, torch.full((30,), mean_scale))
    # torch's hook all-reduces plainly until its iteration counter reaches start_powerSGD_iter = 2
    assert sent[0] == sent[1] == 4 * (40 * 30 + 30)  # 2(n-1)/n of the fp32 buffer, n = 2
    assert sent[2] == sent[3] == 4 * (40 + 30 + 30)  # P (40x1), Q (30x1) and the uncompressed vector
    assert restored


def _on_a_cuda_host(rank: int, world: int, tmp: str):
    """The same steps in a process that sees CUDA (as on a GPU machine) while its group's collectives run on the
    host (gloo: dp > 1 with ranks sharing a GPU, or --device cpu): torch.cuda.synchronize raises for a host device,
    as the real one does."""
    def synchronize(device=None):
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")

    torch.cuda.is_available = lambda: True
    torch.cuda.synchronize = synchronize
    return _steps(rank, world, tmp)


def test_a_cuda_host_staging_collectives_through_the_host_does_not_crash(tmp_path):
    """torch's hook ends each compressed step with torch.cuda.synchronize(bucket.device) whenever CUDA
    is available, which raised for the host bucket gloo's collectives use."""
    results = run_ranks(_on_a_cuda_host, 2, str(tmp_path))
    assert all(status == "ok" for status, _ in results), results
    outs, sent, m, _ = results[0][1]
    assert torch.allclose(outs[3][0], m * (1 + 3 + 2 + 3) / 2, rtol=1e-4, atol=1e-4)  # a compressed step, exact


def _with_a_scalar(rank: int, world: int):
    sync = PowerSGD(DPGroup(None, tuple(range(world)), rank), rank=1, seed=0)
    params = [torch.nn.Parameter(torch.zeros(40, 30)), torch.nn.Parameter(torch.zeros(()))]  # a learned scale
    scalars = []
    for step in range(3):
        params[0].grad = torch.ones(40, 30) * (rank + 1)
        params[1].grad = torch.tensor(float(rank + step))
        sync.synchronize(params)
        scalars.append(float(params[1].grad))
    return scalars


def test_a_scalar_parameter_is_averaged_once_the_hook_compresses():
    """torch's hook views each gradient as a matrix of shape[0] rows, which a 0-dim one does not have: a model with a
    learned scalar (a temperature, a gate) crashed at PowerSGD's first compressed step."""
    results = run_ranks(_with_a_scalar, 2)
    assert results == [("ok", [0.5, 1.5, 2.5])] * 2, results
