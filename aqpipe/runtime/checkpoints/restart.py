"""Where a start over a run directory begins: a restart (torchrun's elastic agent, `--max-restarts`, or the same
command typed again) continues this run from its newest checkpoint complete everywhere, and a start never trains
over another run's state or over a checkpoint newer than the one it would start from.

Each rank reads what its own host's run directory holds (`holding`: no collective, no torch); `choose_start` decides
from every rank's holding alike, on every rank or in a local launch's launcher. A checkpoint can be continued from
when every rank's part of it is on its host or kept as a copy on another (`copies`) and some host marked
it complete: a host marks a step only after the barrier that every rank passes once its file is written, so a mark
anywhere proves every file was written, even where a host died before marking it too. Where copies are kept, a step
counts as complete (one a start may not pass over) once they all are (REPLICATED).
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from aqpipe.pipeline.vocab.link_rows import recorded
from aqpipe.runtime.checkpoints.parts import CheckpointError, step_dir, step_dirs

# Each time a run started again over its own state (a restart by torchrun or `--max-restarts`, or the same command
# typed again), a line in this file of rank 0's run directory: summary.json counts them.
RESTARTS_FILE = "restarts.jsonl"

# What a run writes into its directory on a host that a restart must respect; any of them present means the directory
# holds a run's state (`aqpipe.launch.rundir.RUN_OUTPUTS` adds what a local launch's launcher writes: the plot, logs).
RUN_STATE = ("config.json", "metrics.jsonl", "summary.json", "checkpoints", "store", "export", "export-adapter")
# Written only after the run's config.json on the same host (a rank's checkpoints and m(ξ) store may come before it):
# found without it, they are no run's to continue.
AFTER_CONFIG = tuple(name for name in RUN_STATE if name not in ("config.json", "checkpoints", "store"))


@dataclass
class Holding:
    """What one rank's run directory holds on its host."""

    rank: int
    host: str
    outputs: list[str] = field(default_factory=list)  # the names of RUN_STATE present
    files: list[int] = field(default_factory=list)  # steps whose file for this rank (with its checksum line) is here
    marked: list[int] = field(default_factory=list)  # steps this host marked complete
    copying: list[int] = field(default_factory=list)  # steps marked COPYING here (copies kept: copied or not)
    replicated: list[int] = field(default_factory=list)  # steps this host marked REPLICATED (every part copied)
    parts: dict[str, list[int]] = field(default_factory=dict)  # step -> the ranks whose part (or copy) is here
    other_run: str | None = None  # why the state here is another run's (a setting that differs); None: this run's

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @staticmethod
    def from_json(value: dict) -> Holding:
        return Holding(**value)


def holding(out: str | Path, rank: int, settings: dict) -> Holding:
    """What `out` holds for `rank` on this host, and whether it is the state of a run with these fixed `settings`
    (compared with the newest checkpoint this host marked complete, else with its config.json)."""
    out = Path(out)
    found = Holding(rank, socket.gethostname(), [name for name in RUN_STATE if (out / name).exists()])
    for step, directory in step_dirs(out):
        if (directory / "COMPLETE").is_file():
            found.marked.append(step)
        if (directory / "COPYING").is_file():
            found.copying.append(step)
        if (directory / "REPLICATED").is_file():
            found.replicated.append(step)
        here = sorted(int(p.stem[len("rank-"):]) for p in directory.glob("rank-*.pt")
                      if p.stem[len("rank-"):].isdigit() and p.with_suffix(".sha256").is_file())
        if here:
            found.parts[str(step)] = here
        if rank in here:
            found.files.append(step)
    found.files.sort(reverse=True)
    found.marked.sort(reverse=True)
    if found.marked:
        found.other_run = _differs(step_dir(out, found.marked[0]) / "run.json", settings, "config")
    elif "config.json" in found.outputs:
        found.other_run = _differs(out / "config.json", settings)
    elif any(name in AFTER_CONFIG for name in found.outputs):
        found.other_run = f"{', '.join(found.outputs)}, without a config.json"
    return found


def _differs(path: Path, settings: dict, key: str | None = None) -> str | None:
    """What says that the run recorded in `path` (a config.json; a checkpoint's run.json, its settings under `key`)
    has other fixed settings than `settings`, or None. The stage boundaries count only where `settings` holds them:
    a local launch compares before it plans, and its resume checks the checkpoint's record again after."""
    try:
        saved = json.loads(path.read_text())
        saved = saved[key] if key else saved
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path} cannot be read as an aqpipe record: {type(e).__name__}: {e}"
    if not isinstance(saved, dict):
        return f"{path} is not an aqpipe record"
    saved = recorded(saved)
    for name in sorted(settings):
        if settings[name] is None and (name == "stage_bounds" or name not in saved):
            continue
        if saved.get(name) != settings[name]:
            return f"{path} records {name} = {saved.get(name)!r}, this run has {settings[name]!r}"
    return None


@dataclass
class Start:
    """Where a start over a run directory begins."""

    candidates: list[int]  # checkpoints complete everywhere, newest first (none: the run starts from its first step)
    strict: bool = True  # only the newest may be taken; else the newest sound on every rank
    clear: bool = False  # this run's state without a complete checkpoint is there: removed, the run starts afresh
    note: str | None = None  # what to tell the user

    @property
    def fresh(self) -> bool:
        return not self.candidates

    def damaged(self, step: int, problem: str, out: str | Path) -> CheckpointError:
        """The refusal of a strict start over run directory `out` whose checkpoint of `step` is not sound (`problem`
        says where)."""
        return damaged(step, problem, out, next((s for s in self.candidates if s < step), None))


def going_back(step: int, newest: int, why: str) -> str:
    """The note of a resume that takes the checkpoint of `step` because the newer one of `newest` is not usable
    (`why`)."""
    return (f"resuming after step {step}: the checkpoint of step {newest} {why}; steps {step + 1}–{newest} are "
            "trained again")


def damaged(step: int, problem: str, out: str | Path, older: int | None) -> CheckpointError:
    """The refusal of a start over run directory `out` whose checkpoint of `step` is not sound (`problem` says where),
    naming the `older` one `--resume` would take (None: none)."""
    return CheckpointError(f"the checkpoint of step {step} is damaged ({problem})"
                           + (f"; continue from step {older} with --resume {out}" if older is not None else ""))


def choose_start(holdings: list[Holding], out: str | Path, explicit: bool, local: bool = True) -> Start:
    """Where every rank starts, from each rank's `holding` of run directory `out`. `explicit`: `--resume` was given,
    and an older checkpoint may be taken where the newest is not sound everywhere (with a note); otherwise only the
    newest checkpoint ever complete everywhere is (a restart never quietly throws work away). `local`: a local
    launch's launcher decides (else the ranks, under torchrun: no --overwrite there). Raises CheckpointError (exit 2,
    one line) for another run's state, or a newest checkpoint some rank no longer holds."""
    other = next((h for h in holdings if h.other_run), None)
    if other is not None:
        where = f" on {other.host}" if len({h.host for h in holdings}) > 1 else ""
        resume = f"continue that run with --resume {out}, " if "config.json" in other.outputs else ""
        delete = "add --overwrite to delete it first" if local else "delete it on every host first"
        raise CheckpointError(f"--out {out}{where} holds another run ({other.other_run}): {resume}choose another --out, "
                              f"or {delete}")
    if not any(h.outputs for h in holdings):
        if explicit:
            raise CheckpointError(f"--resume {out}: no run there to continue")
        return Start([])
    marked = set().union(*(h.marked for h in holdings))
    candidates = sorted((s for s in marked if all(holders(holdings, s, h.rank) for h in holdings)), reverse=True)
    # a step is complete once every rank wrote its part and, where copies are kept, every part has its copies (some
    # host marked it replicated)
    copying = set().union(*(h.copying for h in holdings))
    replicated = set().union(*(h.replicated for h in holdings))
    newest = max((s for s in marked if s not in copying or s in replicated), default=None)
    if newest is None and marked:  # written, but its copies never finished: complete if every part is still here
        newest = candidates[0] if candidates else max(marked)
    if newest is None:
        if explicit:
            raise CheckpointError(f"--resume {out}: no complete checkpoint (the run stopped before its first "
                                  "--checkpoint-every)")
        return Start([], clear=True, note=f"{out} holds this run with no complete checkpoint yet: it starts again "
                                          "from the first step")
    if not candidates or candidates[0] < newest:
        lacking = [h for h in holdings if not holders(holdings, newest, h.rank)]
        if not explicit or not candidates:
            raise CheckpointError(
                f"the checkpoint of step {newest} is complete, but {_who(lacking)} no longer "
                f"hold{'s' if len(lacking) == 1 else ''} {'its' if len(lacking) == 1 else 'their'} part of it "
                f"and no host keeps a copy (a lost disk?); put the files back under {step_dir(out, newest)}"
                + (f", or continue from step {candidates[0]} with --resume {out}" if candidates else
                   ", or start again with --overwrite" if local else ", or delete it on every host to start again"))
        return Start(candidates, strict=False, note=f"resuming after step {candidates[0]}: the checkpoint of step "
                                                    f"{newest} is not held by {_who(lacking)}")
    if explicit:
        return Start(candidates, strict=False)
    note = f"{out} holds this run: it continues after step {candidates[0]}"
    newer = max(marked)
    if newer > candidates[0]:  # checkpoints kept without copies (their predecessor's were travelling), since lost
        lacking = [h for h in holdings if not holders(holdings, newer, h.rank)]
        note += (f", the newest checkpoint whose parts are all held; the checkpoint of step {newer} had no copies "
                 f"on other hosts and {_who(lacking)} no longer hold{'s' if len(lacking) == 1 else ''} "
                 f"{'its part' if len(lacking) == 1 else 'their parts'}: steps {candidates[0] + 1}–{newer} are trained "
                 "again")
    return Start(candidates, note=note)


def holders(holdings: list[Holding], step: int, rank: int) -> list[int]:
    """The ranks whose host keeps rank `rank`'s part of `step` (its own first, where its host still has it)."""
    found = [h.rank for h in holdings if rank in h.parts.get(str(step), [])]
    return sorted(found, key=lambda r: r != rank)


def _who(holdings: list[Holding]) -> str:
    return ", ".join(f"rank {h.rank} on {h.host}" for h in holdings)


def record_restart(out: str | Path, step: int | None) -> None:
    """Note in rank 0's run directory that the run started again over its own state, from the checkpoint of `step`
    (None: from the first step, no checkpoint having been complete)."""
    line = json.dumps({"time": time.time(), "from_step": step or 0}) + "\n"
    with open(Path(out) / RESTARTS_FILE, "a") as f:
        f.write(line)


def restarts(out: str | Path) -> int:
    """How many times the run in `out` started again over its own state."""
    try:
        return sum(1 for line in (Path(out) / RESTARTS_FILE).read_text().splitlines() if line.strip())
    except OSError:
        return 0


def clear_run_state(out: str | Path) -> list[str]:
    """Remove this run's state from `out` on this host (one rank per host, before any rank opens its store), for a
    start afresh over a run that completed no checkpoint; returns the names removed."""
    removed = [name for name in RUN_STATE if (Path(out) / name).exists()]
    # config.json last: a clear cut short leaves it beside whatever state remains (AFTER_CONFIG)
    for name in sorted(removed, key=lambda name: name == "config.json"):
        path = Path(out) / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return removed
