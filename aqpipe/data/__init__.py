"""A run's data, prepared once and cached (`dataset`): text corpora (`corpus`) cut into fixed-length samples with
stable ids, per-replica shards and a seeded shuffle (`samples`); conversations for instruction tuning (`instruct`,
rendered by `chat`; the built-in set: `builtin_instruct`); labelled text for classification (`labeled`,
`classify`); tokenizers (`tokenizer`); and the progress of a long preparation (`progress`)."""

from aqpipe.data.classify import ClassifySamples
from aqpipe.data.corpus import Corpus, DataError, load_corpus
from aqpipe.data.dataset import (
                                 EpochPlan,
                                 TaskDataset,
                                 prepare_classify_dataset,
                                 prepare_dataset,
                                 prepare_instruct_dataset,
                                 prepare_lm_dataset,
)
from aqpipe.data.instruct import InstructSamples
from aqpipe.data.samples import TokenSamples, shard

__all__ = ["ClassifySamples", "Corpus", "DataError", "EpochPlan", "InstructSamples", "TaskDataset", "TokenSamples",
           "load_corpus", "prepare_classify_dataset", "prepare_dataset", "prepare_instruct_dataset", "prepare_lm_dataset",
           "shard"]
