"""The fused delta kernels reaching the activation through an address their slots carry (`fused.addressable`): what
lets the fused step's CUDA graph read each message's activation, and write each decoded one, where the caller has
it — no copy into the graph or out of it. Its bits under Triton's interpreter, its refusals, and (compiled for an
H100, which needs no GPU) the kernels' vector loads and stores."""

import re

import pytest
import torch

from aqpipe.compress.gpu import fused
from tests.fused_cases import aqsgd_kernels_at_smollm2, compiled_for_an_h100, interpret, needs_triton


@needs_triton
def test_the_kernels_read_and_write_the_activation_at_the_address_their_slots_carry():
    """Given a tensor of the activation's layout (what a graph was captured with) and the real activation's address
    after the slots, the encode kernels code the real one: payload, new m(ξ), verdicts and norms as given it
    directly. The decode kernel reads the rows, and writes the activation, at the addresses it is given, and nothing
    into the tensor that stood for the activation."""
    interpret("""
        import torch
        from aqpipe.compress.gpu import fused
        from aqpipe.compress.link.checksum import CHECKSUM_WEIGHTS

        torch.manual_seed(5)
        shape = (3, 37, 136)  # (ragged tiles both ways)
        for dtype in (torch.float32, torch.bfloat16):
            x, decoy = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
            slab, slots = (torch.randn(5, 37, 136) * 0.5).half(), [4, 0, 2]
            assert fused.addressable(x) and fused.addressable(decoy)
            direct = fused.delta_encode(x, slab, torch.tensor(slots), 3, "signed", CHECKSUM_WEIGHTS, 1)
            moved = fused.delta_encode(decoy, slab, torch.tensor([*slots, x.data_ptr()]), 3, "signed",
                                       CHECKSUM_WEIGHTS, 1, x_moved=True)
            for a, b in zip((direct.payload, direct.m_new, direct.verdicts, direct.norms, direct.squares),
                            (moved.payload, moved.m_new, moved.verdicts, moved.norms, moved.squares)):
                assert torch.equal(a, b), dtype
            rows = direct.payload[3:].view(3, -1)
            m_new, values, verdicts = fused.delta_decode(rows, slab, torch.tensor(slots), shape, 3, "signed",
                                                         CHECKSUM_WEIGHTS)
            decoy = torch.zeros(3 + rows.numel(), dtype=torch.uint8)[3:].view(3, -1)  # (as `rows` lie: 3 bytes in)
            for rows_moved in (False, True):
                out, stand_in = torch.full(shape, 7.0), torch.full(shape, 7.0)
                addresses = [rows.data_ptr()] * rows_moved + [out.data_ptr()]
                got = fused.delta_decode(decoy if rows_moved else rows, slab, torch.tensor([*slots, *addresses]),
                                         shape, 3, "signed", CHECKSUM_WEIGHTS, into=stand_in, rows_moved=rows_moved)
                assert got[1] is None  # (the activation is where the address says)
                assert torch.equal(out, values) and torch.equal(got[0], m_new) and torch.equal(got[2], verdicts)
                assert torch.equal(stand_in, torch.full(shape, 7.0))
        print("checked")
    """)


@needs_triton
def test_a_tensor_reached_through_an_address_must_be_carried_and_addressable():
    if fused._kernels() is None:
        pytest.skip("Triton is not installed")
    x = torch.empty(2, 8, 16, device="meta")
    slab, slots = torch.empty(5, 8, 16, device="meta", dtype=torch.float16), torch.empty(3, dtype=torch.int64,
                                                                                          device="meta")
    off = torch.empty(2 * 8 * 16 + 1, device="meta")[1:].view(2, 8, 16)  # (4 bytes past a boundary: one piece still)
    assert fused.addressable(x) and fused.addressable(off)
    assert not fused.addressable(x.transpose(1, 2)) and not fused.addressable(x.double())
    for given in (x.transpose(1, 2).contiguous().transpose(1, 2), x.double()):
        with pytest.raises(ValueError, match="reached through an address .* at most 4-byte elements"):
            fused.delta_encode(given, slab, slots, 4, "signed", (40503, 65521), 1, x_moved=True)
    with pytest.raises(ValueError, match="needs slots to carry it"):
        fused.delta_encode(x, slab[:2], None, 4, "signed", (40503, 65521), 1, x_moved=True)
    with pytest.raises(ValueError, match="slots must be int64 \\[3\\]"):  # (the slots, then the address)
        fused.delta_encode(x, slab, slots[:2], 4, "signed", (40503, 65521), 1, x_moved=True)
    rows = torch.empty(2, fused.row_bytes(8, 16, 4), dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="activation's place must be float32 \\(2, 8, 16\\)"):
        fused.delta_decode(rows, slab, slots, (2, 8, 16), 4, "signed", (40503, 65521), into=x.half())
    _, values, _ = fused.delta_decode(rows, slab, slots, (2, 8, 16), 4, "signed", (40503, 65521), into=x)
    assert values is None
    with pytest.raises(ValueError, match="slots must be int64 \\[4\\]"):  # (the slots, the rows', the activation's)
        fused.delta_decode(rows, slab, slots, (2, 8, 16), 4, "signed", (40503, 65521), into=x, rows_moved=True)


def _memory_ops(ptx: str) -> tuple[int, int, int]:
    """Vector loads, vector stores and all loads from global memory in `ptx`."""
    vector = r"\.global(?:\.[a-z0-9]+)*\.v[248]\b"
    return (len(re.findall(r"\bld" + vector, ptx)), len(re.findall(r"\bst" + vector, ptx)),
            len(re.findall(r"\bld\.global", ptx)))


@needs_triton
def test_kernels_reaching_the_activation_through_its_address_keep_their_vector_loads_and_stores():
    """The scales, codes and decode kernels, compiled for an H100 with the activation (and the decode's rows) at its
    own pointer and moved to an address from the slots: the same vector loads and stores, and one more scalar load
    an address. The shift's alignment is what keeps them (said to the compiler: without it the loads of the
    activation are split into scalar ones)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    for name, (kernel, arguments, moved) in aqsgd_kernels_at_smollm2().items():
        ops = [_memory_ops(compiled_for_an_h100(kernel, {**arguments, **dict.fromkeys(moved, flag)})["ptx"])
               for flag in (False, True)]
        (vector_loads, vector_stores, loads), moved_ops = ops
        assert vector_loads > 0 and moved_ops == (vector_loads, vector_stores, loads + len(moved)), (name, ops)
