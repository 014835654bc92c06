"""CUDA graphs themselves on a GPU (`pytest -m gpu`; aqpipe.compress.gpu.cuda_graphs): a held tensor written once a
replay where it lies, host tensors fed straight into a graph's buffers, and a capture that fails — graphs off from
then on, the GPU still right. tests/test_cuda_graphs.py and tests/test_cuda_graphs_in_place.py check the same
bookkeeping with stand-in graphs on the host; tests/test_gpu_codecs.py, the codecs' graphs."""

import functools
import subprocess
import sys

import pytest
import torch

from tests.test_gpu import DEVICE, needs_cuda, pytestmark  # noqa: F401 - pytestmark marks these tests too

_FAILED_CAPTURE = """
import logging, torch
from aqpipe.compress.gpu.cuda_graphs import captured, graphed

def waits(x):
    return (x * float(x.sum()),)  # float() reads the GPU: not allowed inside a capture

warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("aqpipe.compress.gpu.cuda_graphs").addHandler(handler)
x = torch.randn(64, device="cuda")
results = [graphed("test-waits", waits, x)[0] for _ in range(4)]
doubled = [graphed("test-pure", lambda t: (t * 2,), x)[0] for _ in range(3)]
assert captured() == 0 and any("capture of test-waits failed" in w for w in warnings), warnings
assert all(torch.equal(r, x * float(x.sum())) for r in results)
assert all(torch.equal(d, x * 2) for d in doubled)
assert torch.equal((x + 1).cpu(), x.cpu() + 1)  # no error left behind on the device
torch.cuda.manual_seed(5)  # the default generator, which the capture registered, is out of capture mode
draws = torch.randn(8, device="cuda")
torch.cuda.manual_seed(5)
assert torch.equal(draws, torch.randn(8, device="cuda"))
print("recovered")
torch.cuda.empty_cache()
side = torch.cuda.Stream()
size = 7_341_056  # (an odd size: the freed block is the allocator's best fit for the next one)
block = torch.empty(size, dtype=torch.uint8, device="cuda")
pointer = block.data_ptr()
block.record_stream(side)
del block
torch.cuda.synchronize()
# with a capture still counted as underway the allocator defers that free for good, and hands out new memory
print("reused" if torch.empty(size, dtype=torch.uint8, device="cuda").data_ptr() == pointer else "not reused")
"""


@functools.cache
def _after_a_failed_capture() -> str:
    """Run a capture that fails in a process of its own (what torch leaves behind cannot spill into other tests)."""
    proc = subprocess.run([sys.executable, "-c", _FAILED_CAPTURE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@needs_cuda
def test_a_real_graph_writes_a_held_tensor_once_a_call_where_it_lies():
    """A CUDA graph over a held tensor (a slab of m(ξ) that a step writes in place): the capture does not run the
    step first (which would write it twice), each replay writes it once where it lies, and a slab that moved gets a
    graph of its own that replaces the old one."""
    from aqpipe.compress.gpu import cuda_graphs
    from aqpipe.compress.gpu.cuda_graphs import graphed

    def bump(x, slab):
        slab.add_(x)
        return (slab.sum(dim=0),)

    cuda_graphs.clear()
    try:
        slab, x = torch.zeros(3, 4, device=DEVICE), torch.ones(4, device=DEVICE)
        sums = [graphed("held-step", bump, x * (k + 1), held=(slab,))[0].clone() for k in range(5)]
        assert torch.equal(slab.cpu(), torch.full((3, 4), 15.0))  # 1 + 2 + 3 + 4 + 5: each call written once
        assert [s[0].item() for s in sums] == [3.0, 9.0, 18.0, 30.0, 45.0]
        assert cuda_graphs.captured() == 1
        grown = torch.zeros(6, 4, device=DEVICE)
        for _ in range(3):
            graphed("held-step", bump, x, held=(grown,))
        assert torch.equal(grown.cpu(), torch.full((6, 4), 3.0)) and torch.equal(slab.cpu(), torch.full((3, 4), 15.0))
        assert cuda_graphs.captured() == 1
    finally:
        cuda_graphs.clear()


@needs_cuda
def test_a_real_graph_fed_from_the_host_gives_what_device_inputs_give():
    """Host tensors given beside GPU tensors (rows in pinned memory; a slab's slots in pageable memory, as AQ-SGD's
    fused step feeds them) are copied straight into the graph's buffers: every replay computes on the values given
    at its call, as op by op on the GPU, and the host may write a pageable tensor again at once."""
    from aqpipe.compress.gpu import cuda_graphs
    from aqpipe.compress.gpu.cuda_graphs import graphed

    def step(rows, slots, scale):
        return (rows.float() * scale + slots.float().sum(),)

    cuda_graphs.clear()
    try:
        scale = torch.randn(5, device=DEVICE)
        slots = torch.zeros(3, dtype=torch.int64)
        for k in range(6):
            rows = torch.randint(0, 255, (4, 5), dtype=torch.uint8).pin_memory()
            slots.copy_(torch.tensor([k, 2 * k, 3]))  # (pageable: its copy is staged before the call returns)
            got = graphed("fed-step", step, rows, slots, scale)[0].clone()
            slots.zero_()
            expected = step(rows.to(DEVICE), torch.tensor([k, 2 * k, 3], device=DEVICE), scale)[0]
            assert got.device == scale.device and torch.equal(got, expected), k
        assert cuda_graphs.captured() == 1
    finally:
        cuda_graphs.clear()


@needs_cuda
def test_a_codec_graphs_capture_failure_falls_back_to_its_ops():
    """A function that makes the host wait cannot be captured: graphs are off from then on, with a warning, the
    results are right, and the GPU and its default random generator (which every capture registers) go on working."""
    assert "recovered" in _after_a_failed_capture()


@needs_cuda
@pytest.mark.xfail(strict=True, reason="torch 2.11-2.13 leave the allocator counting an abandoned capture as active, "
                   "which no Python call undoes (pytorch/pytorch#190308): stream-recorded frees wait for good (strict: "
                   "a torch that fixes it passes, and this mark is then to go)")
def test_after_a_failed_capture_a_freed_stream_recorded_block_is_reused():
    assert "not reused" not in _after_a_failed_capture()
