"""What each link of a run carries, for the capacity plan: a link's bytes per step in each phase of a run (lossless
warm-up, a first epoch of first sights, the steady state of deltas), only the real rows of padded batches where
they travel so (`aqpipe.runtime.capacity.rows`), and what one side of its m(ξ) keeps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aqpipe.compress.link.base import numel
from aqpipe.compress.link.codes import lossless_dtype
from aqpipe.compress.link.factory import message_bytes
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CodecSpec
from aqpipe.config import ResolvedConfig
from aqpipe.runtime.capacity.rows import RowShapes

# The phases of a run whose steps differ in link bytes, and how a message says "during" each.
STEADY, WARM_UP, FIRST_EPOCH = "steady", "warm-up", "first epoch"
STEP_PHASES = {STEADY: "", WARM_UP: " during the warm-up (lossless links)",
               FIRST_EPOCH: " during the first epoch (every sample a first sight)"}


@dataclass
class LinkNeeds:
    """One link (stage k → k+1) of one replica, per optimizer step."""

    link: int
    activation_shape: tuple[int, ...]  # one micro-batch
    activation_dtype: str
    fwd_bytes: int  # payload bytes per step once compressing
    bwd_bytes: int
    warmup_fwd_bytes: int  # during the fp32 warm-up epochs
    warmup_bwd_bytes: int
    store_side_bytes: int  # one side's m(ξ) values (0 unless the link runs AQ-SGD)
    first_fwd_bytes: int = 0  # a compressing step whose samples are all first sights (AQ-SGD: --first-sight)
    padded_bytes: int = 0  # both directions per step, every padded position lossless (0: the link sends them all)

    def phase_bytes(self, phase: str) -> tuple[int, int]:
        """Payload bytes (forward, backward) per step in a phase of the run (STEP_PHASES)."""
        return {STEADY: (self.fwd_bytes, self.bwd_bytes), WARM_UP: (self.warmup_fwd_bytes, self.warmup_bwd_bytes),
                FIRST_EPOCH: (self.first_fwd_bytes, self.bwd_bytes)}[phase]

    def run_bytes(self, steps: int, steps_per_epoch: int, warmup_epochs: int) -> tuple[int, int]:
        """Payload bytes (forward, backward) over a run of `steps`: the warm-up epochs lossless, then — when no
        warm-up seeded m(ξ) — a first epoch of first sights, then deltas."""
        fwd = bwd = 0
        for step in range(steps):
            epoch = step // steps_per_epoch
            if epoch < warmup_epochs:
                fwd, bwd = fwd + self.warmup_fwd_bytes, bwd + self.warmup_bwd_bytes
            else:
                fwd += self.first_fwd_bytes if epoch == 0 else self.fwd_bytes
                bwd += self.bwd_bytes
        return fwd, bwd


def steady_payload_bytes(spec: CodecSpec, direction: str, shape: tuple[int, ...], dtype: torch.dtype,
                         options: QuantOptions) -> int:
    """Payload bytes of one compressed message of `shape` with a --fw/--bw spec (AQ-SGD: every sample a delta)."""
    return message_bytes(spec, direction, shape, dtype, options)


def raw_payload_bytes(spec: CodecSpec, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Payload bytes of one warm-up message (lossless, in the activation's own dtype; a codec keeping m(ξ) sends a
    mode byte per sample too)."""
    values = numel(shape) * lossless_dtype(dtype).itemsize
    return shape[0] + values if spec.keeps_messages else values


def first_sight_payload_bytes(spec: CodecSpec, first_sight: CodecSpec, shape: tuple[int, ...], dtype: torch.dtype,
                              options: QuantOptions) -> int:
    """Payload bytes of one compressed forward message whose samples are all first sights: AQ-SGD codes them with
    `first_sight` (fp32: losslessly); any other codec sends them as it sends every sample."""
    return message_bytes(spec, "fw", shape, dtype, options, first_sight, first_sights=True)


def link_needs(cfg: ResolvedConfig, k: int, shape: tuple[int, ...], dtype: torch.dtype, rows: RowShapes,
               options: QuantOptions, store_bytes_per_value: float) -> LinkNeeds:
    """What link k carries per step, its micro-batch activation of `shape` in `dtype` (as `rows` says it travels),
    and what one side of its m(ξ) keeps (`store_bytes_per_value`: every sample's share of one value)."""
    m, fw, bw = cfg.micro_batches, cfg.fw_spec, cfg.bw_spec

    def per_step(message_bytes: Callable[[tuple[int, ...]], int]) -> int:
        return rows.step_bytes(message_bytes, shape, m)

    def fwd(s: tuple[int, ...]) -> int:
        return steady_payload_bytes(fw, "fw", s, dtype, options)

    def bwd(s: tuple[int, ...]) -> int:
        return steady_payload_bytes(bw, "bw", s, torch.float32, options)

    def fwd_raw(s: tuple[int, ...]) -> int:
        return raw_payload_bytes(fw, s, dtype)

    def bwd_raw(s: tuple[int, ...]) -> int:
        return raw_payload_bytes(bw, s, torch.float32)

    def fwd_first(s: tuple[int, ...]) -> int:
        return first_sight_payload_bytes(fw, cfg.first_sight_spec, s, dtype, options)

    real = rows.store_fraction(shape)
    side = int(store_bytes_per_value * numel(shape[1:]) * real) if cfg.keeps_messages else 0
    padded = m * numel(shape) * (lossless_dtype(dtype).itemsize + 4) if real < 1.0 else 0
    return LinkNeeds(k, shape, str(dtype).removeprefix("torch."), per_step(fwd), per_step(bwd), per_step(fwd_raw),
                     per_step(bwd_raw), side, per_step(fwd_first), padded)
