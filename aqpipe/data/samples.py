"""Fixed-length LM samples with stable ids, per-replica shards and a seeded per-epoch shuffle."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenSamples:
    """`tokens[i]` holds seq_len + 1 tokens of sample id i: input = tokens[i, :-1], target = tokens[i, 1:]."""

    tokens: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1

    def inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """Input token ids of the samples `ids`, shape [len(ids), seq_len]."""
        return self.tokens[ids, :-1]

    def targets(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token targets of the samples `ids`, shape [len(ids), seq_len]."""
        return self.tokens[ids, 1:]

    def mask(self, ids: torch.Tensor) -> None:
        """LM windows are never padded: no mask travels with them."""
        return None


def chunk(token_ids: list[int] | torch.Tensor, seq_len: int) -> TokenSamples:
    """Cut a token stream into non-overlapping windows of seq_len + 1 (consecutive windows share one token)."""
    stream = torch.as_tensor(token_ids, dtype=torch.int64)
    n = (stream.numel() - 1) // seq_len
    if n < 1:
        return TokenSamples(torch.empty(0, seq_len + 1, dtype=torch.int64))
    starts = torch.arange(n) * seq_len
    return TokenSamples(stream[starts[:, None] + torch.arange(seq_len + 1)])


def shard(num_samples: int, replica: int, replicas: int) -> torch.Tensor:
    """The sample ids replica `replica` owns: every `replicas`-th id, all shards the same size."""
    usable = num_samples - num_samples % replicas
    return torch.arange(replica, usable, replicas)


def epoch_order(ids: torch.Tensor, seed: int, epoch: int) -> torch.Tensor:
    """A deterministic shuffle of `ids` for `epoch` (same on every rank that asks)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return ids[torch.randperm(ids.numel(), generator=g)]

