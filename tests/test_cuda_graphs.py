"""When a codec's kernels run op by op and when they replay a graph: the cache's rules, checked on the host with a
stand-in capture (the GPU tests replay real CUDA graphs and compare their bits with op by op)."""

import logging

import pytest
import torch

from aqpipe.compress import cuda_graphs
from aqpipe.compress.cuda_graphs import graphed


class StandInGraph:
    """Replays `fn` on the captured buffers into the captured outputs, as a CUDA graph does on a GPU."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.inputs, self.outputs, self.replays = fn, inputs, outputs, 0

    def replay(self):
        self.replays += 1
        cuda_graphs._capturing.now = True  # (a real replay runs no Python: nothing inside may capture)
        try:
            for out, value in zip(self.outputs, self.fn(*self.inputs)):
                out.copy_(value)
        finally:
            cuda_graphs._capturing.now = False


@pytest.fixture
def stand_in(monkeypatch):
    """Graphs on the host: every device replays, and a capture is a `StandInGraph`; returns the captures made."""
    captures = []

    def capture(fn, tensors):
        inputs = tuple(t.clone() for t in tensors)
        graph = StandInGraph(fn, inputs, tuple(fn(*inputs)))
        captures.append(graph)
        return cuda_graphs._Graph(graph, inputs, graph.outputs)

    cuda_graphs.clear()
    monkeypatch.setattr(cuda_graphs, "_replays_on", lambda device: True)
    monkeypatch.setattr(cuda_graphs, "_stream_id", lambda device: 0)
    monkeypatch.setattr(cuda_graphs, "_capture", capture)
    monkeypatch.delenv(cuda_graphs.SWITCH, raising=False)
    yield captures
    cuda_graphs.clear()


class Counted:
    """A pure function that counts its op-by-op runs."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, y):
        self.calls += 1
        return x * 2 + y, (x - y).sum(dim=1)


def test_the_first_call_runs_op_by_op_the_second_captures_and_later_ones_replay(stand_in):
    fn = Counted()
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    first = graphed("k", fn, x, y)
    assert fn.calls == 1 and not stand_in
    second = graphed("k", fn, x + 1, y)
    assert len(stand_in) == 1 and stand_in[0].replays == 1
    calls = fn.calls
    third = graphed("k", fn, x - 1, y)
    assert fn.calls == calls + 1 and stand_in[0].replays == 2  # one run: the replay itself, no capture again
    for got, inputs in ((first, (x, y)), (second, (x + 1, y)), (third, (x - 1, y))):
        for a, b in zip(got, fn(*inputs)):
            assert torch.equal(a, b)
    assert cuda_graphs.captured() == 1


def test_what_a_replay_returns_is_the_callers_own(stand_in):
    fn = Counted()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    for _ in range(2):
        graphed("k", fn, x, y)
    kept = graphed("k", fn, x, y)
    expected = [t.clone() for t in kept]
    graphed("k", fn, x * 3, y)  # the next replay writes the graph's outputs again
    assert all(torch.equal(a, b) for a, b in zip(kept, expected))
    kept[0].zero_()  # and writing what was returned leaves the graph's buffers alone
    assert not torch.equal(stand_in[0].outputs[0], kept[0])


def test_each_key_shape_and_dtype_gets_its_own_graph(stand_in):
    fn = Counted()
    calls = [("a", torch.randn(2, 4)), ("b", torch.randn(2, 4)), ("a", torch.randn(3, 4)),
             ("a", torch.randn(2, 4, dtype=torch.float64)), ("a", torch.randn(4, 2).t())]
    for key, x in calls:
        for _ in range(2):
            graphed(key, fn, x, x)
    assert len(stand_in) == len(calls) == cuda_graphs.captured()


def test_a_capture_that_fails_leaves_that_signature_op_by_op_with_a_warning(stand_in, monkeypatch, caplog):
    def failing(fn, tensors):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "_capture", failing)
    fn = Counted()
    x = torch.randn(2, 3)
    with caplog.at_level(logging.WARNING, logger="aqpipe.compress.cuda_graphs"):
        results = [graphed("k", fn, x, x) for _ in range(4)]
    assert fn.calls == 4 and cuda_graphs.captured() == 0
    assert [r.message for r in caplog.records if "capture failed" in r.message] and len(caplog.records) == 1
    assert all(torch.equal(r[0], x * 3) for r in results)


def test_the_switch_turns_every_graph_off(stand_in, monkeypatch):
    monkeypatch.setenv(cuda_graphs.SWITCH, "0")
    fn = Counted()
    for _ in range(3):
        graphed("k", fn, torch.ones(2, 2), torch.ones(2, 2))
    assert fn.calls == 3 and not stand_in


def test_a_graphed_call_inside_a_capture_becomes_part_of_it(stand_in):
    inner = Counted()

    def outer(x, y):
        a, b = graphed("inner", inner, x, y)
        return a + 1, b

    x = torch.randn(2, 3)
    for _ in range(4):
        graphed("outer", outer, x, x)
    assert len(stand_in) == 1  # the outer one only: the inner calls ran inline in it
    assert cuda_graphs.captured() == 1


def test_past_the_limit_new_signatures_run_op_by_op(stand_in, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 2)
    fn = Counted()
    for n in range(1, 5):
        for _ in range(3):
            graphed("k", fn, torch.ones(n, 2), torch.ones(n, 2))
    assert cuda_graphs.captured() == 2 and len(stand_in) == 2


def test_on_the_host_the_function_just_runs():
    fn = Counted()
    for _ in range(3):
        graphed("k", fn, torch.ones(2, 2), torch.ones(2, 2))
    assert fn.calls == 3 and cuda_graphs.captured() == 0
