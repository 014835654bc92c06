"""The arithmetic of each kind of AQ-SGD row in torch ops (aqpipe.compress.link.aqsgd_steps): the bits of its
float32 formula. tests/test_fused.py checks the fused kernels against these steps."""

import pytest
import torch

from aqpipe.compress.link.aqsgd import MODE_DELTA
from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.storage import MemoryStore, StoreView


@pytest.mark.parametrize("spec", ["aqsgd:2", "aqsgd:3", "aqsgd:8", "aqsgd-rtq:4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per", ["channel", "token"])
def test_the_delta_step_gives_the_bits_of_its_float32_formula(spec, dtype, per):
    """The delta step in torch ops reads m(ξ) in its own dtype and adds it in place into the dequantized change (no
    float32 copy of m(ξ), no sum of its own: a CUDA graph of it keeps its peak for the run). Its payload, new m(ξ),
    checksum sums and fidelity norms, and the receiver's new m(ξ), activation and sums, are those of the formula
    with m(ξ) made float32 first, bit for bit — infinities, NaNs and signed zeros in the batch included."""
    from aqpipe.compress.link.aqsgd_rows import fidelity_norms, payload_of
    from aqpipe.compress.link.checksum import row_sums

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 64, generator=g) * torch.tensor([1, 100, 1e-3, 3e4]).view(4, 1, 1)
    m_old = (x + 0.1 * torch.randn(4, 16, 64, generator=g)).to(dtype)
    x[3, 0, 0], x[2, 1, 1], x[1, 2, 2], m_old[0, 0, :4] = float("inf"), float("nan"), -0.0, -0.0
    options = QuantOptions(per=per)
    sender, receiver = (build_codec(spec, "fw", StoreView(MemoryStore(dtype), 0, side), options)
                        for side in ("send", "recv"))
    payload, m_new, verdicts, norms, _ = sender.steps.delta_rows(x, m_old)
    m32 = m_old.float()
    change = x - m32
    coded, deq = sender.delta.encode(change, values=True)
    want_m = (m32 + deq).to(dtype)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        """Bit for bit, but for which NaN two NaNs are (the operands' order picks it; no NaN is ever kept)."""
        nan = torch.isnan(a) if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
        bits = a.masked_fill(nan, 0).view(torch.uint8) if a.is_floating_point() else a.view(torch.uint8)
        other = b.masked_fill(nan, 0).view(torch.uint8) if b.is_floating_point() else b.view(torch.uint8)
        return a.dtype == b.dtype and torch.equal(nan, torch.isnan(b) if b.is_floating_point() else nan) \
            and torch.equal(bits, other)

    assert same(payload, payload_of(MODE_DELTA, coded)) and same(m_new, want_m)
    assert torch.equal(verdicts[4:], row_sums(want_m))
    assert same(norms, fidelity_norms(x, m32, change, want_m))
    rows = payload[4:].view(4, -1)
    seeds, values, sums = receiver.steps.delta_values(rows, m_old)
    want_seeds = (m32 + receiver.delta.decode(rows, tuple(m_old.shape))).to(dtype)
    assert same(seeds, want_seeds) and same(values, want_seeds.float()) and torch.equal(sums[4:], row_sums(want_seeds))
