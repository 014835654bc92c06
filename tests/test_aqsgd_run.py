"""AQ-SGD across real processes: both copies of m(ξ) agree bit for bit on every link, first sight is full precision,
and the compressed epochs send b/8 bytes per value plus the scales."""

import json

import pytest
import torch

from aqpipe.compress.quantize import scale_count
from aqpipe.config import RunConfig, resolve
from aqpipe.launch.job import run_job
from tests import warm


def run(tmp_path, **kw):
    settings = dict(model="gpt2-tiny", seq_len=16, micro_batch_size=2, micro_batches=3, epochs=3, lr=1e-3,
                    max_samples=48, eval_samples=16, device="cpu", out=str(tmp_path / "run"), fw="aqsgd:2", bw="directq:4",
                    store_dump="on", warmup_epochs=1)
    settings.update(kw)
    cfg = resolve(RunConfig(**settings))
    assert run_job(cfg, progress=False, starter=warm.ranks()) == 0
    out = tmp_path / "run"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    stores = {int(p.stem.split("-")[1]): torch.load(p, weights_only=True) for p in (out / "store").iterdir()}
    return cfg, records, stores, json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("pp,dp", [(3, 1), (2, 2)])
def test_both_copies_of_every_m_agree_after_several_epochs(tmp_path, pp, dp):
    cfg, records, stores, summary = run(tmp_path, pp=pp, dp=dp)
    samples_per_replica = 48 // dp
    for replica in range(dp):
        for link in range(pp - 1):
            sender = stores[replica * pp + link]
            receiver = stores[replica * pp + link + 1]
            sent = {k: v for k, v in sender.items() if k.startswith(f"{link}/send/")}
            got = {k.replace("/recv/", "/send/"): v for k, v in receiver.items() if k.startswith(f"{link}/recv/")}
            assert len(sent) == samples_per_replica and sent.keys() == got.keys()
            for key, value in sent.items():
                assert value.dtype == torch.float16
                assert torch.equal(value.view(torch.int16), got[key].view(torch.int16)), key
    assert summary["store"]["misses"] == 0  # every sample was seeded in the warm-up epoch
    for r in records:  # AQ-SGD's fidelity per link: none in the warm-up epoch, then every link, every step
        if r["epoch"] == 0:
            assert "link_aqsgd_change" not in r
        else:
            assert len(r["link_aqsgd_change"]) == len(r["link_aqsgd_error"]) == pp - 1
            assert all(0 < e < c for c, e in zip(r["link_aqsgd_change"], r["link_aqsgd_error"]))
    assert len(summary["aqsgd"]["change"]) == pp - 1
    assert summary["store"]["hits"] == (pp - 1) * 48 * 2  # two compressed epochs, each sample once per link


def test_first_sight_is_full_precision_and_later_epochs_cost_b_over_8(tmp_path):
    cfg, records, _, summary = run(tmp_path, pp=2, warmup_epochs=0, epochs=3, fw="aqsgd:2", first_sight="fp32")
    hidden, tokens = 128, cfg.seq_len
    per_element_full = 4 + 1 / (tokens * hidden)  # fp32 values plus one mode byte per sample
    first_epoch = [r for r in records if r["epoch"] == 0]
    later = [r for r in records if r["epoch"] > 0]
    for r in first_epoch:
        assert r["fwd_bytes_per_element"] == pytest.approx(per_element_full, rel=1e-9)
    expected = 2 / 8 + 2 * scale_count((1, tokens, hidden), "channel") / (tokens * hidden)
    for r in later:
        assert abs(r["fwd_bytes_per_element"] - expected) <= 0.02 * expected
        assert r["bwd_bytes_per_element"] == pytest.approx(4 / 8 + 2 * hidden / (tokens * hidden), rel=1e-9)
    assert summary["store"] == {"hits": 48 * 2, "misses": 48, "reseeded": 0, "overflow": 0}
    assert summary["link_bytes"]["per_link_fwd"] == [summary["link_bytes"]["fwd"]]
    # the fidelity of the deltas: none in the first epoch (all first sights), then m(ξ) nearer the activation than
    # the activation to its last visit's (nearest rounding never adds error), and both well inside (0, 1)
    assert all("link_aqsgd_change" not in r for r in first_epoch)
    for r in later:
        (change,), (error,) = r["link_aqsgd_change"], r["link_aqsgd_error"]
        assert 0 < error < change
    assert summary["aqsgd"]["error"][0] < summary["aqsgd"]["change"][0]


def test_warm_up_epochs_send_everything_uncompressed(tmp_path):
    _, records, _, _ = run(tmp_path, pp=2, warmup_epochs=2, epochs=3, fw="aqsgd:3", bw="topk:0.2:8")
    for r in records:
        if r["epoch"] < 2:
            assert r["fwd_bytes_per_element"] > 4 and r["bwd_bytes_per_element"] == 4
        else:
            assert r["fwd_bytes_per_element"] < 0.51 and r["bwd_bytes_per_element"] < 1  # 3/8 + scales; a 20% top-k
    assert records[-1]["loss"] < records[0]["loss"]


def test_by_default_a_run_compresses_from_the_first_step_and_its_first_sights_seed_both_copies_alike(tmp_path):
    """The defaults (--first-sight rtqo:3 --warmup-epochs 0): the first epoch's activations go as rotated 3-bit
    tiles with each token's largest value set apart (3 bits and one fp16 scale per 64 values, 4 bytes a token, plus
    a mode byte per sample) instead of fp32, and both copies of m(ξ) are seeded from them bit for bit, so every later
    delta checks out."""
    defaults = RunConfig()
    cfg, records, stores, summary = run(tmp_path, pp=2, warmup_epochs=defaults.warmup_epochs, epochs=2,
                                        fw="aqsgd:2", first_sight=defaults.first_sight)
    assert (cfg.warmup_epochs, cfg.first_sight) == (0, "rtqo:3")
    hidden, tokens = 128, cfg.seq_len
    first_epoch = [r for r in records if r["epoch"] == 0]
    expected = 3 / 8 + 2 / 64 + 4 / hidden + 1 / (tokens * hidden)
    for r in first_epoch:
        assert r["fwd_bytes_per_element"] == pytest.approx(expected, rel=1e-9)
        assert r["bwd_bytes_per_element"] < 1  # directq:4 from the first step too
    sent = {k: v for k, v in stores[0].items() if k.startswith("0/send/")}
    got = {k.replace("/recv/", "/send/"): v for k, v in stores[1].items() if k.startswith("0/recv/")}
    assert len(sent) == 48 and sent.keys() == got.keys()
    assert all(torch.equal(v.view(torch.int16), got[k].view(torch.int16)) for k, v in sent.items())
    assert summary["store"]["misses"] == 48 and summary["store"]["hits"] == 48
    assert records[-1]["loss"] < records[0]["loss"]
    later = 2 / 8 + (2 * hidden + 1) / (tokens * hidden)  # the second epoch: 2-bit deltas, a scale per channel
    assert summary["bytes_per_element"]["fwd"] == pytest.approx((expected + later) / 2, rel=0.02)
    assert summary["bytes_per_element"]["bwd"] == pytest.approx(4 / 8 + 2 * hidden / (tokens * hidden), rel=1e-9)
