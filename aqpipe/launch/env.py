"""The distributed environment a rank runs in: our launcher, torchrun, or the DeepSpeed launcher."""

from __future__ import annotations

import os

# The resolved configuration (JSON) `aqpipe launch` hands each rank it starts; its presence marks such a rank.
CONFIG_ENV = "AQPIPE_CONFIG_JSON"
# In a rank that runs a Python script afresh: which of the script's calls of `aqpipe.train` (1, 2, …) it is a rank of.
TRAIN_CALL_ENV = "AQPIPE_TRAIN_CALL"


def in_distributed_env() -> bool:
    """True inside a process started by a distributed launcher (RANK and WORLD_SIZE are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_from_env() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment."""
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise RuntimeError("RANK and WORLD_SIZE must be set by the launcher (aqpipe launch, torchrun, deepspeed)") from None
