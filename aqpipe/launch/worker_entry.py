"""The process `aqpipe launch` starts for each rank: `python -m aqpipe.launch.worker_entry`.

Takes the resolved configuration from its launcher ($AQPIPE_CONFIG_JSON) and runs this rank; any error is reported to
the launcher as one event naming the cause, with the traceback on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from aqpipe.disk import disk_full_error
from aqpipe.launch.env import CONFIG_ENV, rank_from_env
from aqpipe.lifetime import die_with_parent, leave


def rank_imports(model: str | None, lora: bool = False, store: str = "memory") -> list[str]:
    """The modules every rank of a run of `--model model` (None: of a spec factory given from Python) imports (with
    LoRA, with that --store), for the fork server to import once before it forks them; called inside the server,
    which may import torch."""
    from aqpipe.stages.models import model_imports

    # (torch._dynamo: torch.optim's optimizers import it when the first is made, unless a model's code did already)
    modules = ["torch", "torch.distributed", "torch._dynamo", "aqpipe.runtime.rank.train"]
    modules += model_imports(model) if model is not None else []
    if lora:
        modules += ["peft"]
    if store == "lmdb":
        modules += ["aqpipe.storage.lmdb_store"]
    return modules


def run_rank(spec_factory=None) -> int:
    """Run the rank described by the environment; returns the process exit code."""
    from aqpipe.config import ResolvedConfig
    from aqpipe.runtime.events import emit
    from aqpipe.runtime.rank.train import run_worker

    die_with_parent()
    from aqpipe.launch.signals import dump_stacks_on_sigusr1

    dump_stacks_on_sigusr1()
    rank, world_size = rank_from_env()
    out = "."
    try:
        cfg = ResolvedConfig(**json.loads(os.environ[CONFIG_ENV]))
        out = cfg.out
        run_worker(cfg, rank, world_size, spec_factory, launcher_checked=True)  # (`aqpipe launch` started it)
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the process ends
        if isinstance(e, KeyboardInterrupt):
            return 1
        full = disk_full_error(e, out)
        if full is not None:  # the file it names is the cause; the library that noticed is a detail (for the log)
            emit({"event": "error", "message": str(full), "disk_full": True})
        else:
            text = str(e).strip().splitlines()
            emit({"event": "error", "message": f"{type(e).__name__}: {text[0] if text else ''}"})
        traceback.print_exc()
        sys.stderr.flush()
        return 1


if __name__ == "__main__":
    leave(run_rank())
