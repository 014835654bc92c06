"""Sample coders (aqpipe.compress.link.sample_coders) beyond what every link codec's tests cover: rtqo's tokens'
largest values set apart, and the coders' CUDA graphs told apart by class."""

import pytest
import torch

from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.specs import CodecError
from aqpipe.pipeline.links.transport import KIND_ACTIVATION, Header
from tests.codec_cases import send


def sink_activations() -> torch.Tensor:
    """SmolLM2-like hidden states: each sample's first token holds one massive activation (an attention sink's)."""
    torch.manual_seed(0)
    x = torch.randn(4, 16, 576)
    x[:, :, 3] *= 8.0  # a mildly larger channel on every token
    x[:, 0, 507] = 24992.0  # (an fp16 value)
    return x


def test_rtqo_sends_each_tokens_largest_value_apart_and_the_rest_of_its_tile_finely():
    x = sink_activations()
    ids = torch.arange(4)
    plain, with_largest = (send(build_codec(spec), build_codec(spec), x, ids) for spec in ("rtq:4", "rtqo:4"))
    t = 16
    assert with_largest[0].payload.numel() == plain[0].payload.numel() + 4 * 4 * t  # fp16 value + 16-bit channel
    y = with_largest[1]
    assert torch.equal(y[:, 0, 507], torch.full((4,), 24992.0))  # the massive value exact
    others = [c for c in range(448, 512) if c != 507]  # the sink's 64-channel tile, without the sink itself
    err_plain = (plain[1][:, 0, others] - x[:, 0, others]).pow(2).sum()
    err_apart = (y[:, 0, others] - x[:, 0, others]).pow(2).sum()
    assert err_apart < err_plain / 50  # rotated without it, the rest of the tile gets a scale of its own size
    assert (y - x).pow(2).sum() < 0.2 * (plain[1] - x).pow(2).sum()


def test_rtqo_keeps_a_samples_bytes_its_own_zeros_zero_and_any_width():
    x = sink_activations()
    codec = build_codec("rtqo:3")
    whole = codec.encode(x, torch.arange(4)).payload.view(4, -1)
    alone = codec.encode(x[2:3], torch.arange(1)).payload.view(1, -1)
    assert torch.equal(whole[2:3], alone)
    zeros = torch.zeros(2, 5, 100)  # 100 = 64 + 32 + 4 channels
    zeros[0, :, :50] = torch.randn(5, 50)
    encoded, y = send(codec, build_codec("rtqo:3"), zeros, torch.arange(2))
    assert torch.equal(y[1], torch.zeros(5, 100)) and torch.equal(y[0, :, 64:], torch.zeros(5, 36))
    flat = torch.randn(3, 40)  # a 2-D batch: one token per sample
    _, y = send(codec, build_codec("rtqo:3"), flat, torch.arange(3))
    largest = flat.abs().argmax(dim=1, keepdim=True)
    assert torch.equal(y.gather(1, largest), flat.gather(1, largest).half().float())


def test_rtqo_names_channels_past_32767_and_refuses_65535_on_either_end():
    x = torch.randn(1, 2, 65534)
    x[0, 0, 39999] = 500.0
    x[0, 1, 65533] = -700.0  # the highest channel it can name
    _, y = send(build_codec("rtqo:4"), build_codec("rtqo:4"), x, torch.arange(1))
    assert y[0, 0, 39999] == 500.0 and y[0, 1, 65533] == -700.0
    with pytest.raises(CodecError, match="fewer than 65535 channels"):
        build_codec("rtqo:4").encode(torch.randn(1, 1, 65535), torch.arange(1))
    receiver = build_codec("rtqo:4")
    header = Header(KIND_ACTIVATION, 0, 0, (1, 1, 65535), torch.uint8, 1, 40000, codec=receiver.code,
                    flags=receiver.flags())
    assert "fewer than 65535 channels" in receiver.check_header(header)  # asked before the payload is read


def test_rtqo_leaves_a_value_fp16_cannot_hold_in_its_tile_as_rtq_carries_it():
    x = torch.randn(2, 3, 128)
    x[0, 1, 70] = 200000.0  # beyond fp16: rotated, 1/8 of it per position, as rtq carries it
    x[1, 2, 5] = float("nan")
    codec = build_codec("rtqo:4")
    rows, values = codec.coder.encode(x, values=True)
    carried = codec.coder.carried(x, rows)
    assert carried.tolist() == [True, False]  # the NaN's sample is not (AQ-SGD then sends it losslessly)
    _, y = send(codec, build_codec("rtqo:4"), x[:1], torch.arange(1))
    _, plain = send(build_codec("rtq:4"), build_codec("rtq:4"), x[:1], torch.arange(1))
    assert torch.isfinite(y).all() and torch.equal(y[0, 1], plain[0, 1])  # that token coded exactly as rtq codes it
    assert torch.equal(values[:1], y)  # and the sender's values are the receiver's


def test_rtq_and_rtqo_never_share_a_cuda_graph(monkeypatch):
    """The two coders' graphs are told apart by class: a replay of one coder's graph for the other would send rtq's
    bytes as rtqo's."""
    from aqpipe.compress.gpu import cuda_graphs

    captured = []

    def capture(fn, tensors, held=()):
        inputs = tuple(t.clone() for t in tensors)
        outputs = tuple(fn(*inputs))
        captured.append(fn)
        return cuda_graphs._Graph(type("Replay", (), {"replay": lambda self: None})(), inputs, outputs)

    cuda_graphs.clear()
    monkeypatch.setattr(cuda_graphs, "_replays_on", lambda device: True)
    monkeypatch.setattr(cuda_graphs, "_stream_id", lambda device: 0)
    monkeypatch.setattr(cuda_graphs, "_capture", capture)
    try:
        x = torch.randn(2, 4, 64)
        for spec in ("rtq:4", "rtqo:4"):
            coder = build_codec(spec).coder
            for _ in range(3):
                rows, _ = coder.encode(x)
            assert rows.shape[1] == coder.sample_bytes(tuple(x.shape))
        assert len(captured) == 2
    finally:
        cuda_graphs.clear()
