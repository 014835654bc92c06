"""Text corpora: the built-in one (Python's own bundled documentation), local files and directories, hub datasets."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass


class DataError(ValueError):
    """Data that cannot be found or read."""


@dataclass(frozen=True)
class Corpus:
    """Raw training and validation text."""

    name: str
    train: str
    valid: str


def builtin_corpus() -> Corpus:
    """Python's bundled pydoc topics (about 0.5 MB of English prose and code), available on any install.

    Every tenth paragraph, in sorted topic order, is held out for validation.
    """
    from pydoc_data.topics import topics

    paragraphs = [p for k in sorted(topics) for p in topics[k].split("\n\n") if p.strip()]
    train = "\n\n".join(p for i, p in enumerate(paragraphs) if i % 10 != 9)
    valid = "\n\n".join(p for i, p in enumerate(paragraphs) if i % 10 == 9)
    return Corpus("builtin", train, valid)


BINARY_SNIFF_BYTES = 8192


def _read(path: str) -> str:
    """A text file's content; a binary file (NUL bytes, or mostly bytes that are not UTF-8 text) is refused."""
    try:
        with open(path, "rb") as f:
            head = f.read(BINARY_SNIFF_BYTES)
            if looks_binary(head):
                raise DataError(f"data file {path!r} is not text (it holds NUL or non-UTF-8 bytes, like an executable "
                                "or an archive); give a UTF-8 text file, a directory of them, or a dataset name")
            return (head + f.read()).decode("utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"cannot read data file {path!r}: {e.strerror}") from None


def looks_binary(head: bytes) -> bool:
    """True for the first bytes of a file that is not text: any NUL, or over 10% undecodable as UTF-8."""
    if b"\0" in head:
        return True
    text = head.decode("utf-8", errors="replace")
    return text.count("\ufffd") > 0.1 * max(1, len(text)) + 3  # a multi-byte character cut at the edge is fine


def _first(directory: str, stems: tuple[str, ...]) -> str | None:
    for stem in stems:
        matches = sorted(glob.glob(os.path.join(directory, f"{stem}.*")) + glob.glob(os.path.join(directory, stem)))
        matches = [m for m in matches if os.path.isfile(m)]
        if matches:
            return matches[0]
    return None


def file_corpus(path: str) -> Corpus:
    """One text file; its last 10% of lines are held out for validation."""
    lines = _read(path).splitlines(keepends=True)
    if not "".join(lines).strip():
        raise DataError(f"data file {path!r} is empty")
    cut = max(1, int(len(lines) * 0.9)) if len(lines) > 1 else len(lines)
    return Corpus(os.path.basename(path), "".join(lines[:cut]), "".join(lines[cut:]))


def directory_corpus(directory: str) -> Corpus:
    """A directory with `train.*` and `valid.*` (or `validation.*`, `test.*`) text files."""
    train = _first(directory, ("train",))
    if train is None:
        raise DataError(f"data directory {directory!r} has no train.* file")
    valid = _first(directory, ("valid", "validation", "test"))
    text = _read(train)
    if not text.strip():
        raise DataError(f"{train!r} is empty")
    return Corpus(os.path.basename(os.path.normpath(directory)), text, _read(valid) if valid else "")


def load_hub_dataset(name: str):
    """`datasets.load_dataset` of `name` or `name:config`; any failure (no `datasets`, offline, unknown) a DataError."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"--data {name!r} looks like a hub dataset; install the 'hub' extra (pip install datasets)") from None
    path, _, config = name.partition(":")
    try:
        return datasets.load_dataset(path, config or None)
    except Exception as e:  # noqa: BLE001 - offline, unknown name, …
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"cannot load hub dataset {name!r}: {type(e).__name__}: {first}") from None


def hub_corpus(name: str) -> Corpus:
    """A dataset from the Hugging Face hub via `datasets`: `name` or `name:config`, using its `text` column."""
    ds = load_hub_dataset(name)
    if "train" not in ds:
        raise DataError(f"hub dataset {name!r} has no train split")
    column = "text" if "text" in ds["train"].column_names else ds["train"].column_names[0]
    valid_split = next((s for s in ("validation", "valid", "test") if s in ds), None)
    valid = "\n".join(ds[valid_split][column]) if valid_split else ""
    return Corpus(name, "\n".join(ds["train"][column]), valid)


def load_corpus(data: str) -> Corpus:
    """Resolve `--data`: builtin, a text file, a directory, or a hub dataset name."""
    if data == "builtin":
        return builtin_corpus()
    if os.path.isdir(data):
        return directory_corpus(data)
    if os.path.isfile(data):
        return file_corpus(data)
    if os.path.sep in data or data.startswith(".") or os.path.splitext(data)[1] in (".txt", ".text", ".raw"):
        raise DataError(f"--data {data!r} does not exist")
    return hub_corpus(data)
