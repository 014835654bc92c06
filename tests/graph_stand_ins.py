"""CUDA graphs on the host, for tests: a capture that records the call and a replay that runs it again into the
captured outputs, as a CUDA graph does on a GPU (the `stand_in` fixture of tests/conftest.py; the fused-kernel tests
under Triton's interpreter install it in their own process)."""

import inspect
import weakref

from aqpipe.compress.gpu import cuda_graphs


class StandInGraph:
    """Replays `fn` on the captured buffers (and the held tensors, where they lie) into the captured outputs."""

    def __init__(self, fn, inputs, held, outputs):
        # (a CUDA graph keeps no reference to the Python function it was captured from: nor does this)
        self.fn = weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)
        self.inputs, self.held, self.outputs, self.replays = inputs, held, outputs, 0

    def replay(self):
        self.replays += 1
        cuda_graphs._capturing.now = True  # (a real replay runs no Python: nothing inside may capture)
        try:
            for out, value in zip(self.outputs, self.fn()(*self.inputs, *self.held)):
                out.copy_(value)
        finally:
            cuda_graphs._capturing.now = False


def install(captures: list, patch=setattr) -> None:
    """Make every device replay, with `StandInGraph`s as its captures (appended to `captures`); `patch(module,
    name, value)` sets each (a monkeypatch's setattr undoes them after a test)."""
    def capture(fn, tensors, passed=()):  # (`passed`: `graphed`'s addressed and held tensors, as they are)
        device = cuda_graphs._device_of(tensors + passed)
        inputs = tuple(cuda_graphs._copy_on(device, t) for t in tensors)  # (the graph's buffers, as a capture's)
        # a capture runs nothing: the outputs' buffers are made on copies of what `fn` writes in place (what `fn`
        # reaches through an address among its inputs it reaches all the same here: the replay after writes it again)
        graph = StandInGraph(fn, inputs, passed, tuple(fn(*inputs, *(t.clone() for t in passed))))
        captures.append(graph)
        return cuda_graphs._Graph(graph, inputs, graph.outputs)

    patch(cuda_graphs, "_replays_on", lambda device: True)
    patch(cuda_graphs, "_stream_id", lambda device: 0)
    patch(cuda_graphs, "_capture", capture)
