"""The fused kernels' source (aqpipe.compress.gpu.fused_kernels) as a GPU compiles it and as it reads the codes: each
tile's arithmetic in the layout its loads give (compiled for an H100 by Triton's own compiler, no GPU needed), its
levels divided with IEEE rounding, codes past a grid's top decoded as the top (under Triton's interpreter), and the
tile sweep's check of other tiles' bits. tests/test_fused.py checks the kernels' bytes against the torch ops'."""

import os
import re
import subprocess
import sys

import pytest

from tests.fused_cases import ROOT, aqsgd_kernels_at_smollm2, compiled_for_an_h100, interpret, needs_triton


@needs_triton
def test_the_decode_kernel_reads_codes_past_the_grids_top_as_the_top_as_the_torch_ops_do():
    """A row whose codes are all ones (past the top code of the symmetric grid, which no encoder writes): each decodes
    to the top level, as the torch ops' table says."""
    interpret("""
        import torch
        from aqpipe.compress.gpu import fused
        from aqpipe.compress.link.directq import decode_samples

        for bits in (2, 3, 5, 8):
            for grid in ("symmetric", "signed", "uniform"):
                shape = (2, 3, 16)
                rows, _ = fused.encode(torch.randn(shape), bits, grid, values=False)
                rows[:, 2 * 16:] = 255
                assert torch.equal(fused.decode(rows, shape, bits, grid).view(torch.int32),
                                   decode_samples(rows, shape, bits, "channel", grid).view(torch.int32)), (bits, grid)
        print("checked")
    """)


@needs_triton
def test_the_codes_and_decode_kernels_keep_their_tiles_arithmetic_in_the_layout_they_load_it_in():
    """Compiled for an H100 as AQ-SGD's steady path launches them: no whole tile moved between layouts (each move
    a round trip through shared memory with its barriers) in the codes kernel, one in the decode kernel (the new
    m(ξ) into the float32 store's layout). A level read from a table at addresses made of the codes drew the tile's
    arithmetic into a gather's layout: three moves in the codes kernel, two in the decode kernel. (Layouts are the
    compiler's choice: these are Triton 3.6.0's, the version the README's test command installs.)"""
    pytest.importorskip("triton.backends.nvidia.compiler")
    import triton

    if triton.__version__ != "3.6.0":
        pytest.skip(f"the layouts counted are Triton 3.6.0's, not {triton.__version__}'s")
    from aqpipe.compress.gpu import fused_kernels as k

    tile = f"tensor<{k.TILE_T}x{k.TILE_C}x"
    moves = {}
    for name, (kernel, arguments, moved) in aqsgd_kernels_at_smollm2().items():
        if name != "scales":
            ttgir = compiled_for_an_h100(kernel, {**arguments, **dict.fromkeys(moved, True)})["ttgir"]
            moves[name] = sum(tile in line for line in ttgir.splitlines() if "ttg.convert_layout" in line)
    assert moves == {"codes": 0, "decode": 1}


@needs_triton
def test_the_kernels_divide_levels_correctly_rounded_on_a_gpu():
    """On a grid whose steps are not a power of two, the codes and decode kernels, compiled for an H100, divide with
    IEEE rounding (`div.rn`) and nothing approximate: the interpreter's numpy divides exactly whatever the kernel
    asks, so only the compiled code shows a `/` (Triton's approximate `div.full`) where `tl.div_rn` belongs."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    for name, (kernel, arguments, moved) in aqsgd_kernels_at_smollm2().items():
        if name != "scales":
            ptx = compiled_for_an_h100(kernel, {**arguments, **dict.fromkeys(moved, True), "INVERSE": False})["ptx"]
            assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx, name
            assert not re.search(r"\bfma\.", ptx), name  # (no fused multiply-add: torch rounds each step)


@needs_triton
def test_the_tile_sweep_checks_its_settings_bits_under_the_interpreter(tmp_path):
    """`benchmarks/fused_tiles.py`'s command without a GPU (its docstring's second): each setting's bits checked
    against the shipped tiles' under Triton's interpreter (it failed under numpy 2.4 without the tests' patch)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/fused_tiles.py", "--device", "cpu", "--shape", "2,16,64",
                           "--quick", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every setting wrote the shipped tiles' bits (2 settings)" in proc.stdout
