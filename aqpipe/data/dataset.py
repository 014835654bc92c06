"""Everything a run needs of its data, prepared once and cached: tokenized samples and the vocabulary size."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import torch

from aqpipe.data.corpus import DataError, load_corpus
from aqpipe.data.samples import TokenSamples, chunk, epoch_order
from aqpipe.data.tokenizer import HFTokenizer, atomic_write_bytes, cache_dir, corpus_key, train_bpe

DEFAULT_BPE_VOCAB = 4096


@dataclass
class LMDataset:
    """Tokenized training and validation samples of one corpus."""

    train: TokenSamples
    valid: TokenSamples
    vocab_size: int
    tokenizer: str


def prepare_lm_dataset(
    data: str,
    seq_len: int,
    tokenizer_dir: str | None = None,
    vocab_size: int | None = None,
    max_samples: int | None = None,
) -> LMDataset:
    """Load, tokenize and chunk `data` into samples of `seq_len` tokens; cached, so every rank can call it."""
    corpus = load_corpus(data)
    if tokenizer_dir is not None:
        tok_name = "hf:" + hashlib.sha256(tokenizer_dir.encode()).hexdigest()[:12]
    else:
        tok_name = f"bpe{vocab_size or DEFAULT_BPE_VOCAB}"
    key = f"{corpus_key(corpus)}-{tok_name}-{seq_len}"
    path = cache_dir() / f"samples-{key}.pt"
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        train, valid, vocab = TokenSamples(cached["train"]), TokenSamples(cached["valid"]), int(cached["vocab_size"])
    else:
        tokenizer = HFTokenizer(tokenizer_dir) if tokenizer_dir else train_bpe(corpus, vocab_size or DEFAULT_BPE_VOCAB)
        train = chunk(tokenizer.encode(corpus.train), seq_len)
        valid = chunk(tokenizer.encode(corpus.valid), seq_len) if corpus.valid else chunk([], seq_len)
        vocab = tokenizer.vocab_size
        buf = io.BytesIO()
        torch.save({"train": train.tokens, "valid": valid.tokens, "vocab_size": vocab}, buf)
        atomic_write_bytes(path, buf.getvalue())
    if len(train) == 0:
        raise DataError(f"--data {data!r} is too short for even one sample of --seq-len {seq_len}")
    if max_samples is not None:
        train = TokenSamples(train.tokens[:max_samples])
    return LMDataset(train, valid, vocab, tok_name)


class EpochPlan:
    """Which samples each micro-batch of each step takes, for one replica's shard (the shuffle cached per epoch)."""

    def __init__(self, shard_ids: torch.Tensor, seed: int, micro_batch_size: int, micro_batches: int) -> None:
        self.shard_ids = shard_ids
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.micro_batches = micro_batches
        self._epoch = -1
        self._order = shard_ids

    @property
    def steps_per_epoch(self) -> int:
        """Full optimizer steps in one pass over the shard (the remainder is dropped)."""
        return self.shard_ids.numel() // (self.micro_batch_size * self.micro_batches)

    def micro_batches_of(self, step: int) -> list[torch.Tensor]:
        """Sample ids of each micro-batch of global step `step` (0-based)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.shard_ids, self.seed, epoch)
        per_step = self.micro_batch_size * self.micro_batches
        return list(self._order[within * per_step : (within + 1) * per_step].split(self.micro_batch_size))
