"""Quantization: every grid's error bound, an exact zero, unbiased stochastic rounding, contractive 1-bit codes,
per-sample scales, fp16 scales both sides use."""

import pytest
import torch

from aqpipe.compress.quantize import (
    DEFAULT_GRID,
    GRIDS,
    _offset_steps,
    dequantize,
    level_step,
    levels,
    quantize,
    scale_count,
)

ZERO_GRIDS = [g for g in GRIDS if g != "uniform"]


def _step(q, per: str, bits: int, grid: str) -> torch.Tensor:
    """The distance between neighbouring levels for each element's scale group."""
    s = q.scales.float().abs()
    s = s.view(3, 1, 16) if per == "channel" else s.view(3, 10, 1)
    if grid == "uniform":
        return 2 * s / ((1 << bits) - 1)
    if grid == "symmetric":
        return s / ((1 << (bits - 1)) - 1)
    return s / (1 << (bits - 1))


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("per", ["channel", "token"])
def test_nearest_rounding_error_is_at_most_half_a_step_inside_the_range(grid, bits, per):
    # seeded: the bound holds to float32's rounding of x / scale · steps (two roundings, a few ulp of the step), and
    # about one unseeded draw in 5,000 landed within that of a half-step boundary (1.5e-5 over it at 7 bits)
    torch.manual_seed(bits * 31 + len(grid) + len(per))
    x = torch.randn(3, 10, 16) * torch.linspace(0.1, 10, 16)
    q = quantize(x, bits, per, grid=grid)
    y = dequantize(q, tuple(x.shape))
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < (1 << bits)
    assert q.scales.dtype == torch.float16 and q.scales.shape == (3, scale_count(tuple(x.shape), per))
    step = _step(q, per, bits, grid)
    error = (x - y).abs()
    # `signed` clips the short side of its grid: beyond its last level the error may reach one step, never more
    bound = step if grid == "signed" else step / 2
    assert bool((error <= bound * (1 + 1e-4)).all())
    if grid == "signed":  # and only the values past the short side's last level, (2^(b-1) - 1) / 2^(b-1) of the scale
        signed = q.scales.float().view(3, 1, 16) if per == "channel" else q.scales.float().view(3, 10, 1)
        past = x / signed > 1 - 2.0 ** (1 - bits) + 1e-6
        assert not bool((error > step / 2 * (1 + 1e-4))[~past].any())


@pytest.mark.parametrize("grid", ZERO_GRIDS)
@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("stochastic", [False, True])
def test_an_exact_zero_comes_back_exactly_zero(grid, bits, stochastic):
    x = torch.randn(4, 12, 8)
    x[:, 5:] = 0.0  # padded positions: their gradient is exactly 0
    x[:, :, 3] = 0.0  # an unused channel
    y = dequantize(quantize(x, bits, "channel", stochastic, torch.Generator().manual_seed(0), grid), tuple(x.shape))
    assert torch.equal(y[:, 5:], torch.zeros_like(y[:, 5:])) and torch.equal(y[:, :, 3], torch.zeros_like(y[:, :, 3]))


@pytest.mark.parametrize("bits", [2, 4, 6])
def test_the_default_grid_adds_no_spurious_mass_at_padding(bits):
    """The old grid (uniform, no zero) sent a same-signed value at every padded position."""
    torch.manual_seed(0)
    grad = torch.randn(2, 32, 16)
    grad[:, 20:] = 0.0
    y = dequantize(quantize(grad, bits), tuple(grad.shape))
    assert float(y[:, 20:].abs().sum()) == 0.0
    old = dequantize(quantize(grad, bits, grid="uniform"), tuple(grad.shape))
    assert float(old[:, 20:].abs().sum()) > 0.0


def test_the_default_grid_is_signed_and_beats_the_old_one_at_two_bits():
    """On Gaussian and Laplace data, the relative MSE of 2-bit codes is lower than the uniform grid's."""
    assert DEFAULT_GRID == "signed"
    torch.manual_seed(0)
    for x in (torch.randn(8, 64, 32), torch.distributions.Laplace(0.0, 1.0).sample((8, 64, 32))):
        def rel_mse(grid: str) -> float:
            y = dequantize(quantize(x, 2, grid=grid), tuple(x.shape))
            return float(((x - y) ** 2).sum() / (x ** 2).sum())
        assert rel_mse("signed") < 0.8 * rel_mse("uniform")
        assert rel_mse("signed") < 0.35


@pytest.mark.parametrize("grid", GRIDS)
def test_scales_cover_the_values_after_fp16_rounding(grid):
    x = torch.tensor([[[1.0001, -3.00007], [0.5, 2.0]]])
    q = quantize(x, 4, grid=grid)
    assert bool((q.scales.float().abs() >= torch.tensor([1.0001, 3.00007])).all())


def test_the_signed_grid_puts_its_long_side_on_the_largest_magnitude():
    x = torch.tensor([[[4.0, -1.0], [-2.0, 3.0], [1.0, -8.0]]])
    y = dequantize(quantize(x, 3, grid="signed"), tuple(x.shape))
    assert float(y[0, 0, 0]) == 4.0 and float(y[0, 2, 1]) == -8.0  # the extremes are exact, whatever their sign


@pytest.mark.parametrize("grid", ["fit", "symmetric", "uniform", "signed"])
def test_stochastic_rounding_is_unbiased(grid):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 4)
    x[0, 0, 0] = 3.0  # the largest magnitude is positive: `signed` clips nothing on the negative side
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([dequantize(quantize(x, 2, stochastic=True, generator=g, grid=grid), tuple(x.shape))
                         for _ in range(4000)])
    step = float(quantize(x, 2, grid=grid).scales.float().abs().max())
    inside = torch.ones_like(x, dtype=torch.bool)
    if grid == "signed":  # the values past the short side's last level are clipped, so biased; the rest is not
        q = quantize(x, 2, grid="signed")
        s = q.scales.float().view(2, 1, 4)
        inside = (x / s) <= 0.5 + 1e-6  # 2 bits: levels -1, -1/2, 0, 1/2 of the signed scale
    mean_error = (draws.mean(0) - x).abs()[inside].max()
    assert mean_error < 0.05 * step  # one draw errs by up to a whole step; the mean converges to x
    assert (draws[0] - x).abs().max() > 0.1 * step


@pytest.mark.parametrize("grid", ZERO_GRIDS)
def test_one_bit_nearest_is_sign_times_mean_magnitude_and_contractive(grid):
    x = torch.tensor([[[0.3, -2.0], [-0.1, 1.0]]])
    y = dequantize(quantize(x, 1, grid=grid), tuple(x.shape))
    assert torch.equal(y.sign(), x.sign())
    assert torch.allclose(y.abs(), torch.tensor([[[0.2, 1.5], [0.2, 1.5]]]), rtol=1e-3)
    torch.manual_seed(0)
    for z in (torch.randn(4, 32, 8), torch.distributions.Laplace(0.0, 1.0).sample((4, 32, 8)), torch.ones(2, 5, 3)):
        error = z - dequantize(quantize(z, 1, grid=grid), tuple(z.shape))
        assert float((error ** 2).sum()) < float((z ** 2).sum())


def test_one_bit_max_abs_was_not_contractive():
    """The uniform grid's ±max|x| 1-bit code can return more error than the input: why the mean scale exists."""
    z = torch.tensor([[[10.0], [0.1], [0.1], [0.1], [0.1], [0.1]]])
    error = z - dequantize(quantize(z, 1, grid="uniform"), tuple(z.shape))
    assert float((error ** 2).sum()) > float((z ** 2).sum())


def test_per_sample_independence():
    torch.manual_seed(0)
    batch = torch.randn(4, 6, 8) * 3
    for grid in GRIDS:
        alone = quantize(batch[2:3], 3, grid=grid)
        mixed = quantize(torch.cat([batch[3:], batch[2:3], torch.randn(2, 6, 8) * 100]), 3, grid=grid)
        assert torch.equal(alone.codes[0], mixed.codes[1]) and torch.equal(alone.scales[0], mixed.scales[1])


def test_zero_tensor_and_two_dimensional_input():
    z = torch.zeros(2, 5, 3)
    for grid in GRIDS:
        assert torch.equal(dequantize(quantize(z, 3, grid=grid), (2, 5, 3)), z)
    x = torch.randn(4, 7)
    q = quantize(x, 8)
    assert q.scales.shape == (4, 1)
    assert torch.allclose(dequantize(q, (4, 7)), x, atol=float(x.abs().max()) / 100)


def test_levels_of_each_grid():
    for bits in range(2, 9):
        uniform = levels(bits, grid="uniform")
        assert uniform.numel() == 1 << bits and uniform[0] == -1 and uniform[-1] == 1
        assert torch.equal(uniform, -uniform.flip(0)) and not bool((uniform == 0).any())
        symmetric = levels(bits, grid="symmetric")[: (1 << bits) - 1]
        assert symmetric[0] == -1 and symmetric[-1] == 1 and torch.equal(symmetric, -symmetric.flip(0))
        for grid in ("signed", "fit"):
            lv = levels(bits, grid=grid)
            assert lv[0] == -1 and float(lv[1 << (bits - 1)]) == 0.0 and float(lv[-1]) == 1 - 2 ** (1 - bits)
    assert torch.equal(levels(1, grid="signed"), torch.tensor([-1.0, 1.0]))


def test_level_step_forms_the_float32_of_the_levels_table_for_every_code_of_every_grid():
    """The fused kernels form a code's level in registers (`level_step`: times 1/steps where steps are a power of
    two, else a correctly rounded division), not from `quantize.levels`' table (float64, rounded once): the same
    float32 for every code of every width and grid they take."""
    for bits in range(1, 9):
        for grid in ("signed", "symmetric", "uniform"):
            offset, steps, top = _offset_steps(bits, grid)
            step, inverse = level_step(bits, grid)
            assert inverse == (bits == 1 or grid == "signed" or (grid == "symmetric" and bits == 2)), (bits, grid)
            k = torch.arange(1 << bits).clamp(max=top).to(torch.float32) - offset
            formed = k * step if inverse else k / torch.tensor(step, dtype=torch.float32)
            assert torch.equal(formed.view(torch.int32), levels(bits, None, grid).view(torch.int32)), (bits, grid)


def test_an_unknown_grid_is_refused():
    with pytest.raises(ValueError, match="signed, fit, symmetric, uniform"):
        quantize(torch.randn(2, 3), 4, grid="log")
