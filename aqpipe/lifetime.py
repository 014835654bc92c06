"""A helper process's life tied to its parent's: the ranks a launcher starts, the fork server's children and a
rank's checkpoint copier end when the process that started them does, even when it was killed."""

from __future__ import annotations

import ctypes
import os
import signal


def die_with(parent: int) -> None:
    """Be killed (SIGKILL) when process `parent`, which started this one, dies; exit at once if it already has."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)
