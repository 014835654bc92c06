"""The distributed environment a rank runs in: our launcher, torchrun, or the DeepSpeed launcher."""

from __future__ import annotations

import os

from aqpipe.lifetime import die_with

# The resolved configuration (JSON) `aqpipe launch` hands each rank it starts; its presence marks such a rank.
CONFIG_ENV = "AQPIPE_CONFIG_JSON"


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
    if parent is not None:
        die_with(int(parent))
