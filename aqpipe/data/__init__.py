"""Corpora, tokenization, fixed-length samples with ids, and data-parallel sharding."""

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
