"""Fixtures the tests share."""

import pytest

from aqpipe.compress.gpu import cuda_graphs
from tests.graph_stand_ins import install


@pytest.fixture
def stand_in(monkeypatch):
    """Graphs on the host: every device replays, and a capture is a `StandInGraph`; returns the captures made."""
    captures = []
    cuda_graphs.clear()
    install(captures, monkeypatch.setattr)
    monkeypatch.delenv(cuda_graphs.SWITCH, raising=False)
    yield captures
    cuda_graphs.clear()
