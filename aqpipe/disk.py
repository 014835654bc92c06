"""Writing files so that a full disk is reported as something a user can act on, and never leaves half a file.

A bare `OSError: [Errno 28] No space left on device` names no file, and LMDB reports a short write as
`Input/output error`. Every file aqpipe writes goes through `write_atomic` or a `writing` block, which turn a
full disk (or quota) into a DiskFullError naming the file, the space it needed and the space that was free.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")


def size_text(n: int | None) -> str:
    """Bytes for people: 512 B, 3.4 KB, 12.0 MB, 1.50 GB."""
    if n is None:
        return "an unknown amount"
    for unit, scale, digits in (("GB", 1e9, 2), ("MB", 1e6, 1), ("KB", 1e3, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n} B"


def free_bytes(path: str | Path) -> int | None:
    """Free bytes (for this user) on the filesystem that holds `path`, or its nearest existing parent."""
    path = Path(path).absolute()
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


class DiskFullError(OSError):
    """A write failed because the filesystem (or the user's quota) is full."""

    def __init__(self, path: str | Path, needed: int | None = None, free: int | None = None) -> None:
        self.path = Path(path)
        self.needed = needed
        self.free = free_bytes(path) if free is None else free
        super().__init__(errno.ENOSPC, f"disk full writing {self.path}: it needed {size_text(needed)}, "
                                       f"{size_text(self.free)} was free on that filesystem")

    def __str__(self) -> str:
        return str(self.strerror)


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    """`error` and the errors it was raised from (or while handling), innermost last."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, says the disk or the quota is full."""
    return any(isinstance(e, DiskFullError) or (isinstance(e, OSError) and e.errno in FULL_ERRNOS)
               or any(text in str(e) for text in _FULL_TEXTS) for e in _chain(error))


def disk_full_error(error: BaseException, path: str | Path, needed: int | None = None) -> DiskFullError | None:
    """The DiskFullError behind `error` (the first in its chain), or a new one for `path` when the chain says the disk
    is full in other words; None when it does not."""
    found = next((e for e in _chain(error) if isinstance(e, DiskFullError)), None)
    return found or (DiskFullError(path, needed) if is_disk_full(error) else None)


@contextmanager
def writing(path: str | Path, needed: int | None = None) -> Iterator[None]:
    """A block that writes `path` (about `needed` bytes): a full disk inside it raises DiskFullError naming it."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:  # noqa: BLE001 - anything that says the disk is full, whichever library raised it
        if is_disk_full(e):
            raise DiskFullError(path, needed) from e
        raise


def ensure_room(path: str | Path, needed: int) -> None:
    """Raise DiskFullError unless `needed` bytes are free where `path` lives (for writers that cannot fail
    cleanly once they have started, like a memory-mapped database)."""
    free = free_bytes(path)
    if free is not None and free < needed:
        raise DiskFullError(path, needed, free)


def save_atomic(path: str | Path, write: Callable[[BinaryIO], object], needed: int | None = None,
                durable: bool = False, shared: bool = False) -> None:
    """Write `path` through `write(file)` so that readers see the old file or the whole new one, never part of it.
    `durable`: on disk (fsync) before it replaces the old file; `shared`: several processes may write this path at
    once (a cache), so each uses a temporary file of its own. A failure removes the temporary file; a full disk
    raises DiskFullError (the free space it reports is measured once the temporary file is gone)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp" if shared else f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, Exception) and is_disk_full(e):
            raise DiskFullError(path, needed) from e
        raise


def write_atomic(path: str | Path, data: bytes, durable: bool = False, shared: bool = False) -> None:
    """`save_atomic` of bytes."""
    save_atomic(path, lambda f: f.write(data), len(data), durable, shared)
