"""A built-in instruction set made from documentation every Python install carries: real questions about Python's
built-ins, standard-library modules and functions, statements and Unicode characters, each with the answer its own
documentation gives.

Held-out examples never appear in training: an answer (normalised) belongs to one split only, chosen by a hash of
the answer, so aliases that share a docstring (os.path.join / posixpath.join) cannot leak across.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import re
import sys
import unicodedata
import warnings
import zlib

# Modules whose public functions and classes become questions (imported only to read their docstrings).
FUNCTION_MODULES = (
    "math", "cmath", "statistics", "random", "os", "os.path", "shutil", "glob", "fnmatch", "string", "textwrap", "re",
    "json", "csv", "itertools", "functools", "operator", "collections", "heapq", "bisect", "copy", "datetime", "time",
    "calendar", "base64", "binascii", "hashlib", "hmac", "secrets", "zlib", "gzip", "struct", "difflib", "html",
    "urllib.parse", "uuid", "ipaddress", "fractions", "decimal", "array", "enum", "dataclasses", "contextlib", "abc",
    "weakref", "tempfile", "threading", "queue", "logging", "argparse", "locale", "platform", "sysconfig",
    "traceback", "warnings", "io", "codecs", "pathlib", "inspect", "pprint", "keyword", "unicodedata", "typing",
    "zipfile", "tarfile", "sqlite3", "subprocess", "socket", "select", "signal", "errno", "stat", "email.utils",
    "shlex", "getpass", "gettext", "mimetypes", "quopri", "colorsys", "graphlib", "numbers", "reprlib", "sched",
    "timeit", "tokenize", "ast", "dis", "pickle", "copyreg", "shelve", "dbm", "filecmp", "fileinput", "linecache",
)
# Statements and topics of the pydoc topic index asked about as "the `X` statement".
STATEMENTS = ("assert", "assignment", "async", "break", "class", "continue", "del", "exec", "for", "function",
              "global", "if", "import", "lambda", "nonlocal", "pass", "raise", "return", "try", "while", "with",
              "yield", "augassign", "conditional", "comparisons", "booleans", "slicings", "subscriptions")
# Unicode blocks whose named characters become "what is this character" questions.
UNICODE_RANGES = ((0x00C0, 0x0180), (0x0391, 0x03CA), (0x2190, 0x21A0), (0x2200, 0x2240), (0x20A0, 0x20C0),
                  (0x2600, 0x2620))
MAX_ANSWER_CHARS = 400
VALID_SHARE = 20  # one answer in 20 is held out


def first_paragraph(doc: str | None, limit: int = MAX_ANSWER_CHARS) -> str:
    """The first paragraph of a docstring, on one line, cut after a sentence when it is longer than `limit`."""
    if not doc:
        return ""
    paragraphs = [" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n") if p.strip()]
    if not paragraphs:
        return ""
    text = paragraphs[0]
    if re.fullmatch(r"[\w.]+\(.*\)( -> .*)?", text) and len(paragraphs) > 1:  # a C function's signature line
        text = paragraphs[1]
    if len(text) > limit:
        cut = text.rfind(". ", 0, limit)
        text = text[:cut + 1] if cut > 40 else text[:limit].rsplit(" ", 1)[0] + " …"
    return text


def from_stdlib(obj) -> bool:
    """Whether `obj` is the standard library's own (a test runner or a library may have replaced a module attribute,
    like pytest's threading.excepthook; the data must not depend on what the process imported)."""
    module = getattr(obj, "__module__", None) or "builtins"
    return module.split(".")[0].lstrip("_") in sys.stdlib_module_names or module.split(".")[0] in sys.stdlib_module_names


def _builtin_questions() -> list[tuple[str, str]]:
    out = []
    for name in sorted(dir(builtins)):
        obj = getattr(builtins, name)
        if name.startswith("_") or not callable(obj) or not from_stdlib(obj) or (
                isinstance(obj, type) and issubclass(obj, BaseException)):
            continue
        answer = first_paragraph(obj.__doc__)
        if answer:
            out.append((f"What does Python's built-in `{name}` do?", answer))
    return out


def _module_questions() -> list[tuple[str, str]]:
    out = []
    for module_name in FUNCTION_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - a module this install lacks (sqlite3, dbm) asks nothing
            continue
        summary = first_paragraph(module.__doc__)
        if summary:
            out.append((f"What is the Python standard library module `{module_name}` for?", summary))
        public = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        for name in sorted(set(public)):
            obj = getattr(module, name, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)) or not from_stdlib(obj):
                continue
            if name.endswith("hook"):  # hooks are what runtimes replace (pytest sets threading.excepthook)
                continue
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue
            answer = first_paragraph(obj.__doc__)
            if answer:
                out.append((f"What does `{module_name}.{name}` do in Python?", answer))
    return out


def _statement_questions() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    out = []
    for name in STATEMENTS:
        text = topics.get(name)
        if not text:
            continue
        paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
        prose = [p for p in paragraphs[1:] if len(p) > 60 and not p.startswith(("*", "::"))]
        if prose:
            out.append((f"Explain the Python `{name}` statement or topic.", first_paragraph(prose[0])))
    return out


def _unicode_questions() -> list[tuple[str, str]]:
    out = []
    for start, end in UNICODE_RANGES:
        for code in range(start, end):
            name = unicodedata.name(chr(code), "")
            if name:
                out.append((f"What is the Unicode name of the character '{chr(code)}'?",
                            f"'{chr(code)}' is U+{code:04X}, {name}."))
    return out


def builtin_instructions() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(question, answer) pairs for training and for validation; the same on every run of one Python install."""
    seen_questions: set[str] = set()
    train: list[tuple[str, str]] = []
    valid: list[tuple[str, str]] = []
    for question, answer in _builtin_questions() + _module_questions() + _statement_questions() + _unicode_questions():
        if question in seen_questions:
            continue
        seen_questions.add(question)
        key = " ".join(answer.lower().split())
        (valid if zlib.crc32(key.encode()) % VALID_SHARE == 0 else train).append((question, answer))
    return train, valid
