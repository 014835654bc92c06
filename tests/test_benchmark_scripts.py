"""Every benchmark script starts as its page shows it, `python benchmarks/NAME.py ...` from the checkout: run as a
file, Python puts benchmarks/ (not the checkout) first on the path, so a script that imports the `benchmarks`
package's helpers (models, provenance, codec_path) must put the checkout on the path before that import."""

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if path.name != "__init__.py")


def _puts_the_checkout_on_the_path(node: ast.stmt) -> bool:
    """Whether a top-level statement is `sys.path.insert(...)` or `sys.path.append(...)`."""
    call = node.value if isinstance(node, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in ("insert", "append")
            and ast.unparse(call.func.value) == "sys.path")


def _imports_benchmarks(node: ast.stmt) -> bool:
    """Whether a top-level statement imports the `benchmarks` package or one of its modules."""
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "benchmarks"
    return isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "benchmarks" for alias in node.names)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_a_script_that_imports_the_benchmarks_package_puts_the_checkout_on_the_path_first(script):
    body = ast.parse(script.read_text()).body
    first_import = next((i for i, node in enumerate(body) if _imports_benchmarks(node)), None)
    if first_import is None:
        return
    assert any(_puts_the_checkout_on_the_path(node) for node in body[:first_import]), (
        f"benchmarks/{script.name} imports the benchmarks package before putting the checkout on sys.path: "
        f"`python benchmarks/{script.name}` fails with ModuleNotFoundError")


def test_the_check_sees_the_scripts():
    assert len(SCRIPTS) >= 30
    assert any(_imports_benchmarks(node) for node in ast.parse((BENCHMARKS / "codec_speed.py").read_text()).body)
