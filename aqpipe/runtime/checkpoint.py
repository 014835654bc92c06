"""Resumable checkpoints: one file per rank per step, written atomically, checksummed, loaded weights-only.

Layout under the run directory:

    checkpoints/step-00000040/rank-0.pt       everything rank 0 needs to continue after step 40
    checkpoints/step-00000040/rank-0.sha256   the file's SHA-256, written after it
    checkpoints/step-00000040/COMPLETE        written by rank 0 once every rank has written (a barrier)
    checkpoints/latest                        the name of the newest complete step directory

A step directory without COMPLETE (a run killed while saving) is never resumed from. Loading checks the
SHA-256 and every key and shape before anything is applied, so a damaged file is an error naming it, never a
half-loaded model.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from pathlib import Path

import torch

FORMAT = 1
KEEP = 2  # complete checkpoints kept; older ones are removed once a newer one is complete


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, damaged, or does not belong to this run."""


def root(out: str | Path) -> Path:
    """The checkpoints directory of a run."""
    return Path(out) / "checkpoints"


def step_dir(out: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken after `step` optimizer steps."""
    return root(out) / f"step-{step:08d}"


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.pt"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_rank(out: str | Path, step: int, rank: int, state: dict) -> Path:
    """Write one rank's state for step `step` (the file, then its checksum); returns the file."""
    directory = step_dir(out, step)
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "step": step, "rank": rank, **state}, buf)
    data = buf.getvalue()
    path = rank_file(directory, rank)
    _write_atomic(path, data)
    _write_atomic(path.with_suffix(".sha256"), (_sha256(data) + "\n").encode())
    return path


def mark_complete(out: str | Path, step: int, world_size: int) -> None:
    """Rank 0, after every rank saved: mark the step complete, point `latest` at it, drop old checkpoints."""
    directory = step_dir(out, step)
    _write_atomic(directory / "COMPLETE", f"{world_size}\n".encode())
    _write_atomic(root(out) / "latest", (directory.name + "\n").encode())
    complete = sorted(d for d in root(out).glob("step-*") if (d / "COMPLETE").is_file())
    for old in complete[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def latest_step(out: str | Path) -> int | None:
    """The step of the newest complete checkpoint of a run, or None when it has none."""
    pointer = root(out) / "latest"
    candidates = []
    if pointer.is_file():
        candidates.append(root(out) / pointer.read_text().strip())
    candidates += sorted(root(out).glob("step-*"), reverse=True)
    for directory in candidates:
        if (directory / "COMPLETE").is_file() and directory.name.startswith("step-"):
            try:
                return int(directory.name[len("step-"):])
            except ValueError:
                continue
    return None


def verify(out: str | Path, step: int, world_size: int) -> None:
    """Check that every rank's file of a checkpoint is present and matches its checksum (before any worker
    starts); raises CheckpointError naming the first bad file."""
    directory = step_dir(out, step)
    marker = directory / "COMPLETE"
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete (no COMPLETE marker)")
    if marker.read_text().strip() != str(world_size):
        raise CheckpointError(f"checkpoint {directory} was written by {marker.read_text().strip()} ranks, "
                              f"this run has {world_size}")
    for rank in range(world_size):
        _read_checked(rank_file(directory, rank))


def _read_checked(path: Path) -> bytes:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    checksum = path.with_suffix(".sha256")
    if not checksum.is_file():
        raise CheckpointError(f"checkpoint file {path} has no checksum file {checksum.name} (interrupted write)")
    data = path.read_bytes()
    if _sha256(data) != checksum.read_text().strip():
        raise CheckpointError(f"checkpoint file {path} is damaged or truncated: its SHA-256 does not match {checksum.name}")
    return data


def load_rank(out: str | Path, step: int, rank: int) -> dict:
    """One rank's checkpointed state, checked and loaded with `weights_only=True`."""
    path = rank_file(step_dir(out, step), rank)
    data = _read_checked(path)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise CheckpointError(f"checkpoint file {path} cannot be loaded: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file {path} is not an aqpipe checkpoint of format {FORMAT}")
    if state.get("step") != step or state.get("rank") != rank:
        raise CheckpointError(f"checkpoint file {path} holds step {state.get('step')} rank {state.get('rank')}, "
                              f"expected step {step} rank {rank}")
    return state


def check_model_state(path_hint: str, module: torch.nn.Module, state: dict) -> None:
    """Every parameter and buffer of `module` present with its shape in `state`, and nothing else."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path_hint} does not fit this stage: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for key, value in own.items():
        if tuple(state[key].shape) != tuple(value.shape):
            raise CheckpointError(f"checkpoint {path_hint}: {key} has shape {tuple(state[key].shape)}, "
                                  f"the stage has {tuple(value.shape)}")
