"""aqpipe: pipeline-parallel fine-tuning of language models over slow networks, with AQ-SGD."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'aqpipe' has no attribute {name!r}")
