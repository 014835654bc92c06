"""Stage definitions: `PipelineSpec`, partitioning, and model adapters."""

from aqpipe.stages.partition import partition
from aqpipe.stages.spec import PipelineSpec, SpecError, Stage

__all__ = ["PipelineSpec", "SpecError", "Stage", "partition"]
