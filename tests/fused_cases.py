"""What the fused-kernel tests share (tests/test_fused.py and tests/test_fused_in_place.py under Triton's
interpreter, tests/test_gpu_codecs.py on a GPU): the interpreter's runner, and the batches they code — random values
with the edge cases a scale meets."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from aqpipe.compress import fused

ROOT = Path(__file__).resolve().parent.parent  # (the scripts import tests.fused_cases)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (.ci/run installs triton==3.6.0 for these tests)")

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
