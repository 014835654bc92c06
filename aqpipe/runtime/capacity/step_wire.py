"""The least time the wire allows a training step at --bandwidth, with every rank behind a link of its own.

Each rank (a host, or a network namespace of `aqpipe launch --bandwidth`) reaches the others through one link of the
rate, each direction at the rate. So a middle stage's outbound side carries its activations to the next stage *and*
its gradients to the previous one, and its inbound side the other two; the first and the last stage also carry a
tied table's row exchange (the owner's rows out during the forward passes, the lookup side's gradient rows during
the backward passes). Under GPipe every forward message is through before the first backward one (the last stage's
first backward waits for its last forward), so the step takes at least the slowest rank's forward traffic plus the
slowest rank's backward traffic; under 1F1B both run at once, and a step takes at least the slowest rank's traffic.

After its last backward pass a stage's replicas combine its gradients (the grad sync), over the same link; copies of
a tied table kept whole are first summed over the pipeline (and with replicas re-agree after the sync), which waits
for every stage's backward passes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankTraffic:
    """The bytes one rank's link carries per step, by direction and by the half of a GPipe step they belong to."""

    forward_out: int = 0
    forward_in: int = 0
    backward_out: int = 0
    backward_in: int = 0

    @property
    def most_each_way(self) -> int:
        """The larger direction over the whole step."""
        return max(self.forward_out + self.backward_out, self.forward_in + self.backward_in)


def rank_traffic(links: list[tuple[int, int]], row_bytes_each_way: int = 0) -> list[RankTraffic]:
    """Each rank's traffic per step from its links' (forward, backward) payload bytes (link k: stage k → k+1), with a
    tied table's rows going `row_bytes_each_way` from the last stage to the first and as many back (gradient rows)."""
    stages = len(links) + 1
    traffic = []
    for s in range(stages):
        rows_owner, rows_lookup = (row_bytes_each_way if s == stages - 1 else 0), (row_bytes_each_way if s == 0 else 0)
        fwd_out, bwd_in = links[s] if s < stages - 1 else (0, 0)
        fwd_in, bwd_out = links[s - 1] if s > 0 else (0, 0)
        traffic.append(RankTraffic(fwd_out + rows_owner, fwd_in + rows_lookup, bwd_out + rows_lookup,
                                   bwd_in + rows_owner))
    return traffic


def links_seconds(traffic: list[RankTraffic], bits_per_second: float, overlapped: bool) -> float:
    """The least step time the links' traffic alone allows (`overlapped`: a 1F1B schedule)."""
    return max(_before_sync(traffic, bits_per_second, overlapped), default=0.0)


def least_step_seconds(traffic: list[RankTraffic], bits_per_second: float, overlapped: bool,
                       sync_bytes: list[int], pipeline_bytes: int = 0) -> tuple[float, float]:
    """(The least step time the wire allows, the grad sync's seconds in it): each rank's traffic up to its last
    backward pass then its stage's grad sync (`sync_bytes` per rank's link), or — with `pipeline_bytes` per rank for
    tied copies kept whole — every rank's backward passes, that exchange, and the slowest grad sync; or the links'
    traffic alone, whichever is longest."""
    if len(sync_bytes) != len(traffic):
        raise ValueError(f"{len(sync_bytes)} grad syncs for {len(traffic)} ranks' traffic")
    before = _before_sync(traffic, bits_per_second, overlapped)
    syncs = [8 * b / bits_per_second for b in sync_bytes]
    bound = (max(before, default=0.0), 0.0)
    if pipeline_bytes:
        slowest = max(syncs, default=0.0)
        return max(bound, (bound[0] + 8 * pipeline_bytes / bits_per_second + slowest, slowest))
    for seconds, sync in zip(before, syncs):
        bound = max(bound, (seconds + sync, sync))
    return bound


def _before_sync(traffic: list[RankTraffic], bits_per_second: float, overlapped: bool) -> list[float]:
    """Per rank, the least time from the step's start to the end of its link traffic (its last backward pass)."""
    if overlapped:
        return [8 * t.most_each_way / bits_per_second for t in traffic]
    forward = max((max(t.forward_out, t.forward_in) for t in traffic), default=0)
    return [8 * (forward + max(t.backward_out, t.backward_in)) / bits_per_second for t in traffic]
