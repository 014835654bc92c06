"""DeepSpeed's pipeline engine on the same model, data, partition and micro-batches as an aqpipe run (the baseline).

Run under torchrun, one process per stage, e.g.
    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 benchmarks/deepspeed_pipe.py --config run/config.json
It reads an aqpipe config.json (with stage_bounds), trains `--steps` steps and writes the per-step seconds as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from aqpipe.config import RunConfig, resolve
from aqpipe.config.settings import ResolvedConfig
from aqpipe.runtime.plan import RunPlan, make_plan


def read_plan(path: str | Path) -> tuple[ResolvedConfig, RunPlan]:
    """An aqpipe run's config.json, resolved as a launch resolves it, and its plan (model, data, stage bounds)."""
    cfg = resolve(RunConfig(**json.loads(Path(path).read_text())))
    return cfg, make_plan(cfg)


class _Built(nn.Module):
    """Lets DeepSpeed's LayerSpec build an aqpipe layer lazily, on its own stage only."""

    def __new__(cls, spec, index, seed):
        return spec.build_layer(index, seed)


def pipeline_module(cfg: ResolvedConfig, plan: RunPlan) -> nn.Module:
    """DeepSpeed's PipelineModule over the plan's layers, split at the stage boundaries aqpipe used (DeepSpeed has
    no method that takes them as a list)."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    class FixedPartition(PipelineModule):
        def _partition_layers(self, method="uniform"):
            self.parts = list(plan.bounds)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    layers = [LayerSpec(_Built, plan.spec, i, cfg.seed) for i in range(len(plan.spec))]
    return FixedPartition(layers=layers, loss_fn=plan.spec.loss, num_stages=cfg.pp, activation_checkpoint_interval=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    cfg, plan = read_plan(args.config)
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    deepspeed.init_distributed(dist_backend="gloo")
    data = plan.dataset.train
    model = pipeline_module(cfg, plan)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    ds_config = {"train_micro_batch_size_per_gpu": cfg.micro_batch_size,
                 "gradient_accumulation_steps": cfg.micro_batches, "gradient_clipping": cfg.clip,
                 "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    epochs = plan.epoch_plan(0)

    def batches():
        step = 0
        while True:
            for ids in epochs.micro_batches_of(step):
                yield data.inputs(ids), data.targets(ids)
            step += 1

    it = batches()
    seconds, losses = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = engine.train_batch(data_iter=it)
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"step_seconds": seconds, "losses": losses,
                       "median_step_seconds": statistics.median(seconds[3:] or seconds)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
