"""Training a `PipelineSpec` from a Python script, started plainly, by `aqpipe launch`, torchrun or DeepSpeed."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from aqpipe.config import ConfigError, build_config, resolve
from aqpipe.config.values import one_line
from aqpipe.stages import PipelineSpec

_calls = 0  # how many times this process has called train


def train(spec_factory: Callable[..., PipelineSpec], overwrite: bool = False, **settings) -> int:
    """Train the model `spec_factory` builds, with any `aqpipe launch` setting as a keyword (`pp=2, lr=1e-3`);
    `overwrite=True` is `--overwrite` (replace a run already in `out`).

    `spec_factory` may take `vocab_size` and `seq_len`. Started plainly (`python script.py`), this process checks
    everything and runs the script once more, as far as this call, to fork the ranks from (each rank runs the script
    afresh where that run could not fork them soundly); inside a rank, it trains that rank. A script may call it more
    than once: each call's ranks run that call's factory. Returns the exit code.
    """
    from aqpipe.launch.env import CONFIG_ENV, TRAIN_CALL_ENV, in_distributed_env
    from aqpipe.launch.job import run_job
    from aqpipe.launch.rank_server import script_call, serve_script
    from aqpipe.launch.worker_entry import run_rank

    global _calls
    _calls += 1
    # A run of the script started for this call's ranks (to fork them, or as one of them) gets past the calls
    # before it, whose runs the command has done, and stops at it.
    serving = script_call()
    if serving is not None:
        if serving == _calls:
            serve_script(spec_factory)
        return 0
    if CONFIG_ENV in os.environ and in_distributed_env():
        return run_rank(spec_factory) if int(os.environ.get(TRAIN_CALL_ENV, _calls)) == _calls else 0
    try:
        cfg = resolve(build_config({}, settings))
        return run_job(cfg, spec_factory, script_command=[sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]],
                       overwrite=overwrite, script_call=_calls)
    except ConfigError as e:
        print(f"aqpipe: error: {one_line(str(e))}", file=sys.stderr)
        return 2
