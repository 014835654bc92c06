"""The parts of the benchmarks' baselines that need no baseline installed: DeepSpeed's pipeline engine
(benchmarks/deepspeed_pipe.py) trains the model, data and stage boundaries an aqpipe run used, read from its
config.json as a launch resolves them."""

import json

from benchmarks.deepspeed_pipe import read_plan
from tests import warm


def test_the_deepspeed_baseline_plans_the_run_a_config_json_holds(tmp_path):
    run = tmp_path / "run"
    proc = warm.run("launch", "--pp", "2", "--seq-len", "16", "--max-samples", "64", "--eval-samples", "16",
                    "--partition", "parameters", "--steps", "1", "--no-progress", "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = json.loads((run / "config.json").read_text())
    cfg, plan = read_plan(run / "config.json")
    assert cfg.pp == 2 and cfg.micro_batches == saved["micro_batches"] and cfg.seed == saved["seed"]
    assert plan.bounds == saved["stage_bounds"] and plan.bounds[-1] == len(plan.spec)
    assert plan.dataset.train.inputs([0]).shape[-1] == saved["seq_len"] == 16  # (the run's samples, as it cut them)
