"""The distributed environment a rank runs in: our launcher, torchrun, or the DeepSpeed launcher."""

from __future__ import annotations

import ctypes
import os
import signal


def in_distributed_env() -> bool:
    """True inside a process started by a distributed launcher (RANK and WORLD_SIZE are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_from_env() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment."""
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise RuntimeError("RANK and WORLD_SIZE must be set by the launcher (aqpipe launch, torchrun, deepspeed)") from None


def die_with_parent() -> None:
    """Ask Linux to kill this process when the aqpipe launcher that started it dies, even by SIGKILL."""
    parent = os.environ.get("AQPIPE_PARENT_PID")
    if parent is None:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(1)
