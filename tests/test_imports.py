"""The package's rooms import each other one way, at every level: no cycle between the sub-packages and modules of
any one package (the top-level packages and modules of `aqpipe`, the rooms of `pipeline/` and of `compress/`, ...),
function-level imports included; and the top-level rooms only downward, on the floors docs/architecture.md lists."""

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aqpipe"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name: aqpipe.pipeline -> its __init__.py)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The modules of the package an import statement loads (`from a.b import c` loads a.b.c where that is a
    module, else a.b)."""
    if isinstance(node, ast.ImportFrom) and node.module:
        names = [f"{node.module}.{alias.name}" for alias in node.names]
        return [name if name in known else node.module for name in names]
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return []


def room_of(module: str, within: str) -> str | None:
    """The child of package `within` that holds `module` (aqpipe.pipeline.execution.worker within aqpipe ->
    pipeline, within aqpipe.pipeline -> execution); None where `module` is not below `within`. The package's own
    __init__ and __main__ are one room, named after the package (aqpipe.cli within aqpipe -> cli; aqpipe -> aqpipe)."""
    if not module.startswith(within + "."):
        return within.rsplit(".", 1)[-1] if module == within else None
    child = module[len(within) + 1:].split(".")[0]
    return within.rsplit(".", 1)[-1] if child == "__main__" else child


def import_arrows(within: str = "aqpipe") -> dict[tuple[str, str], set[str]]:
    """(room, room it imports) -> the files that import it, the rooms being the children of package `within`."""
    known = modules()
    arrows: dict[tuple[str, str], set[str]] = defaultdict(set)
    for module, path in known.items():
        source = room_of(module, within)
        if source is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for name in imported(node, known):
                target = room_of(name, within)
                if target is not None and target != source:
                    arrows[(source, target)].add(str(path.relative_to(PACKAGE.parent)))
    return arrows


def cycles(arrows) -> list[list[str]]:
    """The strongly connected groups of more than one room."""
    graph = defaultdict(set)
    for a, b in arrows:
        graph[a].add(b)
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in list(graph):
        if v not in order:
            visit(v)
    return found


def test_no_two_rooms_import_each_other():
    detail = []
    for package in sorted(name for name, path in modules().items() if path.name == "__init__.py"):
        arrows = import_arrows(package)
        detail += [f"{package}: {a} -> {b}: {sorted(files)}" for group in cycles(arrows)
                   for (a, b), files in arrows.items() if a in group and b in group]
    assert not detail, detail


def test_the_check_sees_rooms_inside_a_package():
    arrows = import_arrows("aqpipe.pipeline")
    assert ("execution", "links") in arrows and ("links", "world") in arrows
    assert not {b for a, b in arrows if a == "world"} & {"links", "numerics", "execution"}
    assert ("execution", "vocab") in arrows and not {b for a, b in arrows if a == "vocab"}  # the bottom room


def test_the_check_sees_a_cycle():
    assert cycles({("a", "b"): set(), ("b", "c"): set(), ("c", "a"): set(), ("c", "d"): set()}) == [["a", "b", "c"]]


def test_the_engine_knows_nothing_of_configuration_or_launching():
    arrows = import_arrows()
    assert not {b for a, b in arrows if a == "pipeline"} & {"config", "runtime", "launch", "cli", "api", "bench"}
    assert not {b for a, b in arrows if a == "config"} & {"runtime", "launch", "cli", "api", "bench"}


def floors() -> dict[str, int]:
    """The top-level rooms by floor (1 the top), as docs/architecture.md's numbered list under "Layout" gives them
    (`x/` and `x.py` are room x; `__init__.py` and `__main__.py` the package's own room, `aqpipe`)."""
    layout = ARCHITECTURE.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    found: dict[str, int] = {}
    for floor, names in re.findall(r"^(\d+)\. (.*)$", layout, re.M):
        for name in re.findall(r"`([\w.]+/?)`", names.split(" — ")[0]):
            room = name.rstrip("/").removesuffix(".py")
            room = "aqpipe" if room in ("__init__", "__main__") else room
            assert found.get(room, int(floor)) == int(floor), f"docs/architecture.md puts {room} on two floors"
            found[room] = int(floor)
    return found


def upward(arrows, levels: dict[str, int]) -> list[str]:
    """The arrows that do not go down a floor, each with the files that draw it."""
    return [f"{a} (floor {levels[a]}) -> {b} (floor {levels[b]}): {sorted(files)}"
            for (a, b), files in arrows.items() if levels[b] <= levels[a]]


def test_every_top_level_room_imports_only_rooms_on_lower_floors():
    levels = floors()
    rooms = {room_of(module, "aqpipe") for module in modules()}
    assert rooms == set(levels), f"rooms without a floor in docs/architecture.md: {sorted(rooms - set(levels))}; " \
                                 f"floors naming no room: {sorted(set(levels) - rooms)}"
    assert not upward(import_arrows(), levels), upward(import_arrows(), levels)


def test_the_floor_check_sees_an_import_upward():
    levels = floors()
    assert levels["cli"] < levels["launch"] < levels["runtime"] < levels["pipeline"] < levels["compress"]
    assert levels["aqpipe"] == 1 and len(set(levels.values())) == max(levels.values())
    assert upward({("compress", "pipeline"): {"x.py"}, ("cli", "launch"): set()}, levels) == [
        f"compress (floor {levels['compress']}) -> pipeline (floor {levels['pipeline']}): ['x.py']"]
    assert upward({("data", "storage"): set()}, levels)  # (one floor: neither may import the other)
