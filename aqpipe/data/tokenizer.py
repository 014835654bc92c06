"""Tokenizers: the model's own when it brings one, otherwise a byte-level BPE trained on the corpus and cached."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from aqpipe.data.corpus import Corpus, DataError
from aqpipe.data.progress import preparing
from aqpipe.disk import write_atomic


class TextTokenizer(Protocol):
    """What aqpipe needs of a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


def cache_dir() -> Path:
    """Where aqpipe caches tokenizers and tokenized datasets ($AQPIPE_CACHE, default ~/.cache/aqpipe)."""
    path = Path(os.environ.get("AQPIPE_CACHE", Path.home() / ".cache" / "aqpipe"))
    path.mkdir(parents=True, exist_ok=True)
    return path


class BPETokenizer:
    """A byte-level BPE from the `tokenizers` library."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def save(self, path: Path) -> None:
        write_atomic(path, self.tokenizer.to_str().encode(), shared=True)


# The files that carry a `transformers` tokenizer's vocabulary, in the usual formats.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spm.model", "tokenizer.model", "sentencepiece.bpe.model")


class HFTokenizer:
    """A `transformers` tokenizer loaded from a checkpoint directory."""

    def __init__(self, directory: str) -> None:
        from transformers import AutoTokenizer

        # without these files transformers builds an empty vocabulary (every word [UNK]) instead of failing
        if not any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
            raise DataError(f"cannot load the tokenizer of {directory}: it holds none of {', '.join(TOKENIZER_FILES)}")
        try:
            self.hf = AutoTokenizer.from_pretrained(directory)
        except Exception as e:  # noqa: BLE001 - missing files, unknown class, a sentencepiece model without the library
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise DataError(f"cannot load the tokenizer of {directory}: {type(e).__name__}: {first}") from None

        self.vocab_size = len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.hf(texts, add_special_tokens=False)["input_ids"]


def corpus_key(corpus: Corpus) -> str:
    """A short content hash of a corpus."""
    h = hashlib.sha256()
    h.update(corpus.train.encode())
    h.update(b"\0")
    h.update(corpus.valid.encode())
    return h.hexdigest()[:16]


# BPE training time grows super-linearly with the length of one pre-token (a megabyte without a space or
# punctuation ran for minutes); a token never spans more than a few dozen characters anyway.
MAX_PRETOKEN_CHARS = 64
_LONG_RUN = re.compile(rf"[^\s]{{{MAX_PRETOKEN_CHARS + 1},}}")


def bounded_pretokens(line: str) -> str:
    """`line` with every unbroken run longer than MAX_PRETOKEN_CHARS split by spaces (for training the BPE only)."""
    return _LONG_RUN.sub(lambda m: " ".join(m.group()[i:i + MAX_PRETOKEN_CHARS]
                                            for i in range(0, len(m.group()), MAX_PRETOKEN_CHARS)), line)


TRAIN_PIECE_CHARS = 1 << 16
ENCODE_PIECE_CHARS = 1 << 16
ENCODE_BATCH_PIECES = 64  # pieces handed to the tokenizer at once (it encodes a batch on every core)
# Where the byte-level BPE's pre-tokens always end, whatever follows: between a non-space character and a single
# space before another one ("word| next"), and after a lone newline before a non-space ("line\n|Next"). Cutting
# there tokenizes exactly like the whole text.
_SAFE_CUT = re.compile(r"(?<=\S)(?= \S)|(?<=\S\n)(?=\S)")


def text_pieces(text: str, max_chars: int) -> Iterator[str]:
    """`text` in consecutive pieces of at most `max_chars`, cut where pre-tokens end (_SAFE_CUT) when the second half
    of the window has such a place, else where it must be (text without single spaces or lone newlines there)."""
    start = 0
    while start < len(text):
        end = start + max_chars
        if end < len(text):
            last = None
            for last in _SAFE_CUT.finditer(text, start + max_chars // 2, end):  # noqa: B007 - the last match is wanted
                pass
            end = last.start() if last is not None else end
        yield text[start:end]
        start = end


def encode_stream(tokenizer: TextTokenizer, text: str, max_tokens: int | None = None,
                  progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """The token ids of `text` (int64), encoded piece by piece so memory stays bounded; stops once `max_tokens`
    are there. `progress(n)` hears of every `n` characters done."""
    parts: list[torch.Tensor] = []
    count = 0
    pieces = text_pieces(text, ENCODE_PIECE_CHARS)
    size = 1  # batches grow from one piece, so a short --max-samples reads little more than it needs
    while max_tokens is None or count < max_tokens:
        batch = list(itertools.islice(pieces, size))
        size = min(2 * size, ENCODE_BATCH_PIECES)
        if not batch:
            break
        for ids in tokenizer.encode_batch(batch):
            parts.append(torch.tensor(ids, dtype=torch.int32))
            count += len(ids)
        if progress is not None:
            progress(sum(len(piece) for piece in batch))
    stream = torch.cat(parts).long() if parts else torch.empty(0, dtype=torch.int64)
    return stream if max_tokens is None else stream[:max_tokens]


def train_bpe(corpus: Corpus, vocab_size: int) -> BPETokenizer:
    """Train (or load from the cache) a byte-level BPE of at most `vocab_size` tokens on the training text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = cache_dir() / f"bpe-{corpus_key(corpus)}-{vocab_size}.json"
    if path.is_file():
        return BPETokenizer(Tokenizer.from_file(str(path)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with preparing(f"training a {vocab_size}-token BPE", len(corpus.train)) as advance:

        def lines() -> Iterator[str]:
            """The lines of the text (without their newlines, as BPE training has always seen them), made from bounded
            pieces as training consumes them: memory stays a small multiple of the text."""
            for piece in text_pieces(corpus.train, TRAIN_PIECE_CHARS):
                advance(len(piece))
                yield from (bounded_pretokens(line) for line in piece.splitlines())

        tok.train_from_iterator(lines(), trainer=trainer)
    result = BPETokenizer(tok)
    result.save(path)
    return result
