"""The package's rooms import each other one way: no cycle between packages (or top-level modules), function-level
imports included."""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aqpipe"


def room_of(module: str) -> str:
    """aqpipe.pipeline.worker -> pipeline; aqpipe.cli -> cli."""
    return module.split(".")[1] if "." in module else "aqpipe"


def import_arrows() -> dict[tuple[str, str], set[str]]:
    """(room, room it imports) -> the files that import it."""
    arrows: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        source = parts[1] if len(parts) > 1 and parts[1] not in ("__init__", "__main__") else "aqpipe"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("aqpipe.") and room_of(name) != source:
                    arrows[(source, room_of(name))].add(str(path.relative_to(PACKAGE.parent)))
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
    arrows = import_arrows()
    found = cycles(arrows)
    detail = [f"{a} -> {b}: {sorted(files)}" for group in found for (a, b), files in arrows.items()
              if a in group and b in group]
    assert not found, detail


def test_the_check_sees_a_cycle():
    assert cycles({("a", "b"): set(), ("b", "c"): set(), ("c", "a"): set(), ("c", "d"): set()}) == [["a", "b", "c"]]


def test_the_engine_knows_nothing_of_configuration_or_launching():
    arrows = import_arrows()
    assert not {b for a, b in arrows if a == "pipeline"} & {"config", "runtime", "launch", "cli", "api", "bench"}
    assert not {b for a, b in arrows if a == "config"} & {"runtime", "launch", "cli", "api", "bench"}
