"""The tensors a codec's CUDA graph does not copy: `held` ones (a slab of m(ξ)), read and written where they lie, whose
moves get the call a new graph, and `addressed` ones (an activation), reached where they lie at each call through an
address among the graph's inputs. Checked on the host with a stand-in capture (the `stand_in` fixture,
tests/conftest.py); tests/test_cuda_graphs.py has the cache's other rules."""

import torch

from aqpipe.compress.gpu import cuda_graphs
from aqpipe.compress.gpu.cuda_graphs import graphed


def test_held_tensors_are_read_and_written_where_they_lie_once_a_call_and_a_moved_one_gets_a_new_graph(stand_in):
    """A `held` tensor (a slab of m(ξ) a step writes in place) is never copied: each call — op by op, captured and
    replayed, or replayed — writes it once, and a caller sees the write at once. Its address is part of the
    signature: a slab that grew and moved gets a graph of its own, which replaces the old one's."""
    def bump(x, slab):
        slab.add_(x)
        return (slab.sum(dim=0),)

    slab, x = torch.zeros(3, 4), torch.ones(4)
    sums = [graphed("step", bump, x, held=(slab,))[0].clone() for _ in range(4)]
    assert torch.equal(slab, torch.full((3, 4), 4.0))  # one write a call, none of them twice
    assert [s[0].item() for s in sums] == [3.0, 6.0, 9.0, 12.0]
    assert len(stand_in) == 1 and stand_in[0].replays == 3
    grown = torch.zeros(5, 4)
    for _ in range(3):
        graphed("step", bump, x, held=(grown,))
    assert torch.equal(grown, torch.full((5, 4), 3.0)) and torch.equal(slab, torch.full((3, 4), 4.0))
    assert len(stand_in) == 2 and cuda_graphs.captured() == 1  # (the graph over the old slab dropped)
    other = torch.zeros(3, 2, 4)
    for _ in range(2):  # another input shape: a graph of its own, beside the other's
        graphed("step", bump, torch.ones(2, 4), held=(other,))
    assert len(stand_in) == 3 and cuda_graphs.captured() == 2


def test_a_held_signatures_first_call_runs_on_copies_of_its_inputs_as_its_capture_will(stand_in):
    """A capture over held tensors runs no warm-up (it would write them twice), so the signature's first call, op by
    op, must be the one that makes what the capture needs: it runs on fresh copies of the other inputs, as the
    capture does (a Triton kernel is compiled per alignment of its pointers: rows at an odd offset in a payload
    would otherwise first meet their aligned copy inside the capture, and compile there). A call without held
    tensors runs on what it was given."""
    given = []

    def bump(x, slab):
        given.append(x.data_ptr())
        slab.add_(x)
        return (slab.sum(dim=0),)

    payload = torch.ones(5, 4)
    rows, slab = payload[1:], torch.zeros(4, 4)  # (rows at an offset into their payload)
    graphed("held", bump, rows, held=(slab,))
    assert given[-1] != rows.data_ptr() and torch.equal(slab, torch.ones(4, 4))
    graphed("plain", lambda x: (given.append(x.data_ptr()) or x * 2,), rows)
    assert given[-1] == rows.data_ptr()


def test_past_the_limit_a_moved_slab_still_replaces_its_graph_and_held_calls_copy_only_at_first(stand_in, monkeypatch):
    """At `MAX_GRAPHS`, a graph over a slab that moved still replaces the old one (the count does not grow, and the
    old one's memory is the store's no longer); a new signature past the limit runs op by op, on copies of its
    inputs at its first call only (what a capture would need; later calls need nothing)."""
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 1)
    given = []

    def bump(x, slab):
        given.append(x.data_ptr())
        slab.add_(x)
        return (slab.sum(dim=0),)

    x = torch.ones(4)
    for slab in (torch.zeros(3, 4), torch.zeros(5, 4)):  # (the second: the slab grown)
        for _ in range(3):
            graphed("step", bump, x, held=(slab,))
        assert torch.equal(slab, torch.full(slab.shape, 3.0))
    assert len(stand_in) == 2 and cuda_graphs.captured() == 1
    other, y = torch.zeros(3, 2, 4), torch.ones(2, 4)
    given.clear()
    for _ in range(3):
        graphed("step", bump, y, held=(other,))
    assert len(stand_in) == 2 and torch.equal(other, torch.full((3, 2, 4), 3.0))
    assert given[0] != y.data_ptr() and given[1:] == [y.data_ptr()] * 2


def test_an_addressed_tensor_is_reached_where_it_lies_at_each_call_and_moving_it_captures_nothing_new(stand_in):
    """`addressed` tensors (AQ-SGD's activation, or the place its decoded activation goes) are given to `fn` as they
    are, never copied into a buffer of the graph's, and not named by their address: a call on a tensor elsewhere
    replays the same graph, which reaches it through the address fed among its inputs (a registry stands in for
    memory here; the fused kernels move their pointer). Their layouts name the graph, and so does each one's offset
    from a 64-byte boundary (Triton compiles a kernel per alignment of its pointers, and the fused kernels take the
    shift as a multiple of 64 bytes)."""
    placed: dict[int, torch.Tensor] = {}
    given = []

    def step(index, x, slab):
        given.append(x.data_ptr())
        real = placed[int(index[-1])]  # (as a kernel does: the tensor at the address its index ends with)
        slab.add_(real.sum(dim=0))
        return (real * 2,)

    def call(x, slab):
        placed[x.data_ptr()] = x
        return graphed("moved", step, torch.tensor([0, x.data_ptr()]), addressed=(x,), held=(slab,))[0].clone()

    slab, xs = torch.zeros(4), [torch.full((3, 4), float(k)) for k in range(4)]  # (all alive: four addresses)
    outs = [call(x, slab) for x in xs]
    assert [out[0, 0].item() for out in outs] == [0.0, 2.0, 4.0, 6.0]
    assert torch.equal(slab, torch.full((4,), 18.0))  # (each call wrote the held slab once)
    assert len(stand_in) == 1 and stand_in[0].replays == 3  # captured at the second call, replayed from then on
    assert given[0] == xs[0].data_ptr() and given[-1] == xs[1].data_ptr()  # as it was: the capture's, moved
    assert [tuple(t.shape) for t in stand_in[0].inputs] == [(2,)]  # (the graph's buffers: the index alone)
    off = torch.zeros(13)[1:].view(3, 4)  # (4 bytes past a boundary)
    for _ in range(2):
        call(off, slab)
    assert len(stand_in) == 2
    for _ in range(2):  # (another layout)
        call(torch.ones(2, 4), slab)
    assert len(stand_in) == 3 and cuda_graphs.captured() == 3


def test_a_moved_slab_drops_its_graphs_at_every_offset_and_addressed_calls_need_no_held_tensor(stand_in, monkeypatch):
    """A slab that moved drops the graphs of the same call over the old slab at every offset of its addressed
    tensors, not only the offset of the call that found it moved (they read and write memory no longer the slab's).
    A call with addressed tensors and none held captures and replays as well, its first call getting them as they
    are; with graphs switched off every call gets them as they are, and nothing is captured."""
    placed: dict[int, torch.Tensor] = {}
    given = []

    def step(index, x, *slab):
        given.append(x.data_ptr())
        real = placed[int(index[-1])]
        for s in slab:
            s.add_(real.sum(dim=0))
        return (real + 1,)

    def call(x, *held):
        placed[x.data_ptr()] = x
        return graphed("moved", step, torch.tensor([x.data_ptr()]), addressed=(x,), held=held)[0].clone()

    aligned, off = torch.ones(3, 4), torch.ones(13)[1:].view(3, 4)  # (at two offsets from a 64-byte boundary)
    slab, grown = torch.zeros(4), torch.zeros(4)
    for x in (aligned, off, aligned, off):
        call(x, slab)
    assert cuda_graphs.captured() == 2
    for _ in range(2):
        call(aligned, grown)
    assert cuda_graphs.captured() == 1  # (both graphs over the old slab dropped)
    given.clear()
    xs = [torch.full((3, 4), float(k)) for k in range(3)]
    assert [call(x)[0, 0].item() for x in xs] == [1.0, 2.0, 3.0]
    assert given[0] == xs[0].data_ptr()
    assert cuda_graphs.captured() == 2  # (nothing held is not a moved slab: the graph over the slab stays)
    monkeypatch.setenv(cuda_graphs.SWITCH, "0")
    given.clear()
    assert [call(x)[0, 0].item() for x in xs] == [1.0, 2.0, 3.0] and given == [x.data_ptr() for x in xs]
    assert cuda_graphs.captured() == 2 and len(stand_in) == 4  # (nothing captured with graphs off)
