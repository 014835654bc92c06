"""Resumable checkpoints: one file per rank per step, written atomically, checksummed, loaded weights-only.

Layout under the run directory (each host's own disk):

    checkpoints/step-00000040/rank-0.pt       everything rank 0 needs to continue after step 40 (its part)
    checkpoints/step-00000040/rank-0.sha256   "<SHA-256 of the file> rank=0 step=40 config=<digest>", written after it
    checkpoints/step-00000040/rank-0.store.pt rank 0's in-memory m(ξ) (`--store memory`), with its .sha256 line: kept
                                              on its host only (a part fetched from a copy goes without it)
    checkpoints/step-00000040/run.json        the settings a resume may not change, and their digest
    checkpoints/step-00000040/COMPLETE        written once every rank has written (a barrier), by the first rank of
                                              each host on that host's disk (hosts need not share one)
    checkpoints/latest                        the name of the newest complete step directory
    checkpoints/unsound-step-00000060/        a newer checkpoint that failed its checks, set aside by a --resume
                                              that took an older one (`set_aside_steps_after`)

A step directory without COMPLETE (a run killed while saving) is never resumed from, and is removed once a newer
checkpoint is complete. Before any worker starts, `verify` checks every rank's file against its checksum line
(the rank and step it was written for included: a file copied over another is caught) and the recorded settings
against the run's configuration (an edited config.json is named, field by field). Loading checks the SHA-256 and
every key and shape before anything is applied, so a damaged file is an error naming it, never a half-loaded model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, cast

import torch

from aqpipe.disk import save_atomic, write_atomic
from aqpipe.pipeline.vocab.link_rows import canonical, recorded

FORMAT = 2  # 2: checksum lines name rank, step and configuration digest; run.json records the settings
KEEP = 2  # complete checkpoints kept (besides the newest copied one and one being copied; see mark_complete)
# A rank's file goes to the disk in pieces of this size as it is written, so that the progress it reports follows the
# disk (not the page cache, with the whole state's fsync still to come) and the final fsync is short.
SYNC_EVERY_BYTES = 256 << 20
MAX_CHECKING_THREADS = 16  # rank files hashed at once before a resume
STORE = "store"  # the key of a rank's state that holds its in-memory m(ξ), and the kind of the file it is kept in
UNSOUND = "unsound-"  # the prefix of a step directory set aside after it failed its checks (never resumed from)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, damaged, or does not belong to this run."""


def root(out: str | Path) -> Path:
    """The checkpoints directory of a run."""
    return Path(out) / "checkpoints"


def step_dir(out: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken after `step` optimizer steps."""
    return root(out) / f"step-{step:08d}"


def step_dirs(out: str | Path) -> list[tuple[int, Path]]:
    """Every step directory of a run (complete or not), with its step, oldest first."""
    found = [(d.name[len("step-"):], d) for d in root(out).glob("step-*")]
    return sorted((int(digits), d) for digits, d in found if digits.isdigit())


def rank_file(directory: Path, rank: int, kind: str = "") -> Path:
    """A rank's file of a step directory: its part (what is copied to other hosts), or of `kind` "store", its
    in-memory m(ξ) store (kept on its own host only: what cannot be had from it is re-seeded)."""
    return directory / (f"rank-{rank}.{kind}.pt" if kind else f"rank-{rank}.pt")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def settings_digest(settings: dict) -> str:
    """A short digest of the settings a resume may not change (canonical JSON)."""
    return _sha256(json.dumps(canonical(settings), sort_keys=True).encode())[:16]


def save_rank(out: str | Path, step: int, rank: int, state: dict, settings: dict,
              progress: Callable[[int, int], None] | None = None, kind: str = "") -> Path:
    """Write one rank's state for step `step` (the file, then its checksum line naming rank, step and the digest
    of `settings`); returns the file. The state goes to disk as it is serialized, never whole in memory a second
    time (an in-memory m(xi) store may be most of the host's memory). `progress(done, total)` hears of the bytes on
    disk as they get there (`total` an estimate until the last call, where it is the file's size). `kind`: which of
    the rank's files (`rank_file`)."""
    directory = step_dir(out, step)
    directory.mkdir(parents=True, exist_ok=True)
    digest = settings_digest(settings)
    path = rank_file(directory, rank, kind)
    sha = hashlib.sha256()
    estimate = max(_tensor_bytes(state), 1)
    report = (lambda done: progress(min(done, estimate - 1), estimate)) if progress else None
    writer: list[_DiskWriter] = []

    def write(file: BinaryIO) -> None:
        writer.append(_DiskWriter(file, sha, report))
        try:
            torch.save({"format": FORMAT, "step": step, "rank": rank, "config_digest": digest, **state},
                       cast(BinaryIO, writer[0]))
        finally:
            writer[0].finish()

    save_atomic(path, write, estimate, durable=True)
    write_atomic(path.with_suffix(".sha256"), f"{sha.hexdigest()} rank={rank} step={step} config={digest}\n".encode(),
                 durable=True)
    if progress:
        progress(writer[0].written, writer[0].written)
    return path


def _tensor_bytes(tree: object) -> int:
    """The bytes of the storages of the tensors in a nested dict/list/tuple, each storage once (as torch.save
    writes them): most of what serializing it writes."""
    from torch.utils._pytree import tree_leaves

    storages = {}
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            storages[(leaf.device, storage.data_ptr() or id(storage))] = storage.nbytes()
    return sum(storages.values())


class _DiskWriter:
    """A file's writer (torch.save needs only `write`) that adds what goes through it to `sha` and puts it on the
    disk every SYNC_EVERY_BYTES while serializing goes on (one piece in flight: its fdatasync runs on a thread of its
    own), telling `report` the bytes on the disk as each piece gets there. `finish` waits for the last piece."""

    def __init__(self, file: BinaryIO, sha: hashlib._Hash, report: Callable[[int], None] | None) -> None:
        self.file, self.sha, self.report = file, sha, report
        self.written = self.requested = 0
        self._syncing: Future[int] | None = None
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="aqpipe-checkpoint-sync")

    def write(self, data: bytes | memoryview) -> int:
        # torch.save hands a tensor's storage over in one call: a large one (a flat error-feedback residual, an
        # embedding's Adam moments) goes in pieces too, each synced and reported
        view = memoryview(data).cast("B")
        for start in range(0, len(view), SYNC_EVERY_BYTES):
            self._write_piece(view[start:start + SYNC_EVERY_BYTES])
        return len(view)

    def _write_piece(self, piece: memoryview) -> None:
        self.sha.update(piece)
        self.file.write(piece)
        self.written += len(piece)
        if self.written - self.requested >= SYNC_EVERY_BYTES:
            self._wait()  # (a disk slower than serializing holds the writer back here, not in the page cache)
            self.file.flush()
            self.requested = self.written
            self._syncing = self._syncer.submit(self._sync, self.written)

    def flush(self) -> None:
        self.file.flush()

    def finish(self) -> None:
        """Wait for the piece in flight (raising its error, a full disk's included) and let the thread go."""
        try:
            self._wait()
        finally:
            self._syncer.shutdown()

    def _sync(self, upto: int) -> int:
        getattr(os, "fdatasync", os.fsync)(self.file.fileno())  # (macOS has no fdatasync)
        return upto

    def _wait(self) -> None:
        if self._syncing is not None:
            on_disk, self._syncing = self._syncing.result(), None
            if self.report is not None:
                self.report(on_disk)


def mark_complete(out: str | Path, step: int, world_size: int, settings: dict, keep: set[int] | None = None) -> None:
    """The first rank of each host, after every rank saved: record the settings, mark the step complete, point `latest`
    at it, drop old checkpoints (but those of the steps in `keep`: their parts are being copied) and incomplete ones
    (no other checkpoint can be in writing now: every rank passed the barrier)."""
    directory = step_dir(out, step)
    record = {"step": step, "world_size": world_size, "config": settings, "config_digest": settings_digest(settings)}
    write_atomic(directory / "run.json", (json.dumps(record, indent=2, sort_keys=True) + "\n").encode(), durable=True)
    write_atomic(directory / "COMPLETE", f"{world_size}\n".encode(), durable=True)
    write_atomic(root(out) / "latest", (directory.name + "\n").encode(), durable=True)
    complete = [d for d in sorted(root(out).glob("step-*")) if (d / "COMPLETE").is_file()]
    # where copies are kept, the newest step whose copies all arrived stays too: until a newer one's have, it is the
    # one a host that loses its disk can come back from
    replicated = [d for d in complete if (d / "REPLICATED").is_file()]
    kept = set(complete[-KEEP:]) | set(replicated[-1:]) | {step_dir(out, s) for s in keep or ()}
    for old in complete:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)
    remove_incomplete(out)


def drop_steps_after(out: str | Path, step: int) -> list[Path]:
    """Delete the step directories after `step` (a resume from `step` trains those steps again: their old files
    must not mix with the new ones under their old markers); returns them."""
    removed = _steps_after(out, step)
    for directory in removed:
        shutil.rmtree(directory, ignore_errors=True)
    _point_latest(out, step)
    return removed


def set_aside_steps_after(out: str | Path, step: int) -> list[Path]:
    """Move the step directories after `step` to `unsound-step-<N>` beside them (a resume from `step` trains those
    steps again; a checkpoint that failed its checks is kept for a look, never resumed from: an unreadable file may
    be a passing fault), replacing one set aside before; returns where they went."""
    moved = []
    for directory in _steps_after(out, step):
        aside = directory.with_name(f"{UNSOUND}{directory.name}")
        try:
            directory.rename(aside)
        except FileNotFoundError:  # moved by another host's first rank sharing this disk
            pass
        except OSError:  # one set aside before, under the same name
            shutil.rmtree(aside, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                directory.rename(aside)
        moved.append(aside)
    _point_latest(out, step)
    return moved


def _steps_after(out: str | Path, step: int) -> list[Path]:
    return [d for s, d in step_dirs(out) if s > step]


def _point_latest(out: str | Path, step: int) -> None:
    """`latest` names `step`'s directory where it named one that is gone."""
    latest = root(out) / "latest"
    with contextlib.suppress(FileNotFoundError):  # (hosts sharing a disk: another one's first rank may be at it too)
        if not (root(out) / latest.read_text().strip()).is_dir():
            write_atomic(latest, (step_dir(out, step).name + "\n").encode(), durable=True, shared=True)


def remove_incomplete(out: str | Path) -> list[Path]:
    """Delete the step directories without COMPLETE (a run stopped while writing them; never resumed from); returns
    them. Only while no run writes checkpoints here (the launcher holds the run directory's lock)."""
    removed = [d for d in sorted(root(out).glob("step-*")) if d.is_dir() and not (d / "COMPLETE").is_file()]
    for directory in removed:
        shutil.rmtree(directory, ignore_errors=True)
    return removed


def latest_step(out: str | Path) -> int | None:
    """The step of the newest complete checkpoint of a run, or None when it has none (by the step directories'
    markers: `latest` is written after COMPLETE, and a run stopped between the two has a newer one than it says)."""
    return max(complete_steps(out), default=None)


def complete_steps(out: str | Path) -> list[int]:
    """The steps of every complete checkpoint of a run, newest first."""
    return [step for step, directory in reversed(step_dirs(out)) if (directory / "COMPLETE").is_file()]


def check_rank(out: str | Path, step: int, rank: int, settings: dict) -> None:
    """Check this rank's file of a checkpoint against its checksum line, written for that rank and step by a run with
    these `settings` (reading the file once, a piece at a time); a CheckpointError naming what is wrong."""
    _read_checked(rank_file(step_dir(out, step), rank), rank, step, settings_digest(settings))


def verify(out: str | Path, step: int, world_size: int, settings: dict) -> None:
    """Check, before any worker starts, that a checkpoint belongs to this run: complete, written by `world_size`
    ranks with these `settings` (the ones a resume may not change), and every rank's file present, undamaged and
    written for that rank and step. Raises CheckpointError naming the first problem (a changed setting by name)."""
    directory = step_dir(out, step)
    marker = directory / "COMPLETE"
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete (no COMPLETE marker)")
    if marker.read_text().strip() != str(world_size):
        raise CheckpointError(f"checkpoint {directory} was written by {marker.read_text().strip()} ranks, "
                              f"this run has {world_size}")
    record = _read_record(directory)
    changed = changed_setting(out, step, settings, record)
    if changed:
        raise CheckpointError(changed)
    # one thread a file: hashing and reading let the others run, so checking gigabytes per rank takes about as long
    # as the largest file (or the disk), not their sum; the lowest rank's problem is the one named
    with ThreadPoolExecutor(min(world_size, MAX_CHECKING_THREADS), thread_name_prefix="aqpipe-checkpoint-check") as pool:
        checks = [pool.submit(_read_checked, rank_file(directory, rank), rank, step, record["config_digest"])
                  for rank in range(world_size)]
        for check in checks:
            check.result()


def changed_setting(out: str | Path, step: int, settings: dict, record: dict | None = None) -> str | None:
    """What says that `settings` differ from those the checkpoint of `step` was written with (the first that does,
    by name), or None; a CheckpointError if its record cannot be read."""
    directory = step_dir(out, step)
    saved, settings = recorded((record or _read_record(directory))["config"]), recorded(settings)
    for key in sorted(set(saved) | set(settings)):
        if saved.get(key) != settings.get(key):
            return (f"checkpoint {directory} was written with {key} = {saved.get(key)!r}, but the run's configuration "
                    f"now says {settings.get(key)!r} (was {Path(out) / 'config.json'} edited?); a resume continues "
                    "the run as it was configured")
    return None


def _read_record(directory: Path) -> dict:
    path = directory / "run.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} has no {path.name}: it was written by an older aqpipe "
                              f"(checkpoint format 1) and cannot be checked against this run") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint record {path} is damaged: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict) \
            or record.get("config_digest") != settings_digest(record["config"]):
        raise CheckpointError(f"checkpoint record {path} is damaged or was edited (its digest does not match)")
    return record


def _read_checked(path: Path, rank: int, step: int, digest: str | None = None) -> None:
    """Check a rank's file against its checksum line (and the rank, step and settings digest the line names), reading
    it a piece at a time."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    checksum = path.with_suffix(".sha256")
    if not checksum.is_file():
        raise CheckpointError(f"checkpoint file {path} has no checksum file {checksum.name} (interrupted write)")
    try:
        fields = checksum.read_text().split()
        with open(path, "rb") as f:
            sha = _sha256_of(f)
    except (OSError, ValueError) as e:  # (a checksum line that is not text: UnicodeDecodeError)
        raise CheckpointError(f"checkpoint file {path} or its {checksum.name} cannot be read: {e}") from None
    if not fields or sha != fields[0]:
        raise CheckpointError(f"checkpoint file {path} is damaged or truncated: its SHA-256 does not match {checksum.name}")
    tags = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
    if tags.get("rank") != str(rank) or tags.get("step") != str(step):
        raise CheckpointError(f"checkpoint file {path} was written for rank {tags.get('rank', '?')} step "
                              f"{tags.get('step', '?')}, not rank {rank} step {step} (copied over from another?)")
    if digest is not None and tags.get("config") != digest:
        raise CheckpointError(f"checkpoint file {path} was written by a run with other settings than its "
                              "checkpoint's run.json records")


def _sha256_of(file: BinaryIO) -> str:
    """SHA-256 of a file, read in 1 MiB pieces."""
    sha = hashlib.sha256()
    for piece in iter(lambda: file.read(1 << 20), b""):
        sha.update(piece)
    return sha.hexdigest()


def load_rank(out: str | Path, step: int, rank: int, settings: dict | None = None, checked: bool = False,
              kind: str = "") -> dict:
    """One rank's checkpointed state, checked (against `settings` too, when given; not again when it was just
    `checked`: by `check_rank` in this process, or by `verify` in the launcher that started it, holding the run
    directory since) and loaded with `weights_only=True`, each tensor read from the file into its own memory (the file
    is not read whole first). `kind`: which of the rank's files (`rank_file`)."""
    path = rank_file(step_dir(out, step), rank, kind)
    if not checked:
        _read_checked(path, rank, step, settings_digest(settings) if settings is not None else None)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise CheckpointError(f"checkpoint file {path} cannot be loaded: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file {path} is not an aqpipe checkpoint of format {FORMAT}")
    if state.get("step") != step or state.get("rank") != rank:
        raise CheckpointError(f"checkpoint file {path} holds step {state.get('step')} rank {state.get('rank')}, "
                              f"expected step {step} rank {rank}")
    return state


def check_model_state(path_hint: str, module: torch.nn.Module, state: dict, names: set[str] | None = None) -> None:
    """Every parameter and buffer of `module` (or those `names` of them: what trains under LoRA) present with its shape
    in `state`, and nothing else."""
    own = {k: v for k, v in module.state_dict().items() if names is None or k in names}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path_hint} does not fit this stage: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    for key, value in own.items():
        if tuple(state[key].shape) != tuple(value.shape):
            raise CheckpointError(f"checkpoint {path_hint}: {key} has shape {tuple(state[key].shape)}, "
                                  f"the stage has {tuple(value.shape)}")
