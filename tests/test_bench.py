"""`aqpipe bench` (aqpipe.bench): it measures the run's stages, codecs and link on this machine, and recommends the
most faithful AQ-SGD bits whose wire time per micro-batch stays within the slowest stage's compute."""

import pytest

from aqpipe.bench import FW_BITS, loopback_rate, recommend
from aqpipe.cli import main
from aqpipe.config import RunConfig, resolve
from aqpipe.runtime.capacity.links import LinkNeeds

SHAPE = (4, 64, 256)


def link() -> LinkNeeds:
    return LinkNeeds(0, SHAPE, "float32", 0, 0, 0, 0, 0)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_the_recommendation_is_the_most_bits_whose_wire_time_fits_the_compute(pp):
    """Each rank is behind a link of its own: with two stages each sends one direction of the one link, but from three
    stages on a middle rank sends its activations forward and its gradients backward over its link, both per
    micro-batch. The recommendation took the larger of the two for any pipeline, and so could leave a middle rank's
    link the bottleneck (at 2x the compute)."""
    from aqpipe.runtime.capacity.step_wire import links_seconds, rank_traffic

    cfg = resolve(RunConfig(model="gpt2-tiny", pp=pp, device="cpu"))
    compute = 0.05

    def busiest_link(fwd: float, bwd: float) -> float:
        """A micro-batch's wire time on the busiest rank's link under 1F1B, which the advice sets (the plan's model;
        seconds as nanosecond 'bytes' at 8 Gbit/s)."""
        return links_seconds(rank_traffic([(round(fwd * 1e9), round(bwd * 1e9))] * (pp - 1)), 8e9, overlapped=True)

    for rate in (1e3, 1e5, 3e5, 1e6, 1e7, 1e9):
        bits, bound, wire = recommend(link(), cfg, rate, compute)
        fitting = [b for b in FW_BITS if busiest_link(*wire[b]) <= compute * (1 + 1e-9)]
        assert bits == (fitting[0] if fitting else 2) and bound == (not fitting)
        assert all(wire[a][0] > wire[b][0] for a, b in zip(FW_BITS, FW_BITS[1:]))  # fewer bits, fewer bytes
    assert recommend(link(), cfg, 1e3, compute)[:2] == (2, True)  # a link far too slow: the fewest bits, link-bound
    assert recommend(link(), cfg, 1e12, compute)[:2] == (8, False)


def test_the_loopback_rate_is_measured():
    assert loopback_rate(8 << 20) > 1e7  # any machine's loopback moves more than 10 MB/s


def test_bench_prints_its_measurements_and_a_recommendation(tmp_path, capsys):
    code = main(["bench", "--model", "gpt2-tiny", "--pp", "2", "--seq-len", "32", "--max-samples", "32",
                 "--bandwidth", "20mbit", "--device", "cpu", "--out", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "b").exists()
    for needle in ("stage  forward+backward", "aqsgd:3", "directq:6", "link: 20 Mbit/s (--bandwidth)", "recommended: --fw aqsgd:"):
        assert needle in out, out
    speeds = [float(line.split()[-1]) for line in out.splitlines() if line.startswith(("fp32 ", "aqsgd:", "directq:"))
              and len(line.split()) == 2]
    assert speeds and all(s > 0 for s in speeds)
    assert "over the run: " in out and "fewer than lossless links" in out


def test_bench_counts_coded_first_sights(tmp_path, capsys):
    code = main(["bench", "--model", "gpt2-tiny", "--pp", "2", "--seq-len", "32", "--max-samples", "32",
                 "--bandwidth", "20mbit", "--device", "cpu", "--warmup-epochs", "0", "--first-sight", "rtq:4",
                 "--out", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("first sights (--first-sight rtq:4, --warmup-epochs 0)"))
    # a micro-batch of 4 samples of 32 x 128: a mode byte each, 4 bits and one fp16 scale per 64 values
    assert f"{(4 + 4 * (32 * 128 // 2 + 2 * 32 * 2)) / 1e6:.3g} MB" in line


def test_bench_refuses_a_bad_rate_with_one_line(tmp_path, capsys):
    assert main(["bench", "--model", "gpt2-tiny", "--bandwidth", "fast", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--bandwidth" in err[0]


def test_the_report_counts_the_tied_exchange_and_its_time_on_the_link():
    from aqpipe.bench import BenchResult, format_bench
    from aqpipe.runtime.capacity.plan import TiedNeeds

    cfg = resolve(RunConfig(model="llama-tiny", pp=4, device="cpu"))
    tied = TiedNeeds("rows", 3_000_000, 113_000_000, 650.0)
    report = format_bench(BenchResult([0.1] * 4, {}, 0, 12.5e6, "--bandwidth", {}, 8, False, tied), cfg)
    line = next(line for line in report.splitlines() if line.startswith("tied embedding/LM head"))
    assert "3 MB per step between stage 0 and stage 3" in line and "~650 distinct tokens" in line
    assert "dense would send 678 MB" in line and line.endswith("; 0.24 s per step on this link")


def test_the_report_says_when_ranks_share_a_gpu_and_how_mps_helps():
    """Four ranks on one GPU: the report carries the MPS note; a GPU per rank carries none."""
    from aqpipe.bench import BenchResult, format_bench
    from aqpipe.launch.gpu_sharing import sharing_note

    cfg = resolve(RunConfig(model="gpt2-tiny", pp=4, device="cpu"))
    shared = BenchResult([0.1] * 4, {}, 0, 12.5e6, "loopback", {}, 8, False,
                         gpu_sharing=sharing_note("cuda", 4, 1, mps=False))
    assert "gpu: 4 ranks share each GPU without NVIDIA MPS" in format_bench(shared, cfg)
    alone = BenchResult([0.1] * 4, {}, 0, 12.5e6, "loopback", {}, 8, False, gpu_sharing=sharing_note("cuda", 4, 4))
    assert "gpu:" not in format_bench(alone, cfg)


def test_the_recommendation_counts_only_the_real_tokens_of_padded_batches(tmp_path, monkeypatch):
    """Instruction data over real rows: each candidate's wire time per micro-batch is that of the first steps' mean
    micro-batch of real rows, as the capacity plan counts the run's own codecs."""
    from aqpipe.runtime.capacity.plan import plan_capacity
    from aqpipe.runtime.capacity.rows import row_shapes
    from aqpipe.runtime.plan import make_plan

    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    cfg = resolve(RunConfig(model="llama-tiny", data="builtin-instruct", pp=2, seq_len=64, max_samples=32,
                            fw="aqsgd:3", bw="directq:6", device="cpu", out=str(tmp_path / "run")))
    plan = make_plan(cfg)
    the_link = plan_capacity(plan).links[0]
    rate = 1e6
    _, _, real = recommend(the_link, cfg, rate, 1.0, row_shapes(plan))
    _, _, padded = recommend(the_link, cfg, rate, 1.0)
    assert real[3] == pytest.approx((the_link.fwd_bytes / cfg.micro_batches / rate,
                                     the_link.bwd_bytes / cfg.micro_batches / rate), rel=1e-6)
    assert all(real[bits][0] < 0.9 * padded[bits][0] for bits in FW_BITS)
