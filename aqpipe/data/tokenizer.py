"""Tokenizers: the model's own when it brings one, otherwise a byte-level BPE trained on the corpus and cached."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Protocol

from aqpipe.data.corpus import Corpus, DataError


class TextTokenizer(Protocol):
    """What aqpipe needs of a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


def cache_dir() -> Path:
    """Where aqpipe caches tokenizers and tokenized datasets ($AQPIPE_CACHE, default ~/.cache/aqpipe)."""
    path = Path(os.environ.get("AQPIPE_CACHE", Path.home() / ".cache" / "aqpipe"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` so that readers see either the old file or the whole new one (ranks may race on a cache)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class BPETokenizer:
    """A byte-level BPE from the `tokenizers` library."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def save(self, path: Path) -> None:
        atomic_write_bytes(path, self.tokenizer.to_str().encode())


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
_LONG_RUN = re.compile(r"[^\s]{%d,}" % (MAX_PRETOKEN_CHARS + 1))


def bounded_pretokens(line: str) -> str:
    """`line` with every unbroken run longer than MAX_PRETOKEN_CHARS split by spaces (for training the BPE only)."""
    return _LONG_RUN.sub(lambda m: " ".join(m.group()[i:i + MAX_PRETOKEN_CHARS]
                                            for i in range(0, len(m.group()), MAX_PRETOKEN_CHARS)), line)


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
    lines = [bounded_pretokens(line) for line in corpus.train.splitlines()]
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    result = BPETokenizer(tok)
    result.save(path)
    return result
