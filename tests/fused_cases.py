"""What the fused-kernel tests share (tests/test_fused*.py under Triton's interpreter or compiled for an H100 without
one, tests/test_gpu_codecs.py on a GPU): the interpreter's runner, the batches they code — random values with the
edge cases a scale meets — and AQ-SGD's kernels with the arguments its GPU path gives them, compiled."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from aqpipe.compress.gpu import fused

ROOT = Path(__file__).resolve().parent.parent  # (the scripts import tests.fused_cases)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (the README's test command installs triton==3.6.0)")

# Triton 3.6's interpreter turns a scalar into an index with int() of a one-element array, which numpy ≥ 2.4 refuses;
# the patch takes the element instead (the kernels are unchanged).
INTERPRETER_PATCH = """
import triton.runtime.interpreter as interpreter
if hasattr(interpreter, "_patch_lang_tensor"):
    _patch = interpreter._patch_lang_tensor
    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = _patch_lang_tensor
"""


def interpret(script: str) -> None:
    """Run `script` in a fresh Python with Triton's interpreter on (it is read when kernels are defined)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "AQPIPE_FUSED_KERNELS": "1", fused.DELTA_SWITCH: "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_PATCH + textwrap.dedent(script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("checked"), proc.stdout[-2000:]


def edge_case_batch(shape: tuple[int, ...], device: str = "cpu") -> torch.Tensor:
    """Random values × 3 of `shape` (≥ 5 channels) with an all-zero channel, a −0 channel, a value past fp16 and a
    channel whose scale is an fp16 subnormal."""
    x = torch.randn(shape, device=device) * 3
    v = x.view(shape[0], -1, shape[-1])
    v[-1, :, 1] = 0.0
    v[0, :, 2] = -0.0
    v[0, 0, 3] = 1e6
    v[-1, :, 4] *= 1e-9
    return x


def aqsgd_kernels_at_smollm2() -> dict[str, tuple]:
    """AQ-SGD's scales, codes and decode kernels as its steady GPU path launches them at SmolLM2's 8 × 1024 × 576
    (3 bits on the signed grid, m(ξ) fp16 in a slab's rows, written in place): name → (kernel, its arguments — each
    one's type or constexpr value, and `num_warps` — and the flags that move a pointer to an address in the slots,
    left for the caller to set), for `compiled_for_an_h100`."""
    from aqpipe.compress.gpu import fused_kernels as k

    def typed(kind: str, *names: str) -> dict[str, str]:
        return dict.fromkeys(names, kind)

    scalars = {**typed("i32", "T", "C", "W", "X_AT", "ROWS_AT", "OUT_AT", "modulus"),
               **typed("fp32", "offset", "steps", "top", "step", "m_max")}
    delta = {"HAS_M": True, "SLOTS": True, "IN_PLACE": True, "BITS": 3, "INVERSE": True, "BT": k.TILE_T,
             "BC": k.TILE_C}
    return {
        "scales": (k.scales_kernel, {**scalars, **typed("*fp32", "x_ptr", "s_ptr"), **typed("*fp16", "m_ptr"),
                                     **typed("*i64", "slots_ptr"), **typed("*u8", "rows_ptr"), "HAS_M": True,
                                     "SLOTS": True, "KIND": 0, "FP16_MAX": fused.FP16_MAX, "BT": k.SCALE_T,
                                     "BC": k.SCALE_C, "num_warps": k.WARPS["scales"]}, ("X_MOVED",)),
        "codes": (k.codes_kernel, {**scalars, **typed("*fp32", "x_ptr", "s_ptr", "values_ptr", "norms_ptr"),
                                   **typed("*fp16", "m_ptr", "m_new_ptr"), **typed("*i64", "slots_ptr", "sums_ptr"),
                                   **typed("*u8", "rows_ptr"), **typed("*i32", "bad_ptr", "row_w_ptr", "col_w_ptr"),
                                   **delta, "VALUES": False, "num_warps": k.WARPS["codes"]}, ("X_MOVED",)),
        "decode": (k.decode_kernel, {**scalars, "top": "i32", **typed("*fp32", "out_ptr"),
                                     **typed("*fp16", "m_ptr", "m_new_ptr"), **typed("*i64", "slots_ptr", "sums_ptr"),
                                     **typed("*u8", "rows_ptr"), **typed("*i32", "row_w_ptr", "col_w_ptr"), **delta,
                                     "num_warps": k.WARPS["delta_decode"]}, ("OUT_MOVED", "ROWS_MOVED")),
    }


def compiled_for_an_h100(kernel, arguments: dict) -> dict[str, str]:
    """`kernel` compiled for an H100 (sm_90) by Triton's own compiler and ptxas, no GPU needed: its code at each
    stage ("ttgir", "ptx", ...). `arguments`: each argument's type ("*fp32", "i32", ...) or constexpr value, and
    `num_warps`; the pointers and T, C, W are 16-aligned, as Triton's launcher finds them at SmolLM2's shape."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    given = {name: arguments[name] for name in names}
    types = {name: value for name, value in given.items() if isinstance(value, str)}
    aligned = [name for name, kind in types.items() if kind.startswith("*")] + ["T", "C", "W"]
    source = ASTSource(fn=kernel, signature={name: types.get(name, "constexpr") for name in names},
                       constexprs={name: value for name, value in given.items() if name not in types},
                       attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    options = {"num_warps": arguments["num_warps"], "enable_fp_fusion": False}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm
