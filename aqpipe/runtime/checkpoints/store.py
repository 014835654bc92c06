"""A rank's checkpoints as one store with local and remote copies: each checkpoint's part written on this rank's host,
marked complete once every rank has written, and copied to other hosts in the background; after a resume, the copies
a host lost sent again; and rank 0's run log kept inside its part, so that it travels with the copies.

The step loop asks it for one thing per checkpoint (`save`), tells it each step's link measurements (`observe`) and
waits for it at the end (`finish`); where to start is `aqpipe.runtime.checkpoints.resume.starting_point`.

A checkpoint whose predecessor's copies are still on their way is written and marked complete on every host, but not
copied (every rank decides alike): training never waits for a copy, and the newest checkpoint whose copies all
arrived stays on disk until a newer one's have. Such a checkpoint is marked COPYING without ever being REPLICATED,
so a restart continues from it while every host still holds its part, and from the newest copied one otherwise.
The run's last checkpoint is copied all the same (the run waits for the copies in flight first). Copies that
training waits for go unpaced: nothing else shares the link then.

Copies hold what cannot be had again: trained parameters (under LoRA the adapters), optimizer, grad-sync and codec
state, data position and RNG, and rank 0's run log. Frozen base weights come from the model source, and an in-memory
m(ξ) store is written in a file of its own that is never copied: a rank whose part came from a copy starts with an
empty store, and the reconciliation after the resume re-seeds those samples on both sides of its links by first
sights. Measured on the SmolLM2 benchmark's links: a first sight (the default rtqo:3) costs about the bytes of the
delta it replaces (3.3 bits a value either way), so re-seeding costs little beyond the epoch's messages, where fetching
a neighbour's copy of a link's m(ξ) would send 140 MB (about four epochs of that link's messages) before training
could go on, and copying it with every part would send it at every checkpoint.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from aqpipe.config import ConfigError, ResolvedConfig
from aqpipe.disk import write_atomic
from aqpipe.pipeline.links.rendezvous import barrier_after_slow_work, startup_timeout
from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import Grid, host_leader
from aqpipe.runtime.checkpoints.copier import CheckpointCopier
from aqpipe.runtime.checkpoints.copies import COPYING, REPLICATED, default_copies
from aqpipe.runtime.checkpoints.parts import STORE, mark_complete, save_rank, step_dir
from aqpipe.runtime.checkpoints.preforked import release_preforked
from aqpipe.runtime.checkpoints.restart import RESTARTS_FILE
from aqpipe.runtime.events import progress

RUN_LOG = "run_log"  # the key of rank 0's state that holds the run's log (metrics.jsonl, restarts.jsonl)


class Checkpoints:
    """One rank's checkpoints (every rank makes one, together: the ranks' host names decide where copies go)."""

    def __init__(self, cfg: ResolvedConfig, grid: Grid) -> None:
        self.out, self.rank, self.world = cfg.out, grid.rank, grid.world_size
        self.settings, self.stall_timeout = cfg.fixed_settings(), cfg.stall_timeout
        hosts: list = [None] * grid.world_size
        comm.all_gather_object(hosts, socket.gethostname(), comm.SETUP)
        copies = default_copies(hosts, cfg.checkpoint_replicas)
        self.copier: CheckpointCopier | None = None
        try:  # (every rank sees the same hosts: all refuse alike, before any makes the copies' group)
            if copies:
                self.copier = CheckpointCopier(cfg.out, grid, hosts, copies, startup_timeout(cfg.stall_timeout),
                                               cfg.checkpoint_share)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        finally:
            if self.copier is None:
                release_preforked()  # (one forked for copies this run does not keep)

    def observe(self, stats) -> None:
        """Take a step's link measurements (`StepStats`): they set the pace of the copies."""
        if self.copier is not None:
            self.copier.observe(stats)

    def save(self, step: int, state: Callable[[], dict], last: bool = False) -> None:
        """Write this rank's `state()` as its part of the checkpoint after `step` steps; every rank calls it. Once every
        rank has written (a barrier that waits as long as the slowest disk), the first rank of each host marks the step
        complete on its disk, and the parts start on their way to their copies' hosts — unless the previous
        checkpoint's are still travelling somewhere (then this one stays uncopied), or `last` (then they are waited
        for)."""
        copying = self._copies_now(last)
        if copying and self.copier is not None:
            self.copier.wait()  # (nothing in flight, or the run's last checkpoint: it waits)
        part = state()
        # an in-memory m(ξ) goes in a file of its own, which stays on this host: what a copy lacks is re-seeded
        if STORE in part:
            save_rank(self.out, step, self.rank, {STORE: part.pop(STORE)}, self.settings, self._told, kind=STORE)
        save_rank(self.out, step, self.rank, part, self.settings, self._told)
        barrier_after_slow_work(self.stall_timeout)
        leader = host_leader()
        if leader and self.copier is not None:
            # before COMPLETE: a step marked complete is never mistaken for one kept without copies (a run killed
            # between the two marks); copied or not, it counts as copied only once REPLICATED
            write_atomic(step_dir(self.out, step) / COPYING, b"", durable=True)
        if leader:
            mark_complete(self.out, step, self.world, self.settings, keep=self._in_flight())
        if self.copier is not None and copying:
            self.copier.start(step, leader)

    def resumed(self, step: int) -> None:
        """After a resume from `step`: its copies sent again unless every host kept them (a host whose disk was wiped
        lost the copies it held for others; a restart may come before its copies arrived). Every rank together."""
        if self.copier is None:
            return
        here = (step_dir(self.out, step) / REPLICATED).is_file()
        everyone: list = [None] * dist.get_world_size()
        comm.all_gather_object(everyone, here, comm.SETUP)
        if not all(everyone):
            self.copier.start(step, host_leader())

    def finish(self) -> None:
        """Until the copies in flight are kept (the run may end); the copies' process ends."""
        if self.copier is not None:
            self.copier.wait()
            self.copier.close()

    def _told(self, done: int, total: int) -> None:
        """The bytes of a part on disk, told to the launcher (a large state on a slow disk may take longer than
        --stall-timeout)."""
        progress(f"checkpoint of rank {self.rank}", done, total, "bytes")

    def _copies_now(self, last: bool) -> bool:
        """Whether this checkpoint's parts are copied: no rank's copies are in flight, or it is the run's last (every
        rank decides alike)."""
        if self.copier is None or last:
            return True
        everyone: list = [None] * self.world
        comm.all_gather_object(everyone, self.copier.busy, comm.SETUP)
        return not any(everyone)

    def _in_flight(self) -> set[int]:
        """The step whose parts are being copied (its directory stays until they are kept)."""
        step = self.copier.step if self.copier is not None and self.copier.busy else None
        return {step} if step is not None else set()


def run_log(out: str | Path, records: list[dict]) -> dict:
    """Rank 0's run log for its checkpoint part: the metrics records so far and restarts.jsonl (a host that loses its
    disk gets them back from the copy)."""
    restarts = Path(out) / RESTARTS_FILE
    return {"metrics": "".join(json.dumps(r, sort_keys=True) + "\n" for r in records),
            "restarts": restarts.read_text() if restarts.is_file() else ""}


def restored_records(out: str | Path, saved: dict | None, step: int, kept: list[dict]) -> list[dict]:
    """The metrics records a run resumed after `step` keeps: those this host holds (`kept`) where they reach the
    step, else those rank 0's part saved (its host lost them); restarts.jsonl made whole from the saved lines too."""
    if saved is None:
        return kept
    restarts = Path(out) / RESTARTS_FILE
    here = restarts.read_text().splitlines(keepends=True) if restarts.is_file() else []
    before = saved.get("restarts", "").splitlines(keepends=True)
    if before and here[:len(before)] != before:
        write_atomic(restarts, "".join(before + [line for line in here if line not in before]).encode())
    if kept and kept[-1]["step"] == step and len(kept) == step:
        return kept
    return [json.loads(line) for line in saved.get("metrics", "").splitlines() if line.strip()]
