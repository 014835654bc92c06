"""TAH-Quant as a baseline codec (aqpipe.compress.link.tahq): its published bit budget, the 3-bit share of
low-entropy tokens, rotated outlier tiles, per-sample rows of varying length, and clear refusals."""

import pytest
import torch

from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CodecError
from aqpipe.compress.link.tahq import LOW_SHARE, tahq_bits_per_value
from aqpipe.pipeline.links.transport import KIND_ACTIVATION, Header


def round_trip(x: torch.Tensor):
    codec = build_codec("tahq", "fw")
    ids = torch.arange(x.shape[0])
    encoded = codec.encode(x, ids)
    header = Header.for_encoded(encoded, codec.code, KIND_ACTIVATION, 0, 0, len(ids))
    assert codec.check_header(header) is None
    return encoded, codec.decode(header, encoded.payload.clone(), ids)


def test_about_4_4_bits_per_value_as_published():
    # 4 bits, 3 for 20% of the tokens, an fp16 zero and step per 64 values, the bit maps, and the pivots
    low = int(0.2 * 128)  # of 128 tokens, 25 at 3 bits
    assert tahq_bits_per_value((1, 128, 576)) == pytest.approx(4 - low / 128 + 32 / 64 + 1 / 576 + 1 / 64)
    assert 4.3 < tahq_bits_per_value((1, 128, 576), rotated_share=0.1) < 4.4


def test_a_spiked_tile_is_rotated_and_comes_back_close_while_others_keep_4_bit_error():
    torch.manual_seed(0)
    x = torch.randn(2, 40, 128)
    x[:, :, 70] *= 60.0  # one outlier channel in the second tile of every token
    encoded, y = round_trip(x)
    error = (y - x).pow(2).sum() / x.pow(2).sum()
    assert error < 0.005
    assert 8 * encoded.payload.numel() / x.numel() < 4.6
    plain = build_codec("directq:4", "fw", options=QuantOptions(per="token"))  # 4 bits, a scale per token
    ids = torch.arange(2)
    sent = plain.encode(x, ids)
    y_plain = plain.decode(Header.for_encoded(sent, plain.code, KIND_ACTIVATION, 0, 0, 2), sent.payload, ids)
    assert error < (y_plain - x).pow(2).sum() / x.pow(2).sum() / 3


def test_the_lowest_entropy_tokens_get_three_bits():
    torch.manual_seed(1)
    x = torch.randn(1, 10, 64)
    x[0, 4] = 0.0
    x[0, 4, 0] = 5.0  # all of token 4's magnitude in one channel: the lowest entropy
    x[0, 7, :2] *= 30.0
    encoded, y = round_trip(x)
    low_map = encoded.payload[0]  # the first byte holds the token bit map (bit i: token i at 3 bits)
    assert int(LOW_SHARE * 10) == 2 and [i for i in range(8) if low_map >> i & 1] == [4, 7]
    assert torch.allclose(y[0, 4], x[0, 4], atol=1e-3)


def test_a_samples_row_does_not_depend_on_its_batch():
    torch.manual_seed(2)
    x = torch.randn(3, 16, 64)
    x[1, :, 5] *= 40.0  # a sample with rotated tiles: its row is longer
    whole, _ = round_trip(x)
    alone = [round_trip(x[i:i + 1])[0].payload for i in range(3)]
    assert torch.equal(whole.payload, torch.cat(alone)) and len(alone[1]) > len(alone[0])


def test_a_width_that_is_not_a_multiple_of_the_tile_is_refused():
    with pytest.raises(CodecError, match="tiles of 64 channels, as published; a hidden size of 100"):
        build_codec("tahq", "fw").encode(torch.randn(2, 4, 100), torch.arange(2))
    bad = Header(KIND_ACTIVATION, 0, 0, (2, 4, 64), torch.uint8, 2, 7, codec=build_codec("tahq").code, flags=0)
    assert "outside" in build_codec("tahq").check_header(bad)


def test_a_hand_computed_sample():
    """Five tokens of one 64-channel tile each. Token 1 is a single spike: the lowest entropy (so it is the one
    3-bit token of five), an outlier tile (4 ≥ 2·0): its spike is swapped to position 0 and rotated into 64 equal
    values 4/8 = 0.5, an fp16 zero of 0.5 and a step of 0, and it comes back exactly. Token 0 is the ramp 0, 1/8, …,
    63/8: no outlier (63/8 < 2·62/8), zero 0, step fp16(63/8 / 15), codes round(x / step)."""
    torch.manual_seed(3)
    x = torch.randn(1, 5, 64) * 0.1
    x[0, 0] = torch.arange(64) / 8
    x[0, 1] = 0.0
    x[0, 1, 10] = 4.0
    encoded, y = round_trip(x)
    payload = encoded.payload
    assert payload[0] == 0b00010  # the token bit map: token 1 at 3 bits
    assert payload[1] == 0b00010  # the tile bit map: token 1's tile rotated (the small random tokens' are not)
    assert payload[2] == 10  # its pivot position, 6 bits
    zeros = payload[3:13].clone().view(torch.float16)
    steps = payload[13:23].clone().view(torch.float16)
    assert zeros[:2].tolist() == [0.0, 0.5] and steps[1] == 0.0
    step = torch.tensor(63 / 8 / 15).half()
    assert steps[0] == step
    assert torch.equal(y[0, 1], x[0, 1])  # the spike, exactly
    assert torch.equal(y[0, 0], (x[0, 0] / step.float()).round() * step.float())
    assert payload.numel() == 1 + 1 + 1 + 10 + 10 + 64 * 3 // 8 + 4 * 64 * 4 // 8


def _message(x: torch.Tensor):
    codec = build_codec("tahq", "fw")
    encoded = codec.encode(x, torch.arange(x.shape[0]))
    return codec, encoded.payload.clone(), Header.for_encoded(encoded, codec.code, KIND_ACTIVATION, 0, 0, x.shape[0])


def test_a_payload_that_cannot_be_its_samples_is_refused():
    torch.manual_seed(4)
    x = torch.randn(2, 10, 64)
    x[1, :, 3] *= 50.0  # the second sample's tiles rotated: its row is longer
    codec, payload, header = _message(x)
    ids = torch.arange(2)
    wrong_share = payload.clone()
    wrong_share[0] ^= 0x01  # a token more or less marked 3-bit
    with pytest.raises(CodecError, match="tokens as 3-bit, not 2"):
        codec.decode(header, wrong_share, ids)
    fewer_rotated = payload.clone()
    first_row = codec.encode(x[:1], ids[:1]).payload.numel()
    fewer_rotated[first_row + 2] = 0  # the second sample's tile map (after its 2-byte token map): none rotated
    with pytest.raises(CodecError, match="holds"):
        codec.decode(header, fewer_rotated, ids)


def test_the_layout_of_each_sample_is_read_on_the_bytes_as_they_arrived(monkeypatch):
    """A row's length varies with its rotated tiles. Read on the stage's GPU, the maps made the host wait for the
    GPU once per sample; read where the bytes arrived (the host), before they go to the device, they cost no wait."""
    from aqpipe.compress.link import tahq
    from tests.codec_cases import device_moves, device_reads

    torch.manual_seed(5)
    x = torch.randn(3, 10, 128)
    x[1, :, 70] *= 50.0
    codec, payload, header = _message(x)
    expected = codec.decode(header, payload, torch.arange(3))
    reads = device_reads(monkeypatch)
    moved = device_moves(monkeypatch, reads, tahq)
    y = codec.decode(header, payload, torch.arange(3))
    assert torch.equal(y, expected)
    assert reads and moved[0] == len(reads)  # no read of the payload's values after it was handed to the device
