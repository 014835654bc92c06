"""The capacity plan (aqpipe.runtime.capacity.plan): its numbers match what a real run measures — parameters, activation
bytes held per stage under each schedule, precision, recompute and LoRA, and the wire bytes per step per link —
`--dry-run` prints it and starts nothing, and a launch that does not fit is refused with exit 2 and its numbers."""

import json
import math
from pathlib import Path

import pytest
import torch

from aqpipe.cli import main
from aqpipe.config import resolve
from aqpipe.runtime.capacity import links as capacity_links
from aqpipe.runtime.capacity import plan as cap
from aqpipe.runtime.capacity.table import format_plan
from aqpipe.runtime.plan import make_plan
from tests import warm

SMALL = ["--pp", "4", "--seq-len", "32", "--max-samples", "32", "--micro-batch-size", "4", "--micro-batches", "4",
         "--fw", "aqsgd:3", "--bw", "directq:6", "--warmup-epochs", "0", "--device", "cpu", "--eval-every", "0"]


def flags_to_config(flags: list[str], out: Path):
    """The resolved RunConfig the CLI builds from `flags` (through the real parser)."""
    import dataclasses

    from aqpipe.cli import _parser
    from aqpipe.config import RunConfig, build_config

    args = _parser().parse_args(["launch", *flags, "--out", str(out)])
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig) if f.name != "stage_bounds"}
    return resolve(build_config({}, values))


@pytest.mark.parametrize("extra", [
    ["--model", "gpt2-tiny", "--schedule", "gpipe"],
    ["--model", "gpt2-tiny", "--schedule", "1f1b", "--precision", "bf16", "--recompute"],
    pytest.param(["--model", "gpt2-tiny", "--schedule", "eager-1f1b", "--lora", "4"], marks=pytest.mark.needs("peft")),
    ["--model", "llama-tiny", "--data", "builtin-instruct", "--seq-len", "64", "--max-samples", "48",
     "--precision", "bf16"],
    ["--model", "gpt2-tiny", "--first-sight", "rtq:4"],
], ids=["gpt2-gpipe", "gpt2-1f1b-bf16-recompute", "gpt2-eager-lora", "llama-instruct-bf16", "gpt2-first-sight"])
def test_the_plan_matches_what_a_real_run_measures(tmp_path, extra):
    flags = [*SMALL, *extra, "--epochs", "2", "--no-progress"]
    proc = warm.run("launch", *flags, "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    plan = make_plan(flags_to_config(flags[:-1], tmp_path / "plan"))
    capacity = cap.plan_capacity(plan)

    for stage in capacity.stages:  # parameters: the stage built for real
        module = plan.spec.build_stage(*stage.layers, plan.cfg.seed)
        if plan.lora is not None:
            from aqpipe.stages.lora import apply_lora

            apply_lora(module, stage.layers[0], plan.lora, plan.cfg.seed)
        params = list(module.parameters())
        assert stage.parameters == sum(p.numel() for p in params)
        assert stage.trainable == sum(p.numel() for p in params if p.requires_grad)
    # a CPU run replays no codec graphs, and the plan counts none
    assert records[-1]["stage_codec_graph_bytes"] == [s.codec_bytes for s in capacity.stages] == [0] * plan.cfg.pp
    measured = records[-1]["stage_peak_activation_bytes"]
    planned = [s.activation_bytes for s in capacity.stages]
    for got, want in zip(measured, planned):
        assert abs(got - want) <= 0.1 * max(got, 1), (measured, planned)
    steady = records[-1]  # the second epoch: every sample has an m(ξ), so AQ-SGD sends deltas only
    for link in capacity.links:
        assert abs(steady["link_fwd_bytes"][link.link] - link.fwd_bytes) <= 0.1 * link.fwd_bytes, (steady, link)
        assert abs(steady["link_bwd_bytes"][link.link] - link.bwd_bytes) <= 0.1 * link.bwd_bytes, (steady, link)
    first = records[0]  # the first epoch: every sample is new, so AQ-SGD sends it as --first-sight says
    if "builtin-instruct" in extra:  # real rows: the plan's step is the mean of the first steps' micro-batches
        assert abs(first["link_fwd_bytes"][0] - capacity.links[0].first_fwd_bytes) <= 0.05 * first["link_fwd_bytes"][0]
    else:
        assert first["link_fwd_bytes"][0] == capacity.links[0].first_fwd_bytes
    sent = sum(r["fwd_bytes"] + r["bwd_bytes"] for r in records)  # the whole run's link bytes, predicted
    assert abs(sent - capacity.run_link_bytes()[0]) <= 0.1 * sent


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["launch", *SMALL, "--model", "gpt2-tiny", "--bandwidth", "10mbit", "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert not out.exists()
    for needle in ("capacity plan: gpt2-tiny", "activations (held)", "0->1", "at --bandwidth 10mbit", "fits"):
        assert needle in printed, printed


@pytest.mark.parametrize("warmup", ["0", "1"])
def test_the_plan_shows_warm_up_traffic_only_for_a_run_with_a_warm_up(tmp_path, capsys, warmup):
    """With the defaults (no warm-up) a column of fp32 warm-up bytes described traffic the run never sends."""
    out = tmp_path / "run"
    assert main(["launch", *SMALL, "--model", "gpt2-tiny", "--warmup-epochs", warmup, "--dry-run", "--out",
                 str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("warm-up fwd/bwd" in printed) == (warmup == "1"), printed
    assert "m(xi) per side" in printed


def test_a_run_that_does_not_fit_is_refused_with_its_numbers(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("aqpipe.runtime.plan.available_memory", lambda: 5_000_000)  # 5 MB of RAM: the tiny model needs ~70 MB
    out = tmp_path / "run"
    code = main(["launch", *SMALL, "--model", "gpt2-tiny", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "does not fit" in err[0] and "of RAM" in err[0] and "but 5 MB is available" in err[0]
    assert not (out / "metrics.jsonl").exists()
    assert main(["launch", *SMALL, "--model", "gpt2-tiny", "--dry-run", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "stage  layers" in captured.out and "does not fit" in captured.err


def test_wire_bytes_of_each_codec_equal_a_real_message():
    from aqpipe.compress.link.factory import build_codec
    from aqpipe.compress.link.options import QuantOptions
    from aqpipe.compress.link.specs import parse_spec

    options = QuantOptions()
    x = torch.randn(3, 7, 20)
    for spec, direction in [("fp32", "fw"), ("fp16", "fw"), ("directq:4", "fw"), ("topk:0.1:8", "bw"), ("bf16", "bw"),
                            ("rtq:4", "bw")]:
        parsed = parse_spec(spec, direction)
        encoded = build_codec(parsed, direction, options=options).encode(x, torch.arange(3))
        assert encoded.payload.numel() == capacity_links.steady_payload_bytes(parsed, direction, x.shape, x.dtype, options)

    assert capacity_links.raw_payload_bytes(parse_spec("fp32", "fw"), (3, 7, 20), torch.bfloat16) == 3 * 7 * 20 * 2
    assert capacity_links.raw_payload_bytes(parse_spec("aqsgd:3", "fw"), (3, 7, 20), torch.float32) == 3 + 3 * 7 * 20 * 4


def test_dry_run_reports_a_store_that_does_not_fit_beside_the_plan(tmp_path, capsys, monkeypatch):
    from aqpipe.runtime import plan as plan_module

    monkeypatch.setattr(plan_module, "available_memory", lambda: 1000)  # the stores' check sees 1 kB of RAM
    code = main(["launch", *SMALL, "--model", "gpt2-tiny", "--store", "memory", "--dry-run", "--out",
                 str(tmp_path / "run")])
    captured = capsys.readouterr()
    assert code == 2 and "stage  layers" in captured.out and "m(xi) per side" in captured.out
    assert "does not fit" in captured.out and "the m(xi) stores need about" in captured.err


def _gpu_plan(stage_bytes: int, ranks: int):
    """A capacity plan of `ranks` stages of `stage_bytes` each, all on one GPU (what check_fits reads of a plan)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(device="cuda", world_size=ranks, pp=ranks, dp=1, store_device="cpu")
    stages = [SimpleNamespace(memory_bytes=stage_bytes, sync_peak_bytes=0) for _ in range(ranks)]
    return cap.CapacityPlan(cfg, stages, [])


def test_a_gpu_fits_by_its_free_memory_with_a_context_and_allocator_headroom_per_rank(monkeypatch):
    """The plan once compared the ranks' tensors with the GPU's total memory. 4 ranks of 10 GiB on an 80 GiB
    GPU of which another process uses 35 GiB: 40 GiB of tensors 'fit' the total, but with a CUDA context and the
    caching allocator's headroom each they need about 48.5 GiB, and 45 GiB are free."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda gpu: SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda gpu: 35 << 30)
    assert cap.gpu_free_bytes(0) == (45 << 30, True)
    assert cap.gpu_bytes_needed([10 << 30] * 4) == 4 * (int((10 << 30) * cap.ALLOCATOR_HEADROOM) + cap.CUDA_CONTEXT_BYTES)
    refused = _gpu_plan(10 << 30, 4)
    cap.check_fits(refused)
    assert refused.available == {"cuda:0": 45 << 30}
    assert len(refused.problems) == 1 and "of its 4 rank(s), with 671 MB of CUDA context each" in refused.problems[0]
    assert "but has 48.3 GB free" in refused.problems[0]
    fits = _gpu_plan(8 << 30, 4)
    cap.check_fits(fits)
    assert fits.problems == []

    def no_nvml(gpu):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "device_memory_used", no_nvml)  # then the total is all that is known, and said
    unknown = _gpu_plan(20 << 30, 4)
    cap.check_fits(unknown)
    assert "in all (free memory unknown: no pynvml)" in unknown.problems[0]


def test_a_gpu_runs_plan_counts_what_its_codecs_cuda_graphs_hold_and_a_cpu_runs_nothing(tmp_path, monkeypatch):
    """Each codec's CUDA graphs keep their inputs and memory pools for the run, in the GPU's memory: the plan of a
    CUDA run counts them per stage (a middle stage runs four link ends, the first and the last two), a CPU run or
    one with graphs off holds none."""
    import dataclasses

    cfg = flags_to_config(SMALL, tmp_path)
    cpu = cap.plan_capacity(make_plan(cfg))
    assert all(s.codec_bytes == 0 for s in cpu.stages)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # (the GPU check then says there is none)
    gpu = cap.plan_capacity(make_plan(dataclasses.replace(cfg, device="cuda")))
    graphs = [s.codec_bytes for s in gpu.stages]
    assert graphs[1] == graphs[2] > max(graphs[0], graphs[3]) and min(graphs) > 0, graphs
    values = 1
    for size in gpu.links[0].activation_shape:
        values *= size
    assert graphs[0] >= values * (4 + 2)  # at least the copies of AQ-SGD's inputs: the activations, and m(ξ) in fp16
    for before, after in zip(cpu.stages, gpu.stages):
        assert after.memory_bytes - before.memory_bytes == after.codec_bytes
    assert "codec CUDA graphs (held for the run" in format_plan(gpu)
    monkeypatch.setenv("AQPIPE_CUDA_GRAPHS", "0")
    off = cap.plan_capacity(make_plan(dataclasses.replace(cfg, device="cuda")))
    assert all(s.codec_bytes == 0 for s in off.stages)
    assert "codec CUDA graphs" not in format_plan(off)


def test_a_gpu_plan_counts_the_fused_delta_steps_graphs_where_m_lies_in_gpu_slabs(tmp_path, monkeypatch):
    """AQ-SGD's fused delta step replays a graph of its own only over a GPU store's slab rows (`--store-device
    cuda`), holding its inputs' copies and outputs: the plan counts them there; with m(ξ) in host RAM the step runs
    ungraphed and holds nothing (its torch-ops graphs are not made either)."""
    import dataclasses

    from aqpipe.compress.gpu import fused

    if fused._kernels() is None:
        pytest.skip("Triton is not installed")
    monkeypatch.setenv(fused.DELTA_SWITCH, "1")  # (fused at this test's small micro-batch too)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    cfg = dataclasses.replace(flags_to_config(SMALL, tmp_path), device="cuda")
    host_ram = cap.plan_capacity(make_plan(dataclasses.replace(cfg, store_device="cpu")))
    slabs = cap.plan_capacity(make_plan(dataclasses.replace(cfg, store_device="cuda")))
    values = math.prod(slabs.links[0].activation_shape)
    for ram, slab in zip(host_ram.stages, slabs.stages):
        # each fused end's graph: at least its activation copied in (sender) or decoded out (receiver), in float32
        ends = 2 if 0 < slab.stage < len(slabs.stages) - 1 else 1
        assert slab.codec_bytes - ram.codec_bytes >= ends * values * 4, (slab.codec_bytes, ram.codec_bytes)


def test_the_plan_counts_the_grad_syncs_copies_where_its_collectives_run(tmp_path, monkeypatch):
    """With replicas, the grad sync holds fp32 copies of a stage's trained parameters (`registry.sync_copies`): what
    its method keeps from step to step (error feedback's residual), beside the activations, and at its peak after
    the backward passes, when the activations are gone. They live where the collectives run: on the host for a CPU
    run, on each rank's GPU under NCCL (a GPU per rank); under gloo (ranks sharing a GPU) only the flat gradient and
    its result are on the GPU. The plan left them out, so a run that 'fit' a GPU under NCCL could run out of memory
    at its first grad sync."""
    import dataclasses

    from aqpipe.compress.grad.registry import sync_copies

    monkeypatch.setattr(cap, "check_fits", lambda capacity: None)  # (the numbers alone: no machine to fit)
    cfg = flags_to_config([*SMALL, "--dp", "2"], tmp_path)
    single = cap.plan_capacity(make_plan(dataclasses.replace(cfg, dp=1, grad_sync="ef:4")))
    assert all(s.sync_kept_bytes == s.sync_peak_bytes == 0 for s in single.stages)
    assert "grad sync" not in format_plan(single)
    ef = cap.plan_capacity(make_plan(dataclasses.replace(cfg, grad_sync="ef:4")))
    kept, peak = sync_copies("ef:4", 2)
    assert (kept, peak) == (1, 8.6 + 2 * 4 / 32)
    for before, after in zip(single.stages, ef.stages):
        assert (after.sync_kept_bytes, after.sync_peak_bytes) == (int(4 * after.trainable),
                                                                  int(4 * peak * after.trainable))
        model = after.weight_bytes + after.grad_bytes + after.optimizer_bytes
        assert after.memory_bytes == model + max(after.activation_bytes + after.sync_kept_bytes, after.sync_peak_bytes)
        assert before.memory_bytes == model + before.activation_bytes
    assert "grad sync (--grad-sync ef:4, --dp 2), on the host: kept / at its peak" in format_plan(ef)
    for gpus, where in ((8, "device"), (1, "RAM")):  # 8 ranks: a GPU each (NCCL), or all on one (gloo)
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        gpu = cap.plan_capacity(make_plan(dataclasses.replace(cfg, device="cuda", grad_sync="ef:4")))
        assert {s.sync_where for s in gpu.stages} == {where}
        for s in gpu.stages:
            copies = (kept, peak) if where == "device" else (0, 2.0)
            assert (s.sync_kept_bytes, s.sync_peak_bytes) == (int(4 * copies[0] * s.trainable),
                                                              int(4 * copies[1] * s.trainable))


def test_a_tied_table_the_first_stage_only_looks_rows_up_in_is_not_in_its_grad_sync(tmp_path):
    """Under --tied-exchange rows the first stage's copy of a tied embedding is a row cache that the last stage updates
    (its optimizer leaves it out, and so does its grad sync): the plan counted the table in both stages' syncs."""
    planned = {}
    for exchange in ("rows", "dense"):
        cfg = flags_to_config(["--model", "llama-tiny", "--pp", "2", "--dp", "2", "--tied-exchange", exchange],
                              tmp_path / exchange)
        planned[exchange] = cap.plan_capacity(make_plan(cfg)).stages
    table = max((shape for shape in planned["dense"][0].synced_shapes), key=math.prod)  # the embedding
    assert table in planned["dense"][0].synced_shapes and table in planned["dense"][1].synced_shapes
    assert table not in planned["rows"][0].synced_shapes and table in planned["rows"][1].synced_shapes
    assert planned["rows"][0].sync.steady < planned["dense"][0].sync.steady


def test_a_tied_row_cache_holds_no_optimizer_state_or_grad_sync_memory(tmp_path, monkeypatch):
    """The first stage's row cache (--tied-exchange rows) is not in its optimizer nor its grad sync
    (`runtime.assemble`), so it holds no AdamW moments and no error-feedback copies there: the plan counted them
    (SmolLM2-135M's table: ~226 MB of moments and ~1 GB of ef peak on stage 0), and could refuse a run that fits."""
    from aqpipe.compress.grad.registry import sync_copies
    from aqpipe.pipeline.links.tied_rows import table_parameter
    from aqpipe.pipeline.numerics.tied import row_tables
    from aqpipe.runtime.capacity.stage_trace import state_copies

    monkeypatch.setattr(cap, "check_fits", lambda capacity: None)  # (the numbers alone)
    cfg = flags_to_config(["--model", "llama-tiny", "--pp", "2", "--dp", "2", "--tied-exchange", "rows",
                           "--grad-sync", "ef:4", "--optimizer", "adamw"], tmp_path)
    plan = make_plan(cfg)
    stages = cap.plan_capacity(plan).stages
    kept, peak = sync_copies("ef:4", 2)
    copies = state_copies(cfg)
    for stage in stages:
        module = plan.build_stage(stage.stage)
        trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
        cache = table_parameter(module, row_tables(plan.spec.extras, cfg.pp, cfg.tied_spec)[0])[1]
        held = trained - (cache.numel() if stage.stage == 0 else 0)  # what the optimizer and the sync hold
        assert stage.stage != 0 or held < trained
        assert stage.grad_bytes == 4 * trained  # the cache's gradient is formed (its rows go to the owner)
        assert stage.optimizer_bytes == 4 * copies * held
        assert (stage.sync_kept_bytes, stage.sync_peak_bytes) == (int(4 * kept * held), int(4 * peak * held))


def test_evaluations_over_a_run_are_every_n_steps_and_after_the_last():
    from aqpipe.runtime.capacity.eval_passes import eval_passes

    assert [eval_passes(10, every) for every in (0, None, 1, 3, 5, 20)] == [0, 1, 10, 4, 2, 1]


def test_the_plan_counts_the_held_out_passes_through_the_evaluation_codec(tmp_path, capsys):
    from aqpipe.compress.link.factory import message_bytes
    from aqpipe.compress.link.options import QuantOptions

    flags = [*SMALL, "--model", "gpt2-tiny", "--steps", "6", "--eval-every", "4", "--eval-samples", "10"]
    plans = {codec: cap.plan_capacity(make_plan(flags_to_config([*flags, "--eval-codec", codec], tmp_path / codec)))
             for codec in ("fp32", "rtqo:7")}
    exact, coded = plans["fp32"].evaluation, plans["rtqo:7"].evaluation
    assert exact.samples == coded.samples == 10 and exact.passes == coded.passes == 2  # after steps 4 and 6
    assert exact.pass_bytes == exact.lossless_pass_bytes
    per_sample = sum(message_bytes("rtqo:7", "fw", (1, *link.activation_shape[1:]), torch.float32, QuantOptions())
                     for link in plans["rtqo:7"].links)
    assert coded.pass_bytes == 10 * per_sample and coded.run_bytes == 2 * coded.pass_bytes
    assert 3.5 < exact.pass_bytes / coded.pass_bytes < 4.6
    assert "evaluation (--eval-codec rtqo:7, 10 held-out samples)" in format_plan(plans["rtqo:7"])
    never = cap.plan_capacity(make_plan(flags_to_config([*SMALL, "--model", "gpt2-tiny"], tmp_path / "never")))
    assert never.evaluation is None  # (SMALL says --eval-every 0)


def narrow_lm(vocab_size: int):
    """The Python API's example model, 48 channels wide (not a multiple of TAH-Quant's 64-channel tiles)."""
    from examples.custom_model import tiny_lm

    return tiny_lm(vocab_size, width=48)


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_codec_that_cannot_code_the_models_activations_is_refused_with_one_line(tmp_path, capsys, dry_run):
    """`--fw tahq` on a model 48 channels wide (TAH-Quant's tiles need more) stops the plan and the launch with one
    line, exit 2, not a CodecError's traceback."""
    flags = ["--model", "tests.test_capacity:narrow_lm", "--pp", "2", "--fw", "tahq", "--steps", "1",
             "--seq-len", "16", "--max-samples", "16", "--out", str(tmp_path / "run")]
    assert main(["launch", *flags, *(["--dry-run"] if dry_run else [])]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "tahq" in lines[0] and "hidden size of 48" in lines[0], lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
