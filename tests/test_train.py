"""End-to-end runs through the launcher: pipeline = single process, and the run directory of CONTRACT.md."""

import json

import pytest
import torch

from aqpipe.config import RunConfig, resolve
from aqpipe.launch.job import run_job
from tests.reference import train_single_process


def small_config(out, **kw) -> RunConfig:
    settings = dict(model="gpt2-tiny", seq_len=32, micro_batch_size=2, micro_batches=3, steps=6, lr=2e-3,
                    warmup_steps=2, seed=1, max_samples=96, device="cpu", out=str(out), clip=0.5)
    settings.update(kw)
    return resolve(RunConfig(**settings))


def pipeline_params(out, bounds) -> dict[str, torch.Tensor]:
    """The pipeline's final weights renamed to the single-process model's layer indices."""
    params = {}
    for stage in range(len(bounds) - 1):
        state = torch.load(out / "checkpoints" / "final" / f"stage-{stage}.pt", weights_only=True)
        for key, value in state.items():
            local, _, rest = key.partition(".")
            params[f"{bounds[stage] + int(local)}.{rest}"] = value
    return params


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("pp,dp", [(2, 1), (3, 1), (4, 1), (2, 2)])
def test_pipeline_matches_single_process(tmp_path, pp, dp):
    cfg = small_config(tmp_path / "run", pp=pp, dp=dp)
    ref_losses, ref_params, bounds = train_single_process(small_config(tmp_path / "ref", pp=pp, dp=dp))
    assert run_job(cfg, progress=False) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == len(ref_losses) == 6
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
    assert losses[-1] < losses[0]  # it trained
    params = pipeline_params(tmp_path / "run", bounds)
    assert params.keys() == ref_params.keys()
    for key, want in ref_params.items():
        assert relative_error(params[key], want) <= 1e-5, key
