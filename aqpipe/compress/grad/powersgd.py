"""`--grad-sync powersgd:R`: rank-R PowerSGD with error feedback and warm start, run by torch's own DDP hook.

torch's `powerSGD_hook` works on a DDP gradient bucket; a stage's gradients here are one flat buffer with a view
per parameter, which is what a bucket is, so the hook runs unchanged on a small object with the bucket's
interface. The first two steps are plain all-reduces (torch's hook compresses from its iteration 2 on).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from aqpipe.compress.grad.base import Compressor, DPGroup, flatten, gradients
from aqpipe.compress.grad.methods import GradSpec
from aqpipe.compress.grad.wire import FIRST_STEPS, POWERSGD_PLAIN_STEPS, SyncBytes, ring_all_reduce_bytes


class _Bucket:
    """What `powerSGD_hook` reads of a `dist.GradBucket`: a flat buffer and per-parameter views of it."""

    def __init__(self, flat: torch.Tensor, shapes: list[torch.Size]) -> None:
        self._flat, self._views = flat, []
        offset = 0
        for shape in shapes:
            n = int(np.prod(shape)) if len(shape) else 1
            # (the hook views each gradient as shape[0] rows: a 0-dim one, a learned scalar, as one value)
            self._views.append(flat[offset : offset + n].view(shape if len(shape) else (1,)))
            offset += n

    def buffer(self) -> torch.Tensor:
        return self._flat

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


@contextlib.contextmanager
def _host_buckets_need_no_cuda_sync() -> Iterator[None]:
    """torch's hook ends a compressed step with `torch.cuda.synchronize(bucket.device)` whenever CUDA is available,
    which raises for a host bucket: on a GPU machine whose replicas stage their collectives through the host (gloo
    with ranks sharing a GPU, `--device cpu`). A host bucket has no GPU work to wait for (the gradients' copy to it
    already synchronized), so for the hook's call a synchronize of a host device does nothing."""
    real = torch.cuda.synchronize

    def synchronize(device=None) -> None:
        if device is not None and torch.device(device).type != "cuda":
            return
        real(device)

    torch.cuda.synchronize = synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = real


class PowerSGD(Compressor):
    """Low-rank gradient approximation P·Qᵀ per weight matrix; vectors and small matrices go uncompressed."""

    pattern = "multi-round"  # two all-reduces (P, then Q) per step
    # its error and its factors (R·(m + n) values of an m × n matrix, factored only where that is at most half of it)
    kept_copies, peak_copies = 1.5, 4.1

    def __init__(self, dp: DPGroup, rank: int, seed: int = 0) -> None:
        super().__init__(dp)
        self.name = f"powersgd:{rank}"
        self.state = psgd.PowerSGDState(process_group=dp.group, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=POWERSGD_PLAIN_STEPS,
                                        min_compression_rate=2, use_error_feedback=True, warm_start=True,
                                        random_seed=seed)

    @classmethod
    def from_spec(cls, spec: GradSpec, dp: DPGroup, seed: int, freeze_after: int, momentum: float) -> PowerSGD:
        return cls(dp, spec.args[0], seed=seed)

    @classmethod
    def step_bytes(cls, spec: GradSpec, dp: int, shapes: Sequence[tuple[int, ...]], freeze_after: int) -> SyncBytes:
        """The factors, after the hook's first steps of plain fp32 all-reduces."""
        factored = ring_all_reduce_bytes(4 * sum(factored_values(shape, spec.args[0]) for shape in shapes), dp)
        fp32 = ring_all_reduce_bytes(4 * sum(math.prod(shape) for shape in shapes), dp)
        return SyncBytes(factored, max(factored, fp32), FIRST_STEPS, POWERSGD_PLAIN_STEPS)

    def synchronize(self, params: Sequence[torch.nn.Parameter]) -> None:
        if self.dp.size == 1:
            self.calls += 1
            return
        grads = gradients(params)
        flat = flatten(grads).to(self.dp.device)  # the hook's all-reduces run where the group's collectives do
        before = self.state.total_numel_after_compression
        plain = self.state.iter < self.state.start_powerSGD_iter
        bucket = cast(dist.GradBucket, _Bucket(flat, [g.shape for g in grads]))  # what the hook reads of one
        with _host_buckets_need_no_cuda_sync():
            result = psgd.powerSGD_hook(self.state, bucket).wait()
        result = result[0] if isinstance(result, list) else result
        sent = flat.numel() if plain else self.state.total_numel_after_compression - before
        self.bytes_sent += ring_all_reduce_bytes(4 * sent, self.dp.size)
        offset = 0
        for g in grads:
            g.copy_(result[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.calls += 1

    def state_dict(self) -> dict:
        kind, keys, pos, has_gauss, gauss = self.state.rng.get_state()
        return dict(super().state_dict(), iter=self.state.iter, error=dict(self.state.error_dict),
                    p=dict(self.state.p_memory_dict), q=dict(self.state.q_memory_dict),
                    rng=[torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss])

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.state.iter = int(state["iter"])
        self.state.error_dict = dict(state["error"])
        self.state.p_memory_dict, self.state.q_memory_dict = dict(state["p"]), dict(state["q"])
        keys, pos, has_gauss, gauss = state["rng"]
        self.state.rng.set_state(("MT19937", keys.cpu().numpy().astype(np.uint32), int(pos), int(has_gauss), float(gauss)))


def factored_values(shape: tuple[int, ...], rank: int) -> int:
    """Values torch's PowerSGD hook all-reduces for one tensor: its factors P and Q where they are less than half of
    it (the hook's min_compression_rate of 2, on the tensor viewed as shape[0] rows), else the tensor."""
    size = math.prod(shape)
    if len(shape) < 2:
        return size
    rows = shape[0]
    cols = size // rows if rows else 0
    factors = (rows + cols) * min(rows, cols, rank)
    return factors if 2 * factors < size else size
