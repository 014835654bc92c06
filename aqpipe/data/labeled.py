"""Labelled text for classification: the built-in acceptability task, local CSV/JSONL tables, hub datasets (GLUE)."""

from __future__ import annotations

import csv
import json
import os
import random
import re
import zlib
from dataclasses import dataclass

from aqpipe.data.corpus import DataError, load_corpus, load_hub_dataset

# Column pairs read as (first text, second text or None), in the order they are looked for.
TEXT_COLUMNS = (("sentence1", "sentence2"), ("question1", "question2"), ("premise", "hypothesis"),
                ("question", "sentence"), ("text_a", "text_b"), ("sentence", None), ("text", None))
TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json")
# GLUE tasks and the split each one evaluates on.
GLUE_VALID = {"mnli": "validation_matched"}


@dataclass
class Labeled:
    """Training and validation examples: `(text, second text or None, label index)`, and the label names."""

    name: str
    train: list[tuple[str, str | None, int]]
    valid: list[tuple[str, str | None, int]]
    labels: list[str]


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"^[A-Za-z][A-Za-z'-]*[,;:.!?]?$")


def sentences(text: str, min_words: int = 6, max_words: int = 40) -> list[str]:
    """Prose sentences of a text: split at . ! ? and kept when nearly every word is a plain word (no code)."""
    out = []
    for paragraph in text.split("\n\n"):
        for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
            words = sentence.split()
            if min_words <= len(words) <= max_words and sum(bool(_WORD.match(w)) for w in words) >= 0.9 * len(words):
                out.append(sentence)
    return out


def acceptability_examples(text: str) -> list[tuple[str, str | None, int]]:
    """CoLA-like examples from prose: each sentence is kept (label 1, acceptable) or has its words shuffled
    (label 0), by a coin seeded from the sentence itself: the same task on every run, no sentence both ways."""
    examples: list[tuple[str, str | None, int]] = []
    for sentence in sentences(text):
        rng = random.Random(zlib.crc32(sentence.encode()))
        if rng.random() < 0.5:
            examples.append((sentence, None, 1))
            continue
        shuffled = _shuffle_words(sentence, rng)
        if shuffled is not None:
            examples.append((shuffled, None, 0))
    return examples


def _shuffle_words(sentence: str, rng: random.Random) -> str | None:
    """The sentence's words in a new order, keeping a capital first letter and the end mark where they were (so
    neither gives the answer away); None when no other order exists."""
    words = sentence.split()
    end = ""
    if words[-1] in (".", "!", "?"):
        end = " " + words.pop()
    elif words[-1][-1] in ".!?":
        end, words[-1] = words[-1][-1], words[-1][:-1]
    if words[0][:1].isupper() and words[0][1:2].islower():
        words[0] = words[0][0].lower() + words[0][1:]
    shuffled = words[:]
    for _ in range(10):
        rng.shuffle(shuffled)
        if shuffled != words:
            break
    if shuffled == words:
        return None
    shuffled[0] = shuffled[0][:1].upper() + shuffled[0][1:]
    return " ".join(shuffled) + end


def acceptability_task(data: str) -> Labeled:
    """The built-in acceptability task over a text corpus (`--data builtin`, a text file or directory)."""
    corpus = load_corpus(data)
    train = _unique(acceptability_examples(corpus.train), set())
    valid = acceptability_examples(corpus.valid) if corpus.valid.strip() else []
    if not valid:
        train, valid = _hold_out(train)
    valid = _unique(valid, {text for text, _, _ in train})  # a sentence the corpus repeats is held out only once
    if len(train) < 2:
        raise DataError(f"--data {data!r} has too little prose for the acceptability task ({len(train)} sentences)")
    return Labeled(f"acceptability:{corpus.name}", train, valid, ["unacceptable", "acceptable"])


def _unique(examples: list, seen: set[str]) -> list:
    """The examples whose text is not in `seen` nor earlier in the list."""
    out = []
    for example in examples:
        if example[0] not in seen:
            seen.add(example[0])
            out.append(example)
    return out


def _hold_out(examples: list) -> tuple[list, list]:
    """Every tenth example becomes validation."""
    return [e for i, e in enumerate(examples) if i % 10 != 9], [e for i, e in enumerate(examples) if i % 10 == 9]


def _rows(path: str) -> list[dict]:
    """The records of a CSV/TSV (header row) or JSON-lines file."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            if path.endswith((".csv", ".tsv")):
                return list(csv.DictReader(f, delimiter="\t" if path.endswith(".tsv") else ","))
            rows = []
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        raise DataError(f"{path}: line {n} is not a JSON object") from None
                    if not isinstance(row, dict):
                        raise DataError(f"{path}: line {n} is not a JSON object")
                    rows.append(row)
            return rows
    except OSError as e:
        raise DataError(f"cannot read data file {path!r}: {e.strerror}") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"cannot parse data file {path!r}: {e}") from None


def text_columns(columns: list[str], where: str) -> tuple[str, str | None]:
    """Which column(s) hold the text, by the usual names; a clear error naming the columns otherwise."""
    for first, second in TEXT_COLUMNS:
        if first in columns and (second is None or second in columns):
            return first, second
    raise DataError(f"{where} has no text column: expected one of text, sentence, sentence1+sentence2, "
                    f"question+sentence, premise+hypothesis, text_a+text_b; found {', '.join(columns) or 'none'}")


def _examples(rows: list[dict], where: str, names: dict[str, int] | None) -> tuple[list, dict[str, int]]:
    if not rows:
        raise DataError(f"{where} holds no examples")
    first, second = text_columns(list(rows[0]), where)
    if "label" not in rows[0]:
        raise DataError(f"{where} has no label column")
    raw = [str(r.get("label", "")).strip() for r in rows]
    if names is None:
        values = sorted(set(raw))
        numeric = all(re.fullmatch(r"\d+", v) for v in values)
        names = {v: int(v) for v in values} if numeric else {v: i for i, v in enumerate(values)}
    examples = []
    for n, (row, label) in enumerate(zip(rows, raw), 1):
        if label not in names:
            raise DataError(f"{where}: example {n} has label {label!r}, not one of the training labels {sorted(names)}")
        text = row.get(first)
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: example {n} has an empty {first!r}")
        examples.append((text, None if second is None else str(row.get(second) or ""), names[label]))
    return examples, names


def table_task(data: str) -> Labeled:
    """Examples from a CSV/TSV/JSONL file (10% held out) or a directory with train.* and valid.* tables."""
    if os.path.isdir(data):
        files = {os.path.splitext(f)[0]: os.path.join(data, f) for f in sorted(os.listdir(data))
                 if f.endswith(TABLE_SUFFIXES)}
        if "train" not in files:
            raise DataError(f"data directory {data!r} has no train.csv/.tsv/.jsonl")
        train, names = _examples(_rows(files["train"]), files["train"], None)
        valid_file = next((files[k] for k in ("valid", "validation", "dev", "test") if k in files), None)
        valid = _examples(_rows(valid_file), valid_file, names)[0] if valid_file else []
        if not valid:
            train, valid = _hold_out(train)
    else:
        train, names = _examples(_rows(data), data, None)
        train, valid = _hold_out(train)
    labels = [name for name, _ in sorted(names.items(), key=lambda kv: kv[1])]
    if len(names) < 2:
        raise DataError(f"--data {data!r} has a single class; classification needs at least two")
    return Labeled(os.path.basename(os.path.normpath(data)), train, valid, labels)


def hub_task(name: str) -> Labeled:
    """A hub dataset through `datasets`: `glue:cola`, `glue:qnli`, … or `path[:config]` with a label column."""
    ds = load_hub_dataset(name)
    path, _, config = name.partition(":")
    valid_split = GLUE_VALID.get(config) if path == "glue" else None
    valid_split = valid_split or next((s for s in ("validation", "valid", "test") if s in ds), None)
    if "train" not in ds or valid_split is None:
        raise DataError(f"hub dataset {name!r} needs a train and a validation split, has {', '.join(ds)}")
    features = ds["train"].features
    names = getattr(features.get("label"), "names", None)
    first, second = text_columns(ds["train"].column_names, f"hub dataset {name!r}")

    def convert(split: str) -> list:
        rows = ds[split]
        seconds = rows[second] if second else [None] * len(rows)
        return [(a, b, int(y)) for a, b, y in zip(rows[first], seconds, rows["label"]) if int(y) >= 0]

    train, valid = convert("train"), convert(valid_split)
    labels = list(names) if names else [str(i) for i in range(max(y for _, _, y in train) + 1)]
    return Labeled(name, train, valid, labels)


def load_labeled(data: str) -> Labeled:
    """Resolve `--data` for `--task classify`: a table file or directory, a hub dataset, or prose for the
    built-in acceptability task (`builtin`, a text file, or a directory of text files)."""
    if os.path.isfile(data) and data.endswith(TABLE_SUFFIXES):
        return table_task(data)
    if os.path.isdir(data) and any(f.startswith("train.") and f.endswith(TABLE_SUFFIXES) for f in os.listdir(data)):
        return table_task(data)
    if data == "builtin" or os.path.exists(data):
        return acceptability_task(data)
    if os.path.sep in data or data.startswith(".") or data.endswith(TABLE_SUFFIXES + (".txt",)):
        raise DataError(f"--data {data!r} does not exist")
    return hub_task(data)
