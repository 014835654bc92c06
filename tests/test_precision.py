"""Mixed precision (aqpipe.pipeline.numerics.mixed_precision) and recomputation: bf16 through a pipeline computes what one stage
computes, bit for bit (lossless links carry the activation's own dtype); fp16's loss scale is one decision for the
whole world — a gradient that overflows on one rank skips the step on every rank; --recompute changes no bit of
the losses or weights and holds fewer activation bytes."""

import json
from pathlib import Path

import pytest
import torch

from aqpipe.config import RunConfig, resolve
from aqpipe.pipeline.numerics.mixed_precision import LossScaler
from tests import warm
from tests.distributed import run_ranks

STEPS = 4


def config(out: Path, pp: int, **extra) -> RunConfig:
    values = dict(model="llama-tiny", seq_len=32, micro_batch_size=2, micro_batches=3, steps=STEPS, lr=3e-3,
                  warmup_steps=1, seed=5, max_samples=96, eval_samples=16, device="cpu", out=str(out), fw="fp32", bw="fp32", pp=pp,
                  dropout=0.1)
    values.update(extra)
    return resolve(RunConfig(**values))


def _train(rank: int, world: int, pp: int, out: str, extra: dict, poison: tuple[int, int] | None = None) -> dict:
    """Train STEPS steps on this rank; `poison` = (rank, step): that rank's gradients become inf at that step."""
    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.plan import make_plan
    from aqpipe.runtime.rank.assemble import assemble_stage

    torch.set_num_threads(1)
    plan = make_plan(config(Path(out), pp, **extra))
    torch.manual_seed(plan.cfg.seed)
    stage = assemble_stage(plan, Grid(pp, 1, rank), torch.device("cpu"), "gloo")
    worker = stage.worker
    epochs = plan.epoch_plan(0)
    result: dict = {"losses": [], "overflow": [], "scale": [], "peaks": [], "states": []}
    try:
        for step in range(STEPS):
            hook = None
            if poison is not None and poison == (rank, step):
                first = next(p for p in worker.module.parameters() if p.requires_grad)
                hook = first.register_hook(lambda g: g * float("inf"))
            stats = worker.run_step(step, epochs.micro_batches_of(step))
            if hook is not None:
                hook.remove()
            result["losses"].append(stats.loss_sum)
            result["overflow"].append(stats.overflow)
            result["scale"].append(stats.loss_scale)
            result["peaks"].append(stats.peak_activation_bytes)
            result["states"].append({k: v.clone() for k, v in worker.module.state_dict().items()})
    finally:
        worker.links.close()
    result["skipped"] = worker.scaler.skipped if worker.scaler is not None else 0
    return result


def _run(tmp_path, pp: int, extra: dict, poison=None) -> list[dict]:
    outcome = run_ranks(_train, pp, pp, str(tmp_path), extra, poison)
    assert all(status == "ok" for status, _ in outcome), outcome
    return [value for _, value in outcome]


def _whole_model(results: list[dict], step: int) -> dict[str, torch.Tensor]:
    """The stages' weights after `step` under the single-stage model's names (stage-local layer indices shifted)."""
    merged, offset = {}, 0
    for result in results:
        state = result["states"][step]
        for key, value in state.items():
            local, _, rest = key.partition(".")
            merged[f"{offset + int(local)}.{rest}"] = value
        offset += 1 + max(int(k.partition(".")[0]) for k in state)
    return merged


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_pipeline_computes_what_one_stage_computes_bit_for_bit(tmp_path, precision):
    # no dropout: one process draws every layer's masks from one RNG stream, a pipeline from one per stage
    pipeline = _run(tmp_path / "pp2", 2, dict(precision=precision, dropout=0.0))
    single = _run(tmp_path / "pp1", 1, dict(precision=precision, dropout=0.0))
    assert pipeline[-1]["losses"] == single[0]["losses"]
    whole = _whole_model(pipeline, STEPS - 1)
    reference = single[0]["states"][-1]
    assert whole.keys() == reference.keys()
    # the tied table lives in the last stage's head; the first stage's copy is current only in the rows it looked up
    head = next(k for k in whole if k.endswith("lm_head.weight"))
    assert torch.equal(whole[head], reference["0.embed_tokens.weight"])
    assert all(torch.equal(whole[k], v) for k, v in reference.items() if k != "0.embed_tokens.weight")
    assert all(v.dtype == torch.float32 for v in whole.values() if v.is_floating_point())  # fp32 master weights
    fp32 = _run(tmp_path / "fp32", 1, dict(dropout=0.0))[0]["losses"]
    assert fp32 != single[0]["losses"]  # autocast really ran in the low precision ...
    assert all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(single[0]["losses"], fp32))  # ... and is close to fp32


def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    results = _run(tmp_path, 2, dict(precision="fp16"), poison=(0, 1))
    for rank, result in enumerate(results):
        assert result["overflow"] == [0, 1, 0, 0], rank
        assert result["skipped"] == 1
        # no update (the first stage's copy of the tied table is a cache of the head's rows: it takes the rows step
        # 1 looks up, which step 0 changed)
        assert all(torch.equal(result["states"][1][k], v) for k, v in result["states"][0].items()
                   if k != "0.embed_tokens.weight"), rank
        assert not all(torch.equal(result["states"][2][k], v) for k, v in result["states"][1].items()), rank
        assert result["scale"] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 15]
        assert all(torch.isfinite(v).all() for v in result["states"][-1].values() if v.is_floating_point())


def test_loss_scale_backs_off_grows_and_round_trips():
    scaler = LossScaler(scale=8.0, growth_interval=2, min_scale=2.0)
    for overflow in (True, True, True):
        scaler.update(overflow)
    assert scaler.scale == 2.0 and scaler.skipped == 3  # never below min_scale
    scaler.update(False)
    assert scaler.scale == 2.0
    scaler.update(False)
    assert scaler.scale == 4.0  # after growth_interval clean steps
    again = LossScaler()
    again.load_state_dict(scaler.state_dict())
    assert (again.scale, again.skipped, again._clean) == (4.0, 3, 0)


@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-tiny"])
def test_recompute_changes_no_bit_and_holds_less(tmp_path, model):
    plain = _run(tmp_path / "plain", 2, dict(model=model))
    again = _run(tmp_path / "recompute", 2, dict(model=model, recompute=True))
    for a, b in zip(plain, again):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["states"][-1][k], v) for k, v in b["states"][-1].items())
    first_plain, first_recompute = plain[0]["peaks"][-1], again[0]["peaks"][-1]
    assert 0 < first_recompute < first_plain / 2, (first_recompute, first_plain)


def test_a_launch_reports_the_loss_scale_and_skipped_steps(tmp_path):
    out = tmp_path / "run"
    proc = warm.run("launch", "--model", "llama-tiny", "--pp", "2", "--steps",
                           "3", "--max-samples", "48", "--seq-len", "32", "--precision", "fp16", "--recompute",
                           "--fw", "aqsgd:4", "--warmup-epochs", "0", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["loss_scale"] for r in records] == [2.0 ** 16] * 3 and not any(r["skipped"] for r in records)
    assert json.loads((out / "summary.json").read_text())["skipped_steps"] == 0
