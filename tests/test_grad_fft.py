"""FFT sparsification: exact at θ=0 with fp32 values, better than Top-k on smooth signals, and its N-bit float."""

import math

import pytest
import torch

from aqpipe.compress.bitpack import packed_bytes
from aqpipe.compress.grad import DPGroup
from aqpipe.compress.grad.fft import CALIBRATION, FFTSparsifier, OffsetFloat, best_offset_float, kept_count
from tests.distributed import run_ranks


def one_replica(theta: float, bits: int) -> FFTSparsifier:
    return FFTSparsifier(DPGroup(None, (0,), 0), theta, bits)


def test_theta_zero_with_32_bit_values_reconstructs_the_gradient():
    g = torch.randn(4097, generator=torch.Generator().manual_seed(0))
    out = one_replica(0.0, 32).combine(g.clone())
    assert torch.allclose(out, g, atol=1e-5)


def _seven_smooth(n: int) -> bool:
    for p in (2, 3, 5, 7):
        while n % p == 0:
            n //= p
    return n == 1


def test_the_transform_runs_at_the_next_length_with_no_prime_factor_above_7():
    """An FFT of a length with a large prime factor takes several times longer (pocketfft and cuFFT alike): a stage
    of gpt2-tiny holds 921,088 = 2^9·7·257 values (0.17 s a transform and its inverse on one core, against 0.03 s
    for 921,600); 16,814,376 = 2^3·3^2·43·5431 values take 6.2 s against 1.4 s. The gradient is zero-padded to the
    next length made of 2, 3, 5 and 7 — a fraction of a percent more bins — and the message carries that many."""
    from aqpipe.compress.grad.fft import transform_length

    for n in [1, 2, 11, 4097, 921_088, 1_000_003, 16_814_376]:
        m = transform_length(n)
        assert _seven_smooth(m) and not any(_seven_smooth(k) for k in range(n, m)), (n, m)
    assert transform_length(921_088) == 921_600 and transform_length(16_814_376) <= 16_814_376 * 1.006
    g = torch.randn(4097, generator=torch.Generator().manual_seed(3))
    bins = transform_length(4097) // 2 + 1  # (4,116 = 2^2·3·7^3)
    assert one_replica(0.5, 32).encode(g).numel() == packed_bytes(bins, 1) + 1 + 8 * kept_count(bins, 0.5)
    assert one_replica(0.0, 32).combine(g.clone()).shape == g.shape


def smooth(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 1, n)
    waves = sum(torch.randn(1, generator=generator) * torch.sin(2 * math.pi * f * t + float(torch.rand(1, generator=generator)) * 6)
                for f in (1, 3, 7, 12))
    return waves + 0.02 * torch.randn(n, generator=generator)


@pytest.mark.parametrize("theta", [0.5, 0.8, 0.95])
def test_at_an_equal_kept_fraction_fft_beats_top_k_on_smooth_signals(theta):
    g = smooth(10_000, int(theta * 100))
    fft_error = (one_replica(theta, 32).combine(g.clone()) - g).norm()
    kept_values = 2 * kept_count(g.numel() // 2 + 1, theta)  # real and imaginary parts (10,000 = 2^4·5^4: unpadded)
    top = g.abs().topk(kept_values).indices
    sparse = torch.zeros_like(g).index_put_((top,), g[top])
    assert fft_error < 0.5 * (sparse - g).norm()


@pytest.mark.parametrize("bits", [4, 8, 10, 16])
def test_offset_float_follows_algorithm_1(bits):
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(bits)) * 0.01
    fmt = best_offset_float(bits, x)
    codes = fmt.encode(x)
    assert int(codes.min()) >= 0 and int(codes.max()) < (1 << bits)
    decoded = fmt.decode(codes)
    assert torch.equal(decoded.sign()[decoded != 0], x.sign()[decoded != 0])
    # magnitudes keep the exponent and m mantissa bits: relative error below 2**-m except below eps or above max
    inside = (x.abs() >= fmt.eps) & (x.abs() <= fmt.max_value)
    rel = ((decoded - x).abs() / x.abs())[inside]
    assert float(rel.max()) <= 2.0 ** -fmt.mantissa
    assert float(fmt.decode(fmt.encode(torch.tensor([1.0]))).item()) <= fmt.max_value  # saturates at max
    assert float(fmt.decode(fmt.encode(torch.tensor([fmt.eps / 4]))).item()) == 0.0


def test_more_bits_reconstruct_better():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    errors = [float((f.decode(f.encode(x)) - x).norm()) for f in (best_offset_float(b, x) for b in (4, 8, 12, 16))]
    assert errors == sorted(errors, reverse=True)


def test_values_go_as_fp32_while_the_range_is_calibrated_then_n_bit():
    sync = one_replica(0.9, 8)
    sizes = [sync.encode(smooth(3000, step)).numel() for step in range(CALIBRATION + 2)]
    assert sync.format is not None and sync.format.bits == 8
    k = kept_count(1501, 0.9)
    bitmap = (1501 + 7) // 8
    assert sizes[-1] == bitmap + 1 + 2 * k  # one byte per part at N = 8
    assert sizes[0] == bitmap + 1 + 8 * k


def test_state_survives_a_checkpoint_round_trip(tmp_path):
    sync = one_replica(0.5, 10)
    for step in range(CALIBRATION + 1):
        sync.combine(smooth(500, step))
    torch.save(sync.state_dict(), tmp_path / "fft.pt")
    other = one_replica(0.5, 10)
    other.load_state_dict(torch.load(tmp_path / "fft.pt", weights_only=True))
    g = smooth(500, 99)
    assert torch.equal(other.encode(g), sync.encode(g))


def _sync(rank: int, world: int):
    g = smooth(2000, rank)
    param = torch.nn.Parameter(torch.zeros(2000))
    param.grad = g.clone()
    sync = FFTSparsifier(DPGroup(None, tuple(range(world)), rank), 0.0, 32)
    sync.synchronize([param])
    return g, param.grad


def test_replicas_get_the_average():
    results = run_ranks(_sync, 2)
    assert all(status == "ok" for status, _ in results), results
    mean = (results[0][1][0] + results[1][1][0]) / 2
    for _, (_, out) in results:
        assert torch.allclose(out, mean, atol=1e-5)


def test_offset_float_refuses_widths_it_cannot_pack():
    with pytest.raises(ValueError, match="2..16 bits"):
        OffsetFloat(20, 3, 1.0)


def _calibrated(rank: int, world: int, steps: int):
    """Replicas whose gradients differ in scale by 30x calibrate their own ranges; return every step's result."""
    sync = FFTSparsifier(DPGroup(None, tuple(range(world)), rank), 0.5, 8)
    outs, grads = [], []
    for step in range(steps):
        g = smooth(1000, 10 * step + rank) * (30.0 ** rank)
        param = torch.nn.Parameter(torch.zeros(1000))
        param.grad = g.clone()
        sync.synchronize([param])
        outs.append(param.grad.clone())
        grads.append(g)
    return outs, grads, (sync.format.mantissa, sync.format.max_value)


def test_replicas_agree_on_one_n_bit_format_and_decode_alike():
    """Each replica calibrated its own range and mantissa and decoded its peers' codes with it (4-83% error)."""
    results = run_ranks(_calibrated, 3, CALIBRATION + 3)
    assert all(status == "ok" for status, _ in results), results
    (outs0, _, format0), *others = [value for _, value in results]
    for outs, _, fmt in others:
        assert fmt == format0
        assert all(torch.equal(a, b) for a, b in zip(outs, outs0))  # bit-identical on every replica
    for step in range(CALIBRATION, CALIBRATION + 3):  # N-bit steps: close to the mean of the kept frequencies
        mean = torch.stack([value[1][step] for _, value in results]).mean(0)
        assert float((outs0[step] - mean).norm() / mean.norm()) < 0.5
