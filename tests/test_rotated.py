"""Rotated tile quantization (aqpipe.compress.rotated): the Hadamard tiles, widths that are not a multiple of the
tile, an error well below plain per-token quantization on activations with outlier channels, exact and
device-independent reconstruction, per-sample bytes, unbiased stochastic rounding."""

import pytest
import torch

from aqpipe.compress.quantize import dequantize, quantize
from aqpipe.compress.rotated import (
    NOT_SET_APART,
    hadamard,
    put_back_largest,
    rotated_dequantize,
    rotated_quantize,
    scales_per_sample,
    set_apart_largest,
    tile_pieces,
)


def outlier_activations(b=4, t=16, c=576, seed=0) -> torch.Tensor:
    """Activations like a transformer's: mostly small values, about 1% of the channels 50x larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, c, generator=g)
    x[:, :, torch.randperm(c, generator=g)[:max(1, c // 100)]] *= 50.0
    return x


def test_the_hadamard_tile_is_orthogonal_up_to_its_size():
    h = hadamard(64)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, 64 * torch.eye(64))
    with pytest.raises(ValueError, match="power of two"):
        hadamard(48)


def test_a_width_splits_into_whole_tiles_then_power_of_two_pieces():
    assert tile_pieces(576) == [(64, 9)]  # SmolLM2's hidden size
    assert tile_pieces(100) == [(64, 1), (32, 1), (4, 1)]
    assert tile_pieces(5, 64) == [(4, 1), (1, 1)]
    assert scales_per_sample((2, 16, 100)) == 16 * 3
    assert scales_per_sample((2, 576)) == 9  # a 2-D tensor is one token
    with pytest.raises(ValueError, match="power of two"):
        tile_pieces(576, 48)


@pytest.mark.parametrize("width", [576, 100, 64])
def test_rotation_cuts_the_error_of_per_token_scales_on_outlier_channels(width):
    x = outlier_activations(c=width)
    rotated = rotated_dequantize(rotated_quantize(x, 4), tuple(x.shape))
    plain = dequantize(quantize(x, 4, "token"), tuple(x.shape))
    rotated_error = (rotated - x).pow(2).sum() / x.pow(2).sum()
    plain_error = (plain - x).pow(2).sum() / x.pow(2).sum()
    assert rotated_error < plain_error / 2, (float(rotated_error), float(plain_error))
    assert rotated_error < 0.02


def test_reconstruction_is_exact_integer_arithmetic_times_one_factor_per_tile():
    x = outlier_activations(c=100)
    q = rotated_quantize(x, 3)
    out = rotated_dequantize(q, tuple(x.shape))
    # the same reconstruction with the integer part in float64 gives the same bits: the products of codes and ±1
    # are exact in fp32, so no summation order (no BLAS, no GPU kernel) can change them; then one fp32 product by
    # an fp32 factor (scale times the fp32 reciprocal of steps·√n; 3 bits: steps 4, offset 4)
    codes = q.codes.view(4, 16, 100).double()
    scales = q.scales.view(4, 16, 3).float()
    expected, start = [], 0
    for piece, (size, _) in enumerate(tile_pieces(100)):
        integers = codes[:, :, start:start + size] @ hadamard(size).double()
        integers[..., 0] -= 4 * size
        factor = scales[:, :, piece:piece + 1] * torch.tensor(1 / (4 * size ** 0.5), dtype=torch.float32)
        expected.append(integers.float() * factor)
        start += size
    assert torch.equal(out, torch.cat(expected, dim=2))


def test_a_samples_bytes_do_not_depend_on_the_rest_of_its_batch():
    x = outlier_activations()
    whole = rotated_quantize(x, 4)
    alone = rotated_quantize(x[2:3], 4)
    assert torch.equal(whole.codes[2:3], alone.codes) and torch.equal(whole.scales[2:3], alone.scales)


@pytest.mark.parametrize("grid", ["signed", "fit", "symmetric"])  # `uniform` has no zero level (see quantize)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_an_exact_zero_survives_every_grid_with_a_zero(grid, bits):
    x = torch.zeros(2, 8, 100)
    x[:, :, :64] = torch.randn(2, 8, 64)
    x[1] = 0.0  # a whole sample of zeros, and the tiles 64..99 of the other
    out = rotated_dequantize(rotated_quantize(x, bits, grid=grid), tuple(x.shape))
    assert torch.equal(out[:, :, 64:], torch.zeros(2, 8, 36)) and torch.equal(out[1], torch.zeros(8, 100))


def test_rotating_then_rotating_back_is_the_identity():
    for n in (1, 2, 32, 64, 128):
        h = hadamard(n, normalized=True)
        assert torch.allclose(h @ h, torch.eye(n), atol=1e-6)
        x = torch.randn(5, n)
        assert torch.allclose((x @ h) @ h, x, atol=1e-5)


def test_stochastic_rounding_is_unbiased():
    x = outlier_activations(b=1, t=4, c=64, seed=3)
    g = torch.Generator().manual_seed(0)
    # on a grid that never clips (the signed grid clips its short side, which no rounding can make unbiased)
    draws = torch.stack([rotated_dequantize(rotated_quantize(x, 2, stochastic=True, generator=g, grid="fit"),
                                            tuple(x.shape))
                         for _ in range(400)])
    bias = (draws.mean(0) - x).abs().mean() / x.abs().mean()
    single = (draws[0] - x).abs().mean() / x.abs().mean()
    assert bias < single / 8, (float(bias), float(single))


def test_each_tokens_largest_value_is_set_apart_and_put_back():
    x = outlier_activations(b=3, t=5, c=100)
    x[1, 2, 70] = -30000.0  # a massive activation, like an attention sink's
    x[2, 0, :] = 0.0
    x[2, 0, 7] = x[2, 0, 9] = 2.0  # a tie: the first channel is the one set apart
    rest, channels, largest = set_apart_largest(x)
    assert channels.shape == largest.shape == (3, 5) and largest.dtype == torch.float16
    assert channels[1, 2] == 70 and largest[1, 2] == -30000.0 and channels[2, 0] == 7
    assert torch.equal(rest.abs().amax(dim=2) <= x.abs().amax(dim=2), torch.ones(3, 5, dtype=torch.bool))
    assert torch.equal(torch.gather(rest, 2, channels.unsqueeze(2)), torch.zeros(3, 5, 1))
    back = put_back_largest(rest, channels, largest, tuple(x.shape))
    assert torch.equal(back, x.half().float().where(torch.arange(100) == channels.unsqueeze(2), x))
    wide = torch.randn(2, 2, 64)
    wide[0, 0, 9], wide[1, 1, 3] = 70000.0, float("-inf")  # values fp16 cannot hold stay in place
    rest, channels, largest = set_apart_largest(wide)
    assert channels[0, 0] == channels[1, 1] == NOT_SET_APART and largest[0, 0] == largest[1, 1] == 0
    expected_rest, expected_back = wide.clone(), wide.clone()
    for b, t in ((0, 1), (1, 0)):  # the tokens whose largest value was set apart
        c = int(wide[b, t].abs().argmax())
        assert channels[b, t] == c
        expected_rest[b, t, c] = 0.0
        expected_back[b, t, c] = wide[b, t, c].half().float()
    assert torch.equal(rest, expected_rest)
    assert torch.equal(put_back_largest(rest, channels, largest, tuple(wide.shape)), expected_back)
    flat = torch.randn(3, 100)  # a 2-D [B, C] batch: one token per sample
    rest, channels, largest = set_apart_largest(flat)
    assert channels.shape == (3, 1) and torch.equal(channels[:, 0], flat.abs().argmax(dim=1))
    back = put_back_largest(rest, channels, largest, (3, 100))
    assert torch.equal(back, flat.half().float().where(torch.arange(100) == channels, flat))
