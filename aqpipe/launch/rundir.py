"""A run directory belongs to one run: an OS lock for the life of a launch, and no launch into another run's files.

The lock is `flock` on `<out>/.aqpipe.lock`: the kernel drops it when the launcher's process ends however it ends,
so a killed run never leaves a stale lock. The file holds the holder's pid for the message a second launch gets.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

from aqpipe.config import ConfigError
from aqpipe.disk import disk_full_error

LOCK_NAME = ".aqpipe.lock"
# What a run writes into its directory; any of them present means the directory holds a run.
RUN_OUTPUTS = ("config.json", "metrics.jsonl", "summary.json", "loss.png", "checkpoints", "export", "store", "logs",
               "restarts.jsonl")


class RunDirectory:
    """The launcher's claim on `--out`: locked from `claim` until `release` (or the process's end)."""

    def __init__(self, out: str | Path) -> None:
        self.path = Path(out)
        self._fd: int | None = None
        self._created = False
        self._previous: list[str] = []

    def claim(self, resuming: bool, overwrite: bool) -> None:
        """Lock the directory (creating it), then make sure a fresh launch does not land on another run's files:
        refused unless `overwrite` (then `clear_previous` deletes that run). Raises ConfigError (exit 2)."""
        self._created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot create the run directory --out {str(self.path)!r}: {e.strerror}") from None
        self._lock(fd)
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            self.release(failed_before_start=True)
            full = disk_full_error(e, self.path / LOCK_NAME, 16)
            if full is not None:
                raise full from None
            raise ConfigError(f"cannot write the lock of the run directory {self.path}: {e.strerror}") from None
        self._previous = [] if resuming else existing_run(self.path)
        if self._previous and not overwrite:
            self.release(failed_before_start=True)
            raise self._holds_a_run(self._previous)

    def precheck(self, resuming: bool, overwrite: bool) -> None:
        """Raise the ConfigError `claim` would raise for a directory in use or holding another run, without creating
        or keeping anything: a refusal found before the launch spends seconds importing (`claim` decides)."""
        self.refuse_if_in_use()
        previous = [] if resuming else existing_run(self.path)
        if previous and not overwrite:
            raise self._holds_a_run(previous)

    def refuse_if_in_use(self) -> None:
        """Raise the ConfigError naming the launch that holds the directory's lock, if one does (nothing is taken)."""
        holder = lock_holder(self.path / LOCK_NAME)
        if holder is not None:
            raise self._in_use(holder)

    def _lock(self, fd: int) -> None:
        """Lock `fd` without waiting, or close it and raise the ConfigError naming the launch that holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(f"cannot lock the run directory {self.path}: {e.strerror}") from None
            raise self._in_use(holder) from None

    def _in_use(self, holder: str) -> ConfigError:
        return ConfigError(f"the run directory {self.path} is in use by another aqpipe launch (pid {holder}); "
                           "wait for it to end or choose another --out")

    def _holds_a_run(self, previous: list[str]) -> ConfigError:
        return ConfigError(f"--out {self.path} already holds a run ({', '.join(previous)}): continue it with "
                           f"--resume {self.path}, choose another --out, or add --overwrite to delete that run first")

    def clear_previous(self) -> None:
        """Delete the run `--overwrite` replaces (called once the new run's configuration is known to be good)."""
        for name in sorted(self._previous, key=lambda name: name == "config.json"):  # (last: see restart.AFTER_CONFIG)
            remove(self.path / name)
        self._previous = []

    def release(self, failed_before_start: bool = False) -> None:
        """Drop the lock; after a launch refused before anything was written, remove the directory it created."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if failed_before_start and self._created and not existing_run(self.path):
            (self.path / LOCK_NAME).unlink(missing_ok=True)
            try:
                self.path.rmdir()
            except OSError:  # something else was put there meanwhile: leave it
                pass


def lock_holder(path: Path) -> str | None:
    """The pid written in the lock file `path` while some process holds its lock, else None; read from the kernel's
    table of locks (/proc/locks), so that asking takes no lock a launch starting this instant could trip over."""
    try:
        st = os.stat(path)
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    if not any(line.split()[1] == "FLOCK" and device in line.split() for line in table.splitlines() if line.strip()):
        return None
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def existing_run(out: Path) -> list[str]:
    """The run outputs present in `out` (empty when it holds no run)."""
    return [name for name in RUN_OUTPUTS if (out / name).exists() or (out / name).is_symlink()]


def remove(path: Path) -> None:
    """Delete a file or a directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
