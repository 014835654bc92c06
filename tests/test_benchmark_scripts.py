"""Every benchmark script starts as its page shows it, `python benchmarks/NAME.py ...` from the checkout: run as a
file, Python puts benchmarks/ (not the checkout) first on the path, so a script that imports the `benchmarks`
package's helpers (models, provenance, codec_path) or the `tests` package's (simulated hosts) must put the checkout
on the path before that import."""

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# (the files run as `python benchmarks/NAME.py`; the rest are modules those scripts import)
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in path.read_text())


def _puts_the_checkout_on_the_path(node: ast.stmt) -> bool:
    """Whether a top-level statement is `sys.path.insert(...)`, `sys.path.append(...)` or `sys.path[...] = ...`."""
    if isinstance(node, ast.Assign):
        return any(isinstance(target, ast.Subscript) and ast.unparse(target.value) == "sys.path" for target in node.targets)
    call = node.value if isinstance(node, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in ("insert", "append")
            and ast.unparse(call.func.value) == "sys.path")


CHECKOUT_PACKAGES = ("benchmarks", "tests")  # importable only with the checkout on the path


def _imports_benchmarks(node: ast.stmt) -> bool:
    """Whether a top-level statement imports the `benchmarks` or `tests` package or one of their modules."""
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] in CHECKOUT_PACKAGES
    return isinstance(node, ast.Import) and any(alias.name.split(".")[0] in CHECKOUT_PACKAGES for alias in node.names)


def _starts(source: str) -> bool:
    """Whether a script of this source puts the checkout on the path before it imports from it (or never does)."""
    body = ast.parse(source).body
    first_import = next((i for i, node in enumerate(body) if _imports_benchmarks(node)), None)
    return first_import is None or any(_puts_the_checkout_on_the_path(node) for node in body[:first_import])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_a_script_that_imports_the_benchmarks_package_puts_the_checkout_on_the_path_first(script):
    assert _starts(script.read_text()), (
        f"benchmarks/{script.name} imports from the checkout before putting it on sys.path: "
        f"`python benchmarks/{script.name}` fails with ModuleNotFoundError")


def test_the_check_sees_the_scripts_and_a_script_that_would_not_start():
    assert len(SCRIPTS) >= 30
    assert any(_imports_benchmarks(node) for node in ast.parse((BENCHMARKS / "codec_speed.py").read_text()).body)
    assert not _starts("import sys\nfrom benchmarks.models import gpt2_6x128\nsys.path.insert(0, '..')\n")
    assert not _starts("from tests.hosts import simulated_hosts\n")
    assert _starts("import sys\nsys.path[:0] = ['..']\nfrom tests import hosts\n")
    assert _starts("import torch\n")
