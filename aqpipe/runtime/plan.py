"""Everything decided before training starts: data, model spec, stage boundaries, steps — with every check."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from aqpipe.config import ConfigError, ResolvedConfig
from aqpipe.data import DataError, EpochPlan, TaskDataset, prepare_dataset, shard
from aqpipe.runtime.checkpoints.parts import KEEP
from aqpipe.stages import PipelineSpec, SpecError, partition
from aqpipe.stages.lora import LoraSettings, apply_lora, check_targets, lora_settings, require_peft
from aqpipe.stages.models import (
    build_spec,
    check_context,
    check_task,
    check_weights,
    classify_model,
    tokenizer_directory,
)
from aqpipe.stages.spec import Stage
from aqpipe.storage.dtypes import STORE_DTYPES


@dataclass
class RunPlan:
    """A resolved run: the data, the model spec, stage boundaries and step counts."""

    cfg: ResolvedConfig
    dataset: TaskDataset
    spec: PipelineSpec
    bounds: list[int]
    steps_per_epoch: int
    total_steps: int
    lora: LoraSettings | None = None  # the adapters of a --lora run

    def build_stage(self, stage: int) -> Stage:
        """Stage `stage`'s layers as the run trains them: recompute as configured, LoRA adapters added (on whatever
        device is current: the capacity plan builds on the meta device)."""
        lo, hi = self.bounds[stage], self.bounds[stage + 1]
        module = self.spec.build_stage(lo, hi, self.cfg.seed)
        module.recompute = self.cfg.recompute
        if self.lora is not None:
            apply_lora(module, lo, self.lora, self.cfg.seed)
        return module

    def first_micro_batch(self) -> dict[str, torch.Tensor | None]:
        """The first micro-batch of the training data: inputs, mask (or None) and targets (what the capacity plan
        and the bench run a stage on)."""
        ids = torch.arange(min(self.cfg.micro_batch_size, len(self.dataset.train)))
        train = self.dataset.train
        return {"inputs": train.inputs(ids), "mask": train.mask(ids), "targets": train.targets(ids)}

    def compresses(self, step: int) -> bool:
        """Whether `step`'s links compress: every step after the warm-up epochs (sent in fp32 while m(ξ) fills)."""
        return step // self.steps_per_epoch >= self.cfg.warmup_epochs

    def epoch_plan(self, replica: int) -> EpochPlan:
        """The sample order of one replica's shard."""
        return EpochPlan(shard(len(self.dataset.train), replica, self.cfg.dp), self.cfg.seed,
                         self.cfg.micro_batch_size, self.cfg.micro_batches)


def make_plan(cfg: ResolvedConfig, spec_factory=None, profile: bool = True, check_store: bool = True,
              planning: bool = False) -> RunPlan:
    """Prepare data and model spec and resolve the partition; raises ConfigError for anything the user must fix.

    With `profile=False`, a time-based partition not yet resolved is left to the caller; with `check_store=False`
    the m(ξ) stores' room is not checked (the capacity plan reports it instead); with `planning` nothing will run
    (`--dry-run`: a checkpoint directory may hold its config alone).
    """
    try:
        if spec_factory is None:
            classify_model(cfg.model)
            if not planning:
                check_weights(cfg.model)
            check_task(cfg.model, cfg.task)
            check_context(cfg.model, cfg.seq_len)
        tok_dir = None if spec_factory is not None else tokenizer_directory(cfg.model)
        dataset = prepare_dataset(cfg.task, cfg.data, cfg.seq_len, tok_dir, cfg.vocab_size, cfg.max_samples)
        spec = build_spec(cfg.model, dataset.vocab_size, cfg.seq_len, cfg.dropout, spec_factory, dataset.num_labels)
    except (SpecError, DataError) as e:
        raise ConfigError(str(e)) from None
    if spec.extras.get("task", cfg.task) != cfg.task:
        raise ConfigError(f"--model {cfg.model} is built for --task {spec.extras['task']}, not {cfg.task}")

    per_step = cfg.micro_batch_size * cfg.micro_batches
    shard_size = len(dataset.train) // cfg.dp
    steps_per_epoch = shard_size // per_step
    if steps_per_epoch < 1:
        raise ConfigError(
            f"batch settings do not fit the data: one step takes --micro-batch-size {cfg.micro_batch_size} x "
            f"--micro-batches {cfg.micro_batches} = {per_step} samples per replica, but each of the {cfg.dp} "
            f"replica(s) has only {shard_size} of the {len(dataset.train)} samples; lower them or use more data"
        )
    total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * steps_per_epoch

    if len(spec) < cfg.pp:
        raise ConfigError(
            f"--pp {cfg.pp} is more stages than the model's {len(spec)} layers; use --pp {len(spec)} or fewer"
        )
    bounds = cfg.stage_bounds
    if bounds is None:
        bounds = resolve_bounds(cfg, spec, dataset) if (profile or cfg.partition != "time") else []
    elif len(bounds) != cfg.pp + 1 or bounds[0] != 0 or bounds[-1] != len(spec):
        raise ConfigError(f"stage_bounds {bounds} do not split {len(spec)} layers into {cfg.pp} stages")
    if check_store:
        check_store_capacity(cfg, spec, len(dataset.train))
    return RunPlan(cfg, dataset, spec, bounds, steps_per_epoch, total_steps, plan_lora(cfg, spec))


def plan_lora(cfg: ResolvedConfig, spec: PipelineSpec) -> LoraSettings | None:
    """The adapters `--lora` asks for on this model (None without it), their targets checked against the model."""
    if cfg.lora is None:
        return None
    if cfg.export_adapter and (spec.extras.get("task", cfg.task) != "lm" or "base_model" not in spec.extras):
        raise ConfigError(f"--export-adapter writes adapters for a pretrained causal LM, but --model {cfg.model} is "
                          f"{'initialized at random' if spec.extras.get('task', cfg.task) == 'lm' else 'a classifier'}: "
                          "the merged export (export/) holds the trained model")
    try:
        settings = lora_settings(cfg.lora, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets, spec)
        check_targets(spec, settings)
        require_peft()  # (here, before any rank starts)
    except SpecError as e:
        raise ConfigError(str(e)) from None
    return settings


STORE_HEADROOM = 1.5  # LMDB pages, headers and growth slack over the raw value bytes
# an on-disk store's rewind journals, at most: the checkpoints kept, the newest copied, one being copied (copies across
# hosts), and the one trained past
JOURNALED_CHECKPOINTS = KEEP + 3


def store_headroom(cfg: ResolvedConfig, samples_per_replica: int) -> float:
    """Bytes a store takes per byte of its values: 1 in memory; on disk LMDB's pages and slack, and the rewind
    journals, each holding a copy of the values written in its checkpoint interval (at most the whole store)."""
    if cfg.store != "lmdb":
        return 1.0
    interval = (cfg.checkpoint_every or 0) * cfg.micro_batch_size * cfg.micro_batches
    return STORE_HEADROOM * (1 + JOURNALED_CHECKPOINTS * min(1.0, interval / max(1, samples_per_replica)))


def store_bytes_per_rank(cfg: ResolvedConfig, spec: PipelineSpec, num_samples: int) -> int | None:
    """Estimated bytes of a middle stage's m(ξ) (both sides of two links) — on disk with LMDB's headroom, or in RAM —
    or None when the activation size is unknown.

    Known for the HF adapters (seq_len × hidden per sample); other specs grow the store on demand.
    """
    config = spec.extras.get("hf_config", {})
    hidden = config.get("n_embd", config.get("hidden_size"))
    if hidden is None or not cfg.keeps_messages:
        return None
    samples = -(-num_samples // cfg.dp)
    sides = 2 if cfg.pp > 2 else 1
    value_bytes = STORE_DTYPES[cfg.store_dtype].value_bytes
    return int(samples * cfg.seq_len * hidden * value_bytes * sides * store_headroom(cfg, samples))


def available_memory() -> int:
    """Bytes of RAM the kernel says new allocations can take (MemAvailable), or the physical total if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_store_capacity(cfg: ResolvedConfig, spec: PipelineSpec, num_samples: int) -> None:
    """Refuse before training when RAM (--store memory), the disk or --store-max-gb cannot hold the m(ξ) stores."""
    per_rank = store_bytes_per_rank(cfg, spec, num_samples)
    if per_rank is None:
        return
    if cfg.store == "memory" and cfg.store_device == "cuda":
        return  # in GPU memory: the capacity plan counts it against each GPU
    if cfg.store == "memory":
        needed, free = per_rank * cfg.world_size, available_memory()  # every local rank keeps its own
        if needed > free:
            raise ConfigError(f"the m(xi) stores need about {needed / 1e9:.2f} GB of RAM ({cfg.world_size} ranks, "
                              f"--store-dtype {cfg.store_dtype}) but {free / 1e9:.2f} GB is available; use --store lmdb, "
                              "fewer samples, or a smaller --store-dtype")
        return
    if cfg.store_max_gb is not None and per_rank > cfg.store_max_gb * 1e9:
        raise ConfigError(f"each rank's m(xi) store needs about {per_rank / 1e9:.2f} GB but --store-max-gb is "
                          f"{cfg.store_max_gb}; raise it, use a low-bit --store-dtype, or fewer samples")
    target = Path(cfg.out).resolve()
    while not target.exists():
        target = target.parent
    free = shutil.disk_usage(target).free
    needed = per_rank * cfg.world_size  # every local rank writes to this disk
    if needed > free:
        raise ConfigError(f"the m(xi) stores need about {needed / 1e9:.2f} GB but the disk under {cfg.out} has "
                          f"{free / 1e9:.2f} GB free; use a low-bit --store-dtype, fewer samples, or another --out")


def resolve_bounds(cfg: ResolvedConfig, spec: PipelineSpec, dataset: TaskDataset) -> list[int]:
    """Stage boundaries for `--partition` (profiling a real micro-batch for "time")."""
    method: str | list[int] = cfg.partition
    if method not in ("parameters", "time"):
        method = [int(x) for x in cfg.partition.split(",")]
    example = None
    if method == "time":
        ids = torch.arange(min(cfg.micro_batch_size, len(dataset.train)))
        example = (dataset.train.inputs(ids), dataset.train.targets(ids))
    try:
        return partition(spec, cfg.pp, method, example=example)
    except SpecError as e:
        raise ConfigError(str(e)) from None
