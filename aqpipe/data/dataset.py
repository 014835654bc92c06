"""Everything a run needs of its data, prepared once and cached: tokenized samples and the vocabulary size."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aqpipe.data.chat import bpe_chat_tokenizer, encode_conversations, with_chat_template
from aqpipe.data.classify import ClassifySamples, encode_examples, labeled_text
from aqpipe.data.corpus import Corpus, DataError, load_corpus
from aqpipe.data.instruct import Instructions, InstructSamples, is_instruction_data, load_instructions
from aqpipe.data.labeled import load_labeled
from aqpipe.data.progress import preparing
from aqpipe.data.samples import TokenSamples, chunk, epoch_order
from aqpipe.data.tokenizer import TOKENIZER_FILES, HFTokenizer, cache_dir, corpus_key, encode_stream, train_bpe
from aqpipe.disk import write_atomic

DEFAULT_BPE_VOCAB = 4096


@dataclass
class TaskDataset:
    """Tokenized training and validation samples of one task (LM windows, or labelled examples to classify)."""

    train: TokenSamples | ClassifySamples | InstructSamples
    valid: TokenSamples | ClassifySamples | InstructSamples
    vocab_size: int
    tokenizer: str
    label_names: list[str] = field(default_factory=list)  # classification only
    info: dict = field(default_factory=dict)  # what preparing the data counted (instruction data: truncated, dropped)

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


def tokenizer_name(tokenizer_dir: str | None, vocab_size: int | None) -> str:
    """A short name of the tokenizer a run uses, part of its cache keys: the model's own, or aqpipe's BPE size."""
    if tokenizer_dir is not None:  # the files' content, so an edited vocabulary or chat template is a new key
        digest = hashlib.sha256(tokenizer_dir.encode())
        for name in (*TOKENIZER_FILES, "tokenizer_config.json", "special_tokens_map.json", "merges.txt",
                     "chat_template.jinja", "chat_template.json"):
            path = Path(tokenizer_dir) / name
            if path.is_file():
                digest.update(name.encode() + b"\0" + path.read_bytes())
        return "hf:" + digest.hexdigest()[:12]
    return f"bpe{vocab_size or DEFAULT_BPE_VOCAB}"


def prepare_lm_dataset(
    data: str,
    seq_len: int,
    tokenizer_dir: str | None = None,
    vocab_size: int | None = None,
    max_samples: int | None = None,
) -> TaskDataset:
    """Load, tokenize and chunk `data` into samples of `seq_len` tokens; cached, so every rank can call it."""
    corpus = load_corpus(data)
    tok_name = tokenizer_name(tokenizer_dir, vocab_size)
    key = f"{corpus_key(corpus)}-{tok_name}-{seq_len}"
    whole = cache_dir() / f"samples-{key}.pt"
    first = cache_dir() / f"samples-{key}-first{max_samples}.pt" if max_samples is not None else None
    cached = next((path for path in (whole, first) if path is not None and path.is_file()), None)
    if cached is not None:
        saved = torch.load(cached, weights_only=True)
        train, valid, vocab = TokenSamples(saved["train"]), TokenSamples(saved["valid"]), int(saved["vocab_size"])
    else:
        tokenizer = HFTokenizer(tokenizer_dir) if tokenizer_dir else train_bpe(corpus, vocab_size or DEFAULT_BPE_VOCAB)
        # --max-samples: tokenize only as much of the training text as those samples need
        wanted = max_samples * seq_len + 1 if max_samples is not None else None
        what = "tokenizing the training text" + (f" (up to --max-samples {max_samples})" if wanted else "")
        with preparing(what, len(corpus.train)) as advance:
            stream = encode_stream(tokenizer, corpus.train, wanted, advance)
        train = chunk(stream, seq_len)
        with preparing("tokenizing the validation text", len(corpus.valid)) as advance:
            valid = chunk(encode_stream(tokenizer, corpus.valid, progress=advance), seq_len)
        vocab = tokenizer.vocab_size
        buf = io.BytesIO()
        torch.save({"train": train.tokens, "valid": valid.tokens, "vocab_size": vocab}, buf)
        write_atomic(whole if first is None or stream.numel() < (wanted or 0) else first, buf.getvalue(), shared=True)
    if len(train) == 0:
        raise DataError(f"--data {data!r} is too short for even one sample of --seq-len {seq_len}")
    if max_samples is not None:
        train = TokenSamples(train.tokens[:max_samples])
    return TaskDataset(train, valid, vocab, tok_name)


def prepare_classify_dataset(
    data: str,
    seq_len: int,
    tokenizer_dir: str | None = None,
    vocab_size: int | None = None,
    max_samples: int | None = None,
) -> TaskDataset:
    """Load and tokenize labelled examples of `data` to `seq_len` tokens; cached, so every rank can call it."""
    task = load_labeled(data)
    tok_name = tokenizer_name(tokenizer_dir, vocab_size)
    text = Corpus(task.name, labeled_text(task), "")
    content = hashlib.sha256(repr((task.train, task.valid, task.labels)).encode()).hexdigest()[:16]
    path = cache_dir() / f"classify-{content}-{tok_name}-{seq_len}.pt"
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        train, valid = ClassifySamples(**cached["train"]), ClassifySamples(**cached["valid"])
        vocab = int(cached["vocab_size"])
    else:
        tokenizer = HFTokenizer(tokenizer_dir) if tokenizer_dir else train_bpe(text, vocab_size or DEFAULT_BPE_VOCAB)
        train = encode_examples(task.train, tokenizer, seq_len)
        valid = encode_examples(task.valid, tokenizer, seq_len)
        vocab = tokenizer.vocab_size
        buf = io.BytesIO()
        torch.save({"train": train.to_dict(), "valid": valid.to_dict(), "vocab_size": vocab}, buf)
        write_atomic(path, buf.getvalue(), shared=True)
    if max_samples is not None:
        train = ClassifySamples(**{k: v[:max_samples] for k, v in train.to_dict().items()})
    return TaskDataset(train, valid, vocab, tok_name, list(task.labels))


def instruction_text(instructions: Instructions) -> Corpus:
    """The training conversations' text, which aqpipe's BPE learns when the model brings no tokenizer."""
    return Corpus(instructions.name, "\n\n".join(m["content"] for c in instructions.train for m in c), "")


def chat_tokenizer(instructions: Instructions, tokenizer_dir: str | None, vocab_size: int | None):
    """The HF tokenizer (with a chat template) that instruction data is rendered and tokenized with."""
    if tokenizer_dir is not None:
        return with_chat_template(HFTokenizer(tokenizer_dir).hf)
    return bpe_chat_tokenizer(train_bpe(instruction_text(instructions), vocab_size or DEFAULT_BPE_VOCAB))


def prepare_instruct_dataset(
    data: str,
    seq_len: int,
    tokenizer_dir: str | None = None,
    vocab_size: int | None = None,
    max_samples: int | None = None,
) -> TaskDataset:
    """Load and tokenize the conversations of instruction `data` to `seq_len` tokens with response-only targets;
    cached, so every rank can call it."""
    instructions = load_instructions(data)
    tok_name = tokenizer_name(tokenizer_dir, vocab_size)
    content = hashlib.sha256(repr((instructions.train, instructions.valid)).encode()).hexdigest()[:16]
    path = cache_dir() / f"instruct2-{content}-{tok_name}-{seq_len}.pt"  # 2: samples carry their `cut` flags
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        train, valid, vocab = InstructSamples(**cached["train"]), InstructSamples(**cached["valid"]), int(cached["vocab_size"])
    else:
        tokenizer = chat_tokenizer(instructions, tokenizer_dir, vocab_size)
        with preparing("tokenizing the conversations", len(instructions.train) + len(instructions.valid)) as advance:
            train = encode_conversations(instructions.train, tokenizer, seq_len)
            advance(len(instructions.train))
            valid = encode_conversations(instructions.valid, tokenizer, seq_len)
        vocab = len(tokenizer)
        buf = io.BytesIO()
        torch.save({"train": train.to_dict(), "valid": valid.to_dict(), "vocab_size": vocab}, buf)
        write_atomic(path, buf.getvalue(), shared=True)
    if len(train) == 0:
        raise DataError(f"--data {data!r} has no training conversation with a response token within --seq-len {seq_len}")
    if max_samples is not None:
        train = train.head(max_samples)
    info = {"truncated": train.truncated + valid.truncated, "dropped": train.dropped + valid.dropped}
    return TaskDataset(train, valid, vocab, tok_name, info=info)


def prepare_dataset(task: str, data: str, seq_len: int, tokenizer_dir: str | None = None,
                    vocab_size: int | None = None, max_samples: int | None = None) -> TaskDataset:
    """The dataset of a run: labelled examples (classify), conversations (lm on instruction data) or LM windows."""
    if task == "classify":
        prepare = prepare_classify_dataset
    elif is_instruction_data(data):
        prepare = prepare_instruct_dataset
    else:
        prepare = prepare_lm_dataset
    return prepare(data, seq_len, tokenizer_dir, vocab_size, max_samples)


def export_tokenizer(task: str, data: str, tokenizer_dir: str | None, vocab_size: int | None):
    """The run's tokenizer as a `transformers` tokenizer, to save beside an exported model: the model's own, or
    aqpipe's BPE (trained on the same text, so the cached one) wrapped as a fast tokenizer; with the chat template
    the run rendered its conversations with when the data was instruction data."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if task == "lm" and is_instruction_data(data):
        return chat_tokenizer(load_instructions(data), tokenizer_dir, vocab_size)
    if tokenizer_dir is not None:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    corpus = Corpus("labeled", labeled_text(load_labeled(data)), "") if task == "classify" else load_corpus(data)
    bpe = train_bpe(corpus, vocab_size or DEFAULT_BPE_VOCAB)
    special = "<|endoftext|>"
    extra = dict(cls_token=special, sep_token=special, pad_token=special) if task == "classify" else {}
    return PreTrainedTokenizerFast(tokenizer_object=bpe.tokenizer, bos_token=special, eos_token=special,
                                   unk_token=special, **extra)


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
