"""The replicas-stay-identical invariant, checked: the replicas of a stage compare a digest of their parameters at
every checkpoint and at the end of a run, and a mismatch ends the run naming the stage, the step and the replicas."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import Grid, collective_device


class ReplicaDivergence(RuntimeError):
    """The data-parallel replicas of a stage hold different parameters."""


def parameter_digest(module: nn.Module, skip: frozenset[str] = frozenset()) -> int:
    """A 63-bit digest (SHA-256) of every parameter and buffer of `module` but those named in `skip`, by name and
    raw bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if name in skip:
            continue
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def check_replicas(module: nn.Module, grid: Grid, step: int, device: torch.device,
                   skip: frozenset[str] = frozenset()) -> None:
    """Every rank of the run must call this together; raises ReplicaDivergence on every one of them if any replica of
    any stage holds parameters that differ from its stage's replica 0 (`skip`: names left out, such as a tied table's
    row cache, whose unused rows differ by design). Every rank learns the verdict — one all-gather of a digest per
    rank over the world — so none goes on into a collective that the stopped ranks would never join."""
    if grid.dp == 1:
        return

    where = collective_device(device)
    mine = torch.tensor([parameter_digest(module, skip)], dtype=torch.int64, device=where)
    everyone = [torch.zeros_like(mine) for _ in range(grid.world_size)]
    comm.all_gather(everyone, mine, comm.CONTROL)
    digests = torch.cat(everyone).tolist()  # (one copy to the host, not one per rank)
    found = []
    for stage in range(grid.pp):
        ranks = grid.dp_ranks(stage)
        differ = [replica for replica, rank in enumerate(ranks) if digests[rank] != digests[ranks[0]]]
        if differ:
            found.append(f"the data-parallel replicas of stage {stage} hold different parameters after step {step}: "
                         f"replica(s) {', '.join(map(str, differ))} differ from replica 0")
    if found:
        raise ReplicaDivergence("; ".join(found))
