"""Tokenized classification samples with ids: token ids, token types, attention mask and a label per sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aqpipe.data.labeled import Labeled


@dataclass
class ClassifySamples:
    """Fixed-length tokenized examples; sample id i is row i of every tensor."""

    input_ids: torch.Tensor  # [N, T] int64
    token_types: torch.Tensor  # [N, T] int64 (0 for the first text, 1 for the second)
    attention: torch.Tensor  # [N, T] uint8, 1 on real tokens
    labels: torch.Tensor  # [N] int64

    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids and token types of the samples `ids`, shape [len(ids), 2, seq_len]."""
        return torch.stack([self.input_ids[ids], self.token_types[ids]], dim=1)

    def targets(self, ids: torch.Tensor) -> torch.Tensor:
        """Labels of the samples `ids`, shape [len(ids)]."""
        return self.labels[ids]

    def mask(self, ids: torch.Tensor) -> torch.Tensor:
        """Attention masks of the samples `ids`, shape [len(ids), seq_len] (uint8, 1 = attend)."""
        return self.attention[ids]

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "token_types": self.token_types, "attention": self.attention,
                "labels": self.labels}


def encode_examples(examples: list[tuple[str, str | None, int]], tokenizer, seq_len: int) -> ClassifySamples:
    """Tokenize (text, second text, label) examples to `seq_len` tokens: [CLS] a [SEP] (b [SEP]), truncated
    longest-first and padded; with an HF tokenizer its own special tokens, with aqpipe's BPE id 0 for all three."""
    n = len(examples)
    input_ids = torch.zeros(n, seq_len, dtype=torch.int64)
    token_types = torch.zeros(n, seq_len, dtype=torch.int64)
    attention = torch.zeros(n, seq_len, dtype=torch.uint8)
    labels = torch.tensor([label for _, _, label in examples], dtype=torch.int64)
    if n == 0:
        return ClassifySamples(input_ids, token_types, attention, labels)
    firsts = [a for a, _, _ in examples]
    seconds = [b for _, b, _ in examples]
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        pairs = any(b is not None for b in seconds)
        enc = hf(firsts, [b or "" for b in seconds] if pairs else None, truncation=True, max_length=seq_len,
                 padding="max_length", return_token_type_ids=True, return_attention_mask=True)
        input_ids[:] = torch.tensor(enc["input_ids"])
        token_types[:] = torch.tensor(enc["token_type_ids"])
        attention[:] = torch.tensor(enc["attention_mask"], dtype=torch.uint8)
        return ClassifySamples(input_ids, token_types, attention, labels)
    for i, (a, b) in enumerate(zip(firsts, seconds)):
        row, types = _bpe_row(tokenizer.encode(a), tokenizer.encode(b) if b is not None else None, seq_len)
        input_ids[i, : len(row)] = torch.tensor(row)
        token_types[i, : len(types)] = torch.tensor(types)
        attention[i, : len(row)] = 1
    return ClassifySamples(input_ids, token_types, attention, labels)


def _bpe_row(a: list[int], b: list[int] | None, seq_len: int) -> tuple[list[int], list[int]]:
    """[0] a [0] (b [0]) truncated longest-first to `seq_len` (id 0, <|endoftext|>, marks start and separators)."""
    specials = 2 if b is None else 3
    room = max(0, seq_len - specials)
    while len(a) + (len(b) if b is not None else 0) > room:
        if b is not None and len(b) > len(a):
            b = b[:-1]
        else:
            a = a[:-1]
    row = [0] + a + [0]
    types = [0] * len(row)
    if b is not None:
        row += b + [0]
        types += [1] * (len(b) + 1)
    return row[:seq_len], types[:seq_len]


def labeled_text(task: Labeled) -> str:
    """All text of a task's training split, for training a tokenizer when the model brings none."""
    return "\n".join(a + ("\n" + b if b else "") for a, b, _ in task.train)
