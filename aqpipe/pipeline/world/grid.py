"""The rank grid: world = pp × dp, rank = replica·pp + stage."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from aqpipe.pipeline.world import comm


@dataclass(frozen=True)
class Grid:
    """Where one rank sits: its stage in the pipeline and its replica among the data-parallel copies."""

    pp: int
    dp: int
    rank: int

    def __post_init__(self) -> None:
        if self.pp < 1 or self.dp < 1:
            raise ValueError(f"pp and dp must be at least 1, got pp={self.pp} dp={self.dp}")
        if not 0 <= self.rank < self.pp * self.dp:
            raise ValueError(f"rank {self.rank} is outside a world of {self.pp * self.dp}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def stage(self) -> int:
        return self.rank % self.pp

    @property
    def replica(self) -> int:
        return self.rank // self.pp

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def rank_of(self, stage: int, replica: int) -> int:
        """The rank running `stage` of `replica`."""
        return replica * self.pp + stage

    @property
    def prev_rank(self) -> int | None:
        """The rank this one receives activations from, or None on the first stage."""
        return None if self.is_first_stage else self.rank - 1

    @property
    def next_rank(self) -> int | None:
        """The rank this one sends activations to, or None on the last stage."""
        return None if self.is_last_stage else self.rank + 1

    @property
    def link_out(self) -> int | None:
        """The link this stage sends activations down (None on the last stage): `storage.base.stage_holding` read
        backwards."""
        return None if self.is_last_stage else self.stage

    @property
    def link_in(self) -> int | None:
        """The link this stage receives activations from (None on the first stage)."""
        return None if self.is_first_stage else self.stage - 1

    def owned_sides(self) -> list[tuple[int, str]]:
        """The (link, side) pairs of m(ξ) this rank keeps: the sender side of its outgoing link and the receiver side
        of its incoming one. Link ends, prefetch and reconciliation read this one answer."""
        pairs = [(self.link_out, "send"), (self.link_in, "recv")]
        return [(link, side) for link, side in pairs if link is not None]

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of one whole pipeline, first stage first."""
        return [self.rank_of(s, replica) for s in range(self.pp)]

    def dp_ranks(self, stage: int) -> list[int]:
        """The ranks holding `stage` in every replica."""
        return [self.rank_of(stage, r) for r in range(self.dp)]

    def describe(self, rank: int | None = None) -> str:
        """'rank R (stage S, replica P)' for messages."""
        rank = self.rank if rank is None else rank
        return f"rank {rank} (stage {rank % self.pp}, replica {rank // self.pp})"


@dataclass
class ProcessGroups:
    """The torch.distributed groups one rank uses: its pipeline and its stage's DP group."""

    pipeline: object
    data_parallel: object


def create_groups(grid: Grid, backend: str | None = None, timeout: timedelta | None = None) -> ProcessGroups:
    """Create every pipeline and DP group (all ranks must call this, in the same order) and keep this rank's; their
    collectives time out after `timeout` (None: torch's default for the backend, 10 min for NCCL, 30 for gloo)."""
    import torch.distributed as dist

    pipeline = data_parallel = None
    for replica in range(grid.dp):
        group = dist.new_group(grid.pipeline_ranks(replica), backend=backend, timeout=timeout)
        if replica == grid.replica:
            pipeline = group
    for stage in range(grid.pp):
        group = dist.new_group(grid.dp_ranks(stage), backend=backend, timeout=timeout)
        if stage == grid.stage:
            data_parallel = group
    return ProcessGroups(pipeline=pipeline, data_parallel=data_parallel)


def local_rank() -> int:
    """This rank's index among the ranks of its host: LOCAL_RANK (torchrun, the DeepSpeed launcher, aqpipe)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size(world_size: int) -> int:
    """How many ranks run on this host: torchrun's LOCAL_WORLD_SIZE, the DeepSpeed launcher's LOCAL_SIZE, else
    (one host) the whole world."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return world_size


def host_leader() -> bool:
    """Whether this rank writes its host's copy of the run's shared files (config.json, checkpoint markers): the
    first rank on each host, so that hosts without a shared disk each keep their own."""
    return local_rank() == 0


def rank_device(kind: str, local_rank: int) -> torch.device:
    """The device a rank computes on: the host, or GPU (local rank mod the GPUs this host has), so that several
    ranks can share one GPU when there are more ranks than GPUs."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def collective_device(device: torch.device) -> torch.device:
    """Where a tensor handed to a collective must live: on `device` under NCCL (it refuses host tensors), on the host
    under gloo."""
    import torch.distributed as dist

    return device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")


def gather_rows(mine: torch.Tensor, grid: Grid, device: torch.device, traffic: str = comm.CONTROL
                ) -> torch.Tensor | None:
    """Every rank's 1-D `mine` stacked in rank order on rank 0 (on the host); None elsewhere."""
    where = collective_device(device)
    mine = mine.to(where)
    gathered = [torch.zeros_like(mine) for _ in range(grid.world_size)] if grid.rank == 0 else None
    comm.gather(mine, gathered, traffic, dst=0)
    return torch.stack(gathered).cpu() if gathered is not None else None
