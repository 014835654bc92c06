"""docs/troubleshooting.md covers every message a user may meet with exit code 2: each message the package raises
through an error class that the command line turns into exit 2 is found in the page by its leading words, and the
real command, given bad input, exits 2 with one line that the page explains."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "aqpipe"
PAGE = ROOT / "docs" / "troubleshooting.md"

# The error classes whose messages end as `aqpipe: error: <message>` and exit 2: ConfigError itself, and the classes
# the command line, the planner, the resume checks and the ranks' start-up turn into a ConfigError (the last test
# below finds every such conversion, so a new one cannot go unnoticed).
EXIT_2_CLASSES = frozenset({
    "ConfigError",  # aqpipe/config/values.py: the usage or configuration error itself
    "CodecError",  # --fw, --bw, --first-sight, --eval-codec (config/checks.py)
    "GradSpecError",  # --grad-sync (config/checks.py)
    "SpecError",  # --model, --partition, --lora (runtime/plan.py)
    "DataError",  # --data (runtime/plan.py)
    "CheckpointError",  # --resume and restarts (launch/job.py, under torchrun too)
    "InspectError",  # aqpipe store (cli.py; its DamagedStore is exit 1)
    "ReportError",  # aqpipe report (cli.py)
    "GenerateError",  # aqpipe generate (cli.py)
    "NetnsError",  # aqpipe netns, --bandwidth (cli.py, launch/job.py)
    "RendezvousConflict",  # torchrun's shared rendezvous store (runtime/rank/train.py)
    "HostDisagreement",  # hosts given different flags (runtime/rank/train.py)
    "TraceError",  # --dry-run of a model the planner cannot trace (cli.py)
})
NOT_EXIT_2 = frozenset({"DamagedStore"})  # an InspectError that `aqpipe store` reports as a finding, exit 1

# Functions whose returned (or ValueError) texts become an exit-2 message elsewhere: path -> function names.
BUILDERS = {
    "aqpipe/launch/netns.py": {"can_throttle"},  # ConfigError(problem): --bandwidth / aqpipe netns without root…
    "aqpipe/config/rates.py": {"parse_rate"},  # ValueError -> "--bandwidth: <why>"
    "aqpipe/runtime/capacity/plan.py": {"steps_outlasting_the_stall_timeout"},  # ConfigError(problem)
    "aqpipe/runtime/checkpoints/parts.py": {"changed_setting"},  # CheckpointError(changed), "--resume: <changed>"
    "aqpipe/runtime/checkpoints/copies.py": {"copy_plan"},  # ValueError -> ConfigError (checkpoints/store.py)
}

# Raise sites whose message is built elsewhere (no constant text at the site): (path, source of the argument). The
# text they carry is checked where it is built: a relayed exception at its own raise site, the rest in BUILDERS.
RELAYS = {
    ("aqpipe/cli.py", "str(e)"),  # InspectError, ReportError, GenerateError, NetnsError relayed as ConfigError
    ("aqpipe/cli.py", "problem.replace('--bandwidth needs', 'aqpipe netns needs')"),  # can_throttle()
    ("aqpipe/config/checks.py", "str(e)"),  # CodecError, GradSpecError
    ("aqpipe/runtime/plan.py", "str(e)"),  # SpecError, DataError
    ("aqpipe/runtime/rank/train.py", "str(e)"),  # RendezvousConflict, HostDisagreement
    ("aqpipe/launch/job.py", "str(e)"),  # CheckpointError
    ("aqpipe/launch/job.py", "str(damaged(steps[0], problem, run, older))"),  # a CheckpointError restart.py builds
    ("aqpipe/launch/netns.py", "problem"),  # can_throttle()
    ("aqpipe/runtime/capacity/plan.py", "problem"),  # steps_outlasting_the_stall_timeout()
    ("aqpipe/runtime/capacity/plan.py", "str(e)"),  # CodecError: a codec that cannot code the stages' activations
    ("aqpipe/runtime/checkpoints/parts.py", "changed"),  # changed_setting()
    ("aqpipe/runtime/checkpoints/store.py", "str(e)"),  # copy_plan()
    ("aqpipe/cli.py", "slow"),  # --dry-run: steps_outlasting_the_stall_timeout()
    # internal (see INTERNAL): a rank's decoder refusing a message
    ("aqpipe/compress/link/base.py", "self._raw_refusal()"),
    ("aqpipe/compress/link/sample_coders.py", "problem"),
}

# Messages no user input reaches as exit 2, by (path, leading words as `leading_words` gives them), and why.
INTERNAL = {
    # argparse admits only the commands `_command` dispatches
    ("aqpipe/cli.py", "'aqpipe ' is not a"),
    # _check_checkpoint is called only for a resumed run
    ("aqpipe/launch/job.py", "not a resumed run: there"),
    # a rank decoding a link message it cannot read: the two ends of a link disagree (a bug, or a damaged message);
    # the run fails with exit 1 naming the rank
    ("aqpipe/compress/link/checksum.py", "m(xi) diverged on link :"),
    ("aqpipe/compress/link/aqsgd.py", "m(xi) diverged: the sender sent"),
    ("aqpipe/compress/link/aqsgd_rows.py", "aqsgd payload has unknown sample"),
    ("aqpipe/compress/link/aqsgd_rows.py", "aqsgd payload of bytes does"),
    ("aqpipe/compress/link/aqsgd_rows.py", "the peer sends quantized first"),
    ("aqpipe/compress/link/floats.py", "payload arrived as"),
    ("aqpipe/compress/link/factory.py", "the codec needs a message"),
    ("aqpipe/compress/link/tahq.py", "a tahq payload of bytes"),
    ("aqpipe/compress/link/tahq.py", "a tahq payload ends inside"),
    ("aqpipe/compress/link/tahq.py", "a tahq sample marks of"),
    ("aqpipe/compress/link/topk.py", "topk positions fall outside the"),
    ("aqpipe/compress/link/topk.py", "topk bitmap does not mark"),
    # the planner's own check (a stage without the batch's inputs): relayed inside "the stages could not be traced"
    ("aqpipe/runtime/capacity/stage_trace.py", "the traced batch lacks the"),
    # aqpipe.partition called from Python; through `aqpipe launch` the configuration checks (--pp at least 1, no more
    # stages than layers, --partition's count of stages, every count at least 1) refuse first
    ("aqpipe/stages/partition.py", "the number of stages must"),
    ("aqpipe/stages/partition.py", "cannot split layers into stages:"),
    ("aqpipe/stages/partition.py", "every stage needs at least"),
    ("aqpipe/stages/partition.py", "the explicit partition lists stages"),
    ("aqpipe/stages/partition.py", "partition by time needs an"),
    ("aqpipe/stages/partition.py", "unknown partition method : use"),
}

WORDS = 5  # constant words from the start of a message that the page must hold, in order


def _pieces(node: ast.expr) -> list[str | None] | None:
    """A message expression as text pieces, None for each part computed at run time; None when nothing of it is
    written at the site (a name, a call)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _pieces(node.left), _pieces(node.right)
        if left is None and right is None:
            return None
        return (left or [None]) + (right or [None])
    return None


def leading_words(pieces: list[str | None]) -> list[str | None]:
    """The message's first WORDS constant words, a None where run-time text stands between them (none leading or
    trailing; backticks dropped, as Markdown shows them)."""
    text = "".join("\0" if p is None else p.replace("`", "") for p in pieces)
    out: list[str | None] = []
    for token in re.split(r"(\0)|\s+", text):
        if token is None or token == "":
            continue
        if token == "\0":
            if out and out[-1] is not None:
                out.append(None)
            continue
        out.append(token)
        if sum(w is not None for w in out) == WORDS:
            break
    while out and out[-1] is None:
        out.pop()
    return out


def key(words: list[str | None]) -> str:
    return " ".join(w for w in words if w is not None)


def pattern(words: list[str | None]) -> re.Pattern:
    """What finds the words in the page: runs of whitespace alike, any short text for a run-time part."""
    regex = ""
    for i, word in enumerate(words):
        if word is None:
            regex += r"\s*.{0,120}?\s*"
        else:
            regex += (r"\s+" if i and words[i - 1] is not None else "") + re.escape(word)
    return re.compile(regex)


def _raise_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def message_sites() -> list[tuple[str, int, list[str | None] | None, str]]:
    """(path, line, pieces or None, source of the message argument) of every message an exit-2 error class is built
    with, every text a BUILDERS function returns or raises, and every problem the capacity plan lists."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        builders = BUILDERS.get(rel, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and (
                    _raise_name(node) in EXIT_2_CLASSES
                    or (isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                        and ast.unparse(node.func.value) == "capacity.problems")):
                sites.append((rel, node.lineno, _pieces(node.args[0]), ast.unparse(node.args[0])))
            if isinstance(node, ast.FunctionDef) and node.name in builders:
                for inner in ast.walk(node):
                    value = None
                    if isinstance(inner, ast.Return) and inner.value is not None:
                        value = inner.value
                    elif isinstance(inner, ast.Raise) and isinstance(inner.exc, ast.Call) and inner.exc.args:
                        value = inner.exc.args[0]
                    if value is not None and _pieces(value) is not None:  # (a text; not a number, not None)
                        sites.append((rel, inner.lineno, _pieces(value), ast.unparse(value)))
    return sites


def page_text() -> str:
    """The page as one line of text, backticks dropped."""
    return " ".join(PAGE.read_text().replace("`", "").split())


def test_every_exit_2_message_is_in_the_troubleshooting_page():
    text = page_text()
    sites = message_sites()
    assert len(sites) > 200, f"found only {len(sites)} messages: is the scan still looking at the right classes?"
    missing, relays_seen, internal_seen = [], set(), set()
    for rel, line, pieces, source in sites:
        if pieces is None:
            assert (rel, source) in RELAYS, f"{rel}:{line}: message {source} is built elsewhere; add it to RELAYS"
            relays_seen.add((rel, source))
            continue
        words = leading_words(pieces)
        assert any(w is not None for w in words), f"{rel}:{line}: message {source} has no constant words"
        if (rel, key(words)) in INTERNAL:
            internal_seen.add((rel, key(words)))
            continue
        if not pattern(words).search(text):
            missing.append(f"{rel}:{line}: {key(words)!r}")
    assert not missing, "docs/troubleshooting.md does not explain:\n" + "\n".join(missing)
    assert RELAYS <= relays_seen, f"RELAYS lists sites that are gone: {sorted(RELAYS - relays_seen)}"
    assert INTERNAL <= internal_seen, f"INTERNAL lists messages that are gone: {sorted(INTERNAL - internal_seen)}"


def test_leading_words_of_f_strings_and_concatenations():
    expr = ast.parse('f"checkpoint file {path} is missing, see {x}" + "!"', mode="eval").body
    assert leading_words(_pieces(expr)) == ["checkpoint", "file", None, "is", "missing,", "see"]
    expr = ast.parse('f"--{name} {value!r} is not one of {allowed}"', mode="eval").body
    words = leading_words(_pieces(expr))
    assert words == ["--", None, "is", "not", "one", "of"]
    assert pattern(words).search("the message --<flag> <value> is not one of <choices>")
    assert not pattern(words).search("--<flag> <value> is one of <choices>")
    assert _pieces(ast.parse("str(e)", mode="eval").body) is None


def test_every_conversion_to_exit_2_is_of_a_known_class():
    """Each `except X: raise ConfigError(...)` catches a class listed above or a built-in error whose text is
    formatted at the site or checked in BUILDERS: a new conversion must say which messages it brings."""
    builtins = {"OSError", "ValueError", "FileNotFoundError", "TypeError", "KeyError", "Exception"}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ExceptHandler) or node.type is None:
                continue
            raised = {_raise_name(r.exc) for b in node.body for r in ast.walk(b)
                      if isinstance(r, ast.Raise) and isinstance(r.exc, ast.Call)}
            if "ConfigError" not in raised:
                continue
            types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            for caught in types:
                name = caught.attr if isinstance(caught, ast.Attribute) else getattr(caught, "id", "")
                assert name in EXIT_2_CLASSES | builtins, f"{path.relative_to(ROOT)}:{node.lineno} turns {name} into exit 2"


def run_aqpipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "aqpipe", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=60)


def page_messages() -> list[str]:
    """The messages the page explains: the code spans in the first cell of its tables' rows."""
    found = []
    for row in PAGE.read_text().splitlines():
        if row.startswith("| `"):
            first_cell = re.split(r"(?<!\\)\|", row)[1]
            found += re.findall(r"`([^`]+)`", first_cell)
    return found


def template(message: str) -> re.Pattern:
    """A message as the page writes it, as a pattern of the line itself: `<...>` and `…` stand for any text."""
    regex = ""
    for part in re.split(r"(<[^>]+>|…)", message):
        if re.fullmatch(r"<[^>]+>|…", part):
            regex += ".+?"
        else:
            regex += r"\s+".join(re.escape(word) for word in part.split(" "))
    return re.compile(regex)


def explained(line: str) -> bool:
    """Whether one of the page's messages is the error line, from its first word on."""
    message = line.removeprefix("aqpipe: error: ")
    return any(template(m).match(message) for m in page_messages())


def test_the_page_lists_its_messages_in_tables():
    messages = page_messages()
    assert len(messages) > 200, len(messages)
    assert explained("aqpipe: error: --pp must be at least 1, got 0")
    assert not explained("aqpipe: error: --pp must be at most 1, got 0")


@pytest.mark.parametrize("args,needle", [
    (["launch", "--pp", "0"], "--pp must be at least 1"),
    (["launch", "--fw", "zip"], "is not a forward codec"),
    (["launch", "--grad-sync", "gzip"], "is not a gradient compressor"),
    (["launch", "--resume", "{tmp}"], "has no config.json"),
    (["report", "{tmp}"], "no metrics.jsonl"),
    (["launch", "--no-such-flag"], "unrecognized arguments"),
])
def test_bad_input_exits_2_with_one_line_the_page_explains(tmp_path, args, needle):
    proc = run_aqpipe([a.replace("{tmp}", str(tmp_path)) for a in args], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("aqpipe: error: ") and needle in lines[0], proc.stderr
    assert explained(lines[0]), f"docs/troubleshooting.md does not explain: {lines[0]}"
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "runs").exists()
