"""Quantization: error bounds, unbiased stochastic rounding, per-sample scales, fp16 scales both sides use."""

import pytest
import torch

from aqpipe.compress.quantize import dequantize, levels, quantize, scale_count


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("per", ["channel", "token"])
def test_nearest_rounding_error_is_at_most_half_a_step(bits, per):
    x = torch.randn(3, 10, 16) * torch.linspace(0.1, 10, 16)
    q = quantize(x, bits, per)
    y = dequantize(q, tuple(x.shape))
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < (1 << bits)
    assert q.scales.dtype == torch.float16 and q.scales.shape == (3, scale_count(tuple(x.shape), per))
    s = q.scales.float().view(3, 1, 16) if per == "channel" else q.scales.float().view(3, 10, 1)
    step = 2 * s / ((1 << bits) - 1)
    assert bool(((x - y).abs() <= step / 2 * (1 + 1e-5)).all())


def test_scales_cover_the_values_after_fp16_rounding():
    x = torch.tensor([[[1.0001, -3.00007], [0.5, 2.0]]])
    q = quantize(x, 4)
    assert bool((q.scales.float() >= torch.tensor([1.0001, 3.00007])).all())


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 4)
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([dequantize(quantize(x, 2, stochastic=True, generator=g), tuple(x.shape)) for _ in range(4000)])
    step = float(2 * quantize(x, 2).scales.float().max() / 3)
    mean_error = (draws.mean(0) - x).abs().max()
    assert mean_error < 0.05 * step  # one draw errs by up to a whole step; the mean converges to x
    assert (draws[0] - x).abs().max() > 0.1 * step


def test_one_bit_is_sign_times_scale():
    x = torch.tensor([[[0.3, -2.0], [-0.1, 1.0]]])
    y = dequantize(quantize(x, 1), tuple(x.shape))
    assert torch.equal(y.sign(), x.sign()) and torch.allclose(y.abs(), torch.tensor([[[0.3, 2.0], [0.3, 2.0]]]), rtol=1e-3)


def test_per_sample_independence():
    torch.manual_seed(0)
    batch = torch.randn(4, 6, 8) * 3
    alone = quantize(batch[2:3], 3)
    mixed = quantize(torch.cat([batch[3:], batch[2:3], torch.randn(2, 6, 8) * 100]), 3)
    assert torch.equal(alone.codes[0], mixed.codes[1]) and torch.equal(alone.scales[0], mixed.scales[1])


def test_zero_tensor_and_two_dimensional_input():
    z = torch.zeros(2, 5, 3)
    assert torch.equal(dequantize(quantize(z, 3), (2, 5, 3)), z)
    x = torch.randn(4, 7)
    q = quantize(x, 8)
    assert q.scales.shape == (4, 1)
    assert torch.allclose(dequantize(q, (4, 7)), x, atol=float(x.abs().max()) / 100)


def test_levels_are_symmetric():
    for bits in range(1, 9):
        lv = levels(bits)
        assert lv.numel() == 1 << bits and lv[0] == -1 and lv[-1] == 1 and torch.equal(lv, -lv.flip(0))
