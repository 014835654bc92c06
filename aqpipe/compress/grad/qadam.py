"""`--grad-sync qadam:B`: QuantizedAdam, the 1-bit-Adam pattern the AQ-SGD paper uses for end-to-end compression.

Warm-up: plain AdamW on fp32-averaged gradients (the grad sync all-reduces). After it, Adam's second moment v is
frozen (it has settled and cannot be estimated from compressed data) and the replicas exchange the momentum
instead of the gradient: each computes m ← β1·m + (1−β1)·g from its local gradient, and the momenta are averaged
by a compressed two-phase all-reduce — B-bit quantization with the worker's error feedback, each replica owning
one chunk (phase 1: every replica sends every other one its chunk; the owner averages, adds its server error
feedback and re-quantizes), then an all-gather of the owners' B-bit chunks (phase 2). The step is
x ← x − lr·(m̂/(√v̂ + ε) + wd·x), with AdamW's bias corrections and v̂ from the frozen v.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aqpipe.compress.grad.base import AllReduceMean, DPGroup, gradients
from aqpipe.compress.grad.feedback import ErrorFeedback
from aqpipe.compress.grad.methods import GradSpec
from aqpipe.compress.grad.quantized import decode, encode
from aqpipe.compress.grad.ring import chunk_size
from aqpipe.compress.grad.wire import FIRST_STEPS, SyncBytes, quantized_bytes, ring_all_reduce_bytes


class QAdamSync(AllReduceMean):
    """The communication side: fp32 all-reduce while warming up, then compressed momentum exchange."""

    name = "qadam"
    pattern = "two-phase"
    # its worker residual (its server residual, a 1/dp chunk, comes on top); at its peak the optimizer's momentum
    # exchange included
    kept_copies, peak_copies = 1.0, 9.1
    ALONE_PEAK = 3.1  # its step at dp 1
    gloo_gpu_copies = 3.0  # the flat gradient, its momentum, the averaged one and the step's denominator

    def __init__(self, dp: DPGroup, bits: int, warmup_steps: int) -> None:
        super().__init__(dp)
        self.bits, self.warmup_steps = bits, max(1, warmup_steps)
        self.name = f"qadam:{bits}"
        self.worker_feedback, self.server_feedback = ErrorFeedback(), ErrorFeedback()
        self.momentum_round = False

    @classmethod
    def from_spec(cls, spec: GradSpec, dp: DPGroup, seed: int, freeze_after: int, momentum: float) -> QAdamSync:
        return cls(dp, spec.args[0], warmup_steps=freeze_after)

    @classmethod
    def step_bytes(cls, spec: GradSpec, dp: int, shapes: Sequence[tuple[int, ...]], freeze_after: int) -> SyncBytes:
        """fp32 averages until v freezes after `freeze_after` steps; then each replica's chunk of 1/dp of the
        momentum to its server, and the server's back to all."""
        values = sum(math.prod(shape) for shape in shapes)
        chunks = 2 * (dp - 1) * quantized_bytes(-(-values // dp), spec.args[0])
        return SyncBytes(chunks, max(chunks, ring_all_reduce_bytes(4 * values, dp)), FIRST_STEPS, freeze_after)

    @classmethod
    def memory_copies(cls, spec: GradSpec, dp: int) -> tuple[float, float]:
        """Its step runs alone too (AdamW with a frozen v)."""
        return (0.0, cls.ALONE_PEAK) if dp < 2 else (cls.kept_copies + 1 / dp, cls.peak_copies)

    def own_optimizer(self, params: list, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer | None:
        """AdamW (the only optimizer qadam runs under) is its QuantizedAdam."""
        return QuantizedAdam(params, self, lr=lr, weight_decay=weight_decay) if name == "adamw" else None

    @property
    def frozen(self) -> bool:
        """Whether the warm-up is over: gradients stay local, momenta travel compressed."""
        return self.calls >= self.warmup_steps

    def synchronize(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Average the gradients during the warm-up; afterwards leave them local (the optimizer exchanges m)."""
        self.momentum_round = self.frozen  # decided before counting this call, read by this step's optimizer
        if self.momentum_round:
            self.calls += 1
            gradients(params)  # zeros where a replica got none, so every replica's momentum vector lines up
            return
        super().synchronize(params)

    def average_momentum(self, momentum: torch.Tensor) -> torch.Tensor:
        """The replicas' mean momentum through the compressed two-phase all-reduce with error feedback."""
        n = self.dp.size
        if n == 1:  # nothing to exchange, so nothing to compress: one replica runs exactly AdamW with a frozen v
            return momentum
        compensated = self.worker_feedback.compensate(momentum)
        c = chunk_size(momentum.numel(), n)
        padded = torch.zeros(c * n, device=momentum.device)
        padded[: momentum.numel()] = compensated
        chunks = list(padded.view(n, c))
        encoded = [encode(chunk, self.bits) for chunk in chunks]
        self.worker_feedback.update(compensated, torch.cat([values for _, values in encoded])[: momentum.numel()])
        received = self._exchange([payload for payload, _ in encoded])
        mine = torch.stack([decode(p, c, self.bits) for p in received]).mean(0)
        mine = self.server_feedback.compensate(mine)
        payload, values = encode(mine, self.bits)
        self.server_feedback.update(mine, values)
        owners = self._all_gather(payload)
        return torch.cat([decode(p, c, self.bits) for p in owners])[: momentum.numel()]

    def _exchange(self, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Phase 1: send chunk j to replica j; receive every replica's copy of this replica's chunk."""
        import torch.distributed as dist

        me, n = self.dp.index, self.dp.size
        received: list[torch.Tensor] = [payloads[me]] * n
        ops = []
        for j in range(n):  # one batch of paired ops: NCCL deadlocks on unpaired point-to-point calls
            if j != me:
                received[j] = torch.empty_like(payloads[me])
                ops.append(dist.P2POp(dist.isend, payloads[j].contiguous(), self.dp.ranks[j], self.dp.group, 0x5141))
                ops.append(dist.P2POp(dist.irecv, received[j], self.dp.ranks[j], self.dp.group, 0x5141))
                self.bytes_sent += payloads[j].numel()
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return received

    def _all_gather(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Phase 2: every owner's re-quantized chunk to everyone."""
        import torch.distributed as dist

        out = [torch.empty_like(payload) for _ in range(self.dp.size)]
        dist.all_gather(out, payload, group=self.dp.group)
        self.bytes_sent += (self.dp.size - 1) * payload.numel()
        return out

    def state_dict(self) -> dict:
        return dict(super().state_dict(), worker=self.worker_feedback.state_dict(),
                    server=self.server_feedback.state_dict())

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.worker_feedback.load_state_dict(state.get("worker", {}))
        self.server_feedback.load_state_dict(state.get("server", {}))


class QuantizedAdam(torch.optim.Optimizer):
    """AdamW whose post-warm-up steps use the replicas' compressed mean momentum and a frozen second moment."""

    def __init__(self, params, sync: QAdamSync, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.sync = sync

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step; after the warm-up, with the exchanged momentum and the frozen v."""
        frozen = self.sync.momentum_round
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float64)
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        if frozen and params:
            beta1 = self.param_groups[0]["betas"][0]
            local = torch.cat([(self.state[p]["exp_avg"] * beta1 + p.grad * (1 - beta1)).reshape(-1) for p in params])
            averaged = self.sync.average_momentum(local.float().to(self.sync.dp.device)).to(local.device)
            offset = 0
            for p in params:
                self.state[p]["exp_avg"].copy_(averaged[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                t = float(state["step"])
                if not frozen:
                    state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    # a Python float: a checkpoint's load casts a state tensor to the parameter's dtype
                    state["frozen_correction"] = 1 - beta2 ** t
                correction2 = float(state.get("frozen_correction", 1 - beta2 ** t))
                denom = (state["exp_avg_sq"] / correction2).sqrt_().add_(group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** t))
        return None


def freeze_step(total_steps: int, warmup_steps: int) -> int:
    """When v freezes: after the LR warm-up, and after at least a tenth of the run."""
    return max(1, warmup_steps, math.ceil(total_steps / 10))
