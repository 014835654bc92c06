"""A whole job from one process's point of view: validate, then either be a rank or start all the ranks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from aqpipe.config import ConfigError, RunConfig
from aqpipe.launch.env import in_distributed_env, rank_from_env
from aqpipe.launch.local import launch_local
from aqpipe.metrics import write_json
from aqpipe.runtime.grid import Grid
from aqpipe.runtime.plan import make_plan

WORKER_MODULE = [sys.executable, "-m", "aqpipe.launch.worker_entry"]


def run_job(cfg: RunConfig, spec_factory=None, worker_command: list[str] | None = None, progress: bool = True) -> int:
    """Run a resolved configuration; returns the exit code (0 done, 1 failed during the run).

    Inside torchrun or the DeepSpeed launcher this process is one rank. Otherwise every check runs here, then
    `worker_command` (default: aqpipe's worker module) starts once per rank.
    """
    if in_distributed_env() and "AQPIPE_CONFIG" not in os.environ:
        from aqpipe.runtime.train import run_worker

        rank, world_size = rank_from_env()
        run_worker(cfg, rank, world_size, spec_factory)
        return 0
    plan = make_plan(cfg, spec_factory)
    cfg.stage_bounds = plan.bounds
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the run directory --out {cfg.out!r}: {e.strerror}") from None
    config_path = out / "config.json"
    write_json(config_path, cfg.to_dict())
    _announce(cfg, plan)
    grid = Grid(cfg.pp, cfg.dp, 0)
    result = launch_local(
        worker_command or WORKER_MODULE, cfg.world_size, grid.describe,
        {"AQPIPE_CONFIG": str(config_path.resolve())}, plan.total_steps, cfg.stall_timeout, cfg.port, progress,
    )
    if result.code != 0:
        print(f"aqpipe: run failed: {result.message}", file=sys.stderr)
        return 1
    summary = result.summary or json.loads((out / "summary.json").read_text())
    print(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
          f"{summary['samples_per_second']:.1f} samples/s, {summary['wall_seconds']:.0f} s; run directory {out}")
    return 0


def _announce(cfg: RunConfig, plan) -> None:
    sizes = [plan.bounds[i + 1] - plan.bounds[i] for i in range(cfg.pp)]
    print(f"aqpipe: {cfg.model} ({len(plan.spec)} layers as {sizes} over {cfg.pp} stages) x {cfg.dp} replica(s) "
          f"on {cfg.device}; {len(plan.dataset.train)} samples of {cfg.seq_len} tokens, {plan.total_steps} steps; "
          f"fw {cfg.fw}, bw {cfg.bw}; run directory {cfg.out}", file=sys.stderr, flush=True)
