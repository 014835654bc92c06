"""aqpipe: pipeline-parallel fine-tuning of language models over slow networks, with AQ-SGD.

The package's rooms, top down (a room imports only those below it; docs/architecture.md): the `aqpipe` command
(`cli`, `__main__`) and training from a Python script (`api`); measuring this machine for the capacity plan (`bench`);
starting ranks (`launch`); a rank's run, its checkpoints and the capacity plan (`runtime`); the configuration
(`config`); the pipeline that moves micro-batches between stages (`pipeline`); models split into stages (`stages`);
data (`data`), the per-sample store m(ξ) (`storage`) and a run's step records, summary and loss plot (`metrics`);
the link codecs and grad-sync compressors (`compress`), text from an exported model (`generate`), runs compared
(`report`), files written whole or refused with a clear message on a full disk (`disk`), and helper processes that
end with their parent (`lifetime`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aqpipe.lifetime import take_script_server

if TYPE_CHECKING:
    from aqpipe.api import train
    from aqpipe.config import RunConfig
    from aqpipe.stages import PipelineSpec, partition

__all__ = ["PipelineSpec", "RunConfig", "partition", "train"]
__version__ = "0.1.0"

# Where each public name lives. Imported on first use, so that `aqpipe` the command starts (and installs its
# Ctrl-C handling) before torch is loaded.
_HOMES = {"train": "aqpipe.api", "RunConfig": "aqpipe.config", "PipelineSpec": "aqpipe.stages",
          "partition": "aqpipe.stages"}

take_script_server()  # (a no-op but in the run of a script that is to fork the ranks of its aqpipe.train)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'aqpipe' has no attribute {name!r}")
