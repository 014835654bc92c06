"""Corpora, tokenization, fixed-length samples with ids, and data-parallel sharding."""

from aqpipe.data.corpus import Corpus, DataError, load_corpus
from aqpipe.data.dataset import EpochPlan, LMDataset, prepare_lm_dataset
from aqpipe.data.samples import TokenSamples, shard

__all__ = ["Corpus", "DataError", "EpochPlan", "LMDataset", "TokenSamples", "load_corpus", "prepare_lm_dataset", "shard"]
