"""Models as pipeline stages: `PipelineSpec`, a model as an ordered list of layers and a loss (`spec`); `--model`
turned into one (`models`); the model adapters (`gpt2`, `llama` for the decoder families, `bert`, `deberta`),
checkpoints read stage by stage (`hf_weights`) and GGUF files converted once (`gguf`); LoRA (`lora`); splitting into
stages (`partition`); and the stages merged back into one Hugging Face checkpoint (`export`)."""

from aqpipe.stages.partition import partition
from aqpipe.stages.spec import PipelineSpec, SpecError, Stage

__all__ = ["PipelineSpec", "SpecError", "Stage", "partition"]
