"""Make both copies of m(ξ) agree after a restart: compare per-sample checksums across each link, re-seed the rest.

An on-disk store survives a crash, but the two sides of a link may have stopped at different points (the sender
updated m(ξ) for a message the receiver never got), and the run resumes from an earlier checkpoint anyway. Each
rank checksums every m(ξ) it holds; the ranks of one pipeline exchange the tables; any sample whose sender and
receiver checksums differ, or that only one side holds, is deleted on both sides, so its next sight goes at full
precision and seeds both copies again.
"""

from __future__ import annotations

import zlib

import torch

from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import Grid
from aqpipe.storage.base import stage_holding


def checksum(value: torch.Tensor) -> int:
    """CRC32 of a stored m(ξ)'s bytes."""
    return zlib.crc32(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()) & 0xFFFFFFFF


def store_table(store, grid: Grid) -> dict[tuple[int, str], dict[int, int]]:
    """{(link, side): {sample id: checksum}} of the m(ξ) this rank holds for its own links."""
    table: dict[tuple[int, str], dict[int, int]] = {owned: {} for owned in grid.owned_sides()}
    for (link, side, sample), value in store.items():
        if (link, side) in table:
            table[(link, side)][sample] = checksum(value)
    return table


def disagreeing(mine: dict[int, int], theirs: dict[int, int]) -> list[int]:
    """Sample ids whose checksums differ between two copies, or that only one copy holds."""
    return sorted(i for i in set(mine) | set(theirs) if mine.get(i) != theirs.get(i))


def reconcile(store, grid: Grid, pipeline_group) -> int:
    """Exchange checksum tables along this rank's pipeline and delete every disagreeing m(ξ) on this rank's
    sides (its peers delete theirs); returns how many entries this rank deleted. All ranks must call it."""
    table = store_table(store, grid)
    everyone: list = [None] * grid.pp
    comm.all_gather_object(everyone, table, comm.SETUP, group=pipeline_group)
    deleted = 0
    for (link, side), entries in table.items():
        peer_side = "recv" if side == "send" else "send"
        theirs = everyone[stage_holding(link, peer_side)].get((link, peer_side), {})
        bad = disagreeing(entries, theirs)
        if bad:
            store.delete(link, side, bad)
            deleted += sum(1 for i in bad if i in entries)
    return deleted
