"""aqpipe: pipeline-parallel fine-tuning of language models over slow networks, with AQ-SGD."""

from aqpipe.api import train
from aqpipe.config import RunConfig
from aqpipe.stages import PipelineSpec, partition

__all__ = ["PipelineSpec", "RunConfig", "partition", "train"]
__version__ = "0.1.0"
