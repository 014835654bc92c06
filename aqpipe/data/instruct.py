"""Instruction data for causal LMs: conversations read from JSONL/CSV/TSV files, directories, hub datasets or the
built-in set; rendered with the tokenizer's chat template (or a plain "### Instruction / ### Response" layout when
it has none); tokenized with the loss on the assistant's tokens only.

Each sample is one conversation, right-padded to `seq_len` with a padding mask that travels beside the activations;
targets are the next tokens on response positions and IGNORE elsewhere (prompt, template, padding), so the loss is a
mean over response tokens. Longer conversations are truncated (counted); one with no response token left is dropped
(counted).
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aqpipe.data.corpus import DataError, load_hub_dataset

IGNORE = -100  # a target position that is not a response token (cross_entropy's ignore_index)
BUILTIN = "builtin-instruct"
TABLE_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")
# Field sets one record may use, in the order they are looked for (chat "messages" first).
FIELD_SETS = (("prompt", "response"), ("instruction", "output"), ("question", "answer"))
PLAIN_PROMPT, PLAIN_RESPONSE = "### Instruction:\n", "\n\n### Response:\n"
Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


@dataclass
class Instructions:
    """Training and validation conversations."""

    name: str
    train: list[list[Message]]
    valid: list[list[Message]]


@dataclass
class InstructSamples:
    """Tokenized conversations; sample id i is row i of every tensor."""

    input_ids: torch.Tensor  # [N, T] int64, padded
    target_ids: torch.Tensor  # [N, T] int64: the next token on response positions, IGNORE elsewhere
    attention: torch.Tensor  # [N, T] uint8, 1 on real tokens
    cut: torch.Tensor  # [N] bool: the conversation was longer than seq_len and is cut to it
    dropped: int = 0  # conversations of the source with no response token within seq_len (not among the N)
    prompts: list[str] = field(default_factory=list)  # each sample's rendered prompt of its last answer (generation)
    questions: list[str] = field(default_factory=list)  # the user message that answer replies to
    answers: list[str] = field(default_factory=list)  # the answer itself

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def truncated(self) -> int:
        """Samples cut to seq_len."""
        return int(self.cut.sum())

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def inputs(self, ids: torch.Tensor) -> torch.Tensor:
        return self.input_ids[ids]

    def targets(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target_ids[ids]

    def mask(self, ids: torch.Tensor) -> torch.Tensor:
        return self.attention[ids]

    def loss_tokens(self, ids: torch.Tensor) -> int:
        """Response tokens (loss terms) among the samples `ids`."""
        return int((self.target_ids[ids] != IGNORE).sum())

    def to_dict(self) -> dict:
        return {"input_ids": self.input_ids, "target_ids": self.target_ids, "attention": self.attention,
                "cut": self.cut, "dropped": self.dropped, "prompts": self.prompts,
                "questions": self.questions, "answers": self.answers}

    def head(self, count: int) -> InstructSamples:
        """The first `count` samples."""
        return InstructSamples(self.input_ids[:count], self.target_ids[:count], self.attention[:count], self.cut[:count],
                               self.dropped, self.prompts[:count], self.questions[:count], self.answers[:count])


def is_instruction_data(data: str) -> bool:
    """Whether `--data` names instruction data (the built-in set, a table file, or a directory of tables) rather
    than plain text for LM training."""
    if data == BUILTIN:
        return True
    if os.path.isfile(data):
        return Path(data).suffix.lower() in TABLE_SUFFIXES
    if os.path.isdir(data):
        return any(p.suffix.lower() in TABLE_SUFFIXES for p in Path(data).glob("train.*"))
    if data == "builtin" or os.path.exists(data) or data.startswith((".", os.sep)):
        return False
    try:  # a hub dataset: instruction data when its columns are one of the record formats
        columns = set(load_hub_dataset(data)["train"].column_names)
    except (DataError, KeyError):
        return False  # plain text, or unreachable: the corpus loader says what is wrong
    return "messages" in columns or any({a, b} <= columns for a, b in FIELD_SETS)


def record_messages(record, where: str) -> list[Message]:
    """One record as a conversation: `messages` (chat), `prompt`+`response`, `instruction`(+`input`)+`output` or
    `question`+`answer`; DataError naming `where` (file and line) otherwise."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with prompt/response, instruction/output or messages fields")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of {{'role': ..., 'content': ...}} objects")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: the conversation has no assistant message to learn")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    for prompt_key, response_key in FIELD_SETS:
        if prompt_key not in record or response_key not in record:
            continue
        prompt, response = record[prompt_key], record[response_key]
        for key, value in ((prompt_key, prompt), (response_key, response)):
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where}: field {key!r} is {'empty' if isinstance(value, str) else type(value).__name__}, "
                                "not text")
        if isinstance(prompt, str) and isinstance(response, str):
            extra = record.get("input") if prompt_key == "instruction" else None
            if isinstance(extra, str) and extra.strip():
                prompt = f"{prompt}\n\n{extra}"
            messages = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else []
            return [*messages, {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    present = ", ".join(sorted(map(str, record))) or "none"
    raise DataError(f"{where}: missing fields: need prompt+response, instruction+output, question+answer or "
                    f"messages (it has {present})")


def read_table(path: str) -> list[list[Message]]:
    """Every conversation of one JSONL/JSON/CSV/TSV file; DataError naming the file and line of a bad record."""
    suffix = Path(path).suffix.lower()
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:  # newline="": quoted CSV cells keep their line breaks
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read data file {path!r}: {e}") from None
    out = []
    if suffix in (".csv", ".tsv"):
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if suffix == ".tsv" else ",")
        for row in reader:
            out.append(record_messages({k: v for k, v in row.items() if k is not None}, f"{path}:{reader.line_num}"))
    elif suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except ValueError as e:
            raise DataError(f"{path}: not valid JSON: {e}") from None
        out = [record_messages(r, f"{path}: record {i + 1}") for i, r in enumerate(records)]
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{number}: not valid JSON: {e}") from None
            out.append(record_messages(record, f"{path}:{number}"))
    if not out:
        raise DataError(f"data file {path!r} holds no examples")
    return out


def load_instructions(data: str, valid_share: int = 10) -> Instructions:
    """Resolve instruction `--data`: the built-in set, a table file (every `valid_share`-th example held out), a
    directory with train.* and valid.* tables, or a hub dataset."""
    if data == BUILTIN:
        from aqpipe.data.builtin_instruct import builtin_instructions

        pairs_train, pairs_valid = builtin_instructions()
        return Instructions(BUILTIN, [_pair(q, a) for q, a in pairs_train], [_pair(q, a) for q, a in pairs_valid])
    if os.path.isfile(data):
        rows = read_table(data)
        return Instructions(Path(data).name, [r for i, r in enumerate(rows) if i % valid_share != valid_share - 1],
                            [r for i, r in enumerate(rows) if i % valid_share == valid_share - 1])
    if os.path.isdir(data):
        tables = {p.stem: p for p in sorted(Path(data).iterdir()) if p.suffix.lower() in TABLE_SUFFIXES}
        if "train" not in tables:
            raise DataError(f"data directory {data!r} has no train.jsonl/.csv/.tsv table")
        held = next((tables[s] for s in ("valid", "validation", "test") if s in tables), None)
        return Instructions(Path(data).name, read_table(str(tables["train"])), read_table(str(held)) if held else [])
    dataset = load_hub_dataset(data)
    if "train" not in dataset:
        raise DataError(f"hub dataset {data!r} has no train split")
    held_split = next((s for s in ("validation", "valid", "test") if s in dataset), None)
    train = [record_messages(r, f"{data} train row {i}") for i, r in enumerate(dataset["train"])]
    if held_split is None:
        return Instructions(data, [r for i, r in enumerate(train) if i % valid_share != valid_share - 1],
                            [r for i, r in enumerate(train) if i % valid_share == valid_share - 1])
    valid = [record_messages(r, f"{data} {held_split} row {i}") for i, r in enumerate(dataset[held_split])]
    return Instructions(data, train, valid)


def _pair(question: str, answer: str) -> list[Message]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
