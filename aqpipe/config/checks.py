"""Resolving a run's settings: the model preset's defaults filled in, and every value checked before any process
starts (ConfigError, exit 2, on the first problem)."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path
from typing import Any

from aqpipe.compress.grids import GRIDS, ROUNDINGS, SCALES
from aqpipe.compress.link.specs import DEFAULT_FIRST_SIGHT, check_first_sight
from aqpipe.config.rates import parse_rate
from aqpipe.config.settings import ResolvedConfig, RunConfig
from aqpipe.config.values import ConfigError
from aqpipe.pipeline.vocab.link_rows import LINK_ROWS
from aqpipe.pipeline.vocab.tied_exchanges import default_exchange, parse_exchange
from aqpipe.storage.dtypes import MEMORY_DTYPES, STORE_DTYPES

# Training defaults per model preset; a model that is not a preset takes the "default" row.
PRESET_TRAINING: dict[str, dict[str, Any]] = {
    "default": dict(seq_len=128, micro_batch_size=4, micro_batches=4, epochs=2, lr=5e-5, warmup_steps=10),
    "gpt2-tiny": dict(seq_len=64, micro_batch_size=4, micro_batches=4, epochs=3, lr=1e-3, warmup_steps=10),
    "gpt2-small": dict(seq_len=256, micro_batch_size=2, micro_batches=8, epochs=2, lr=3e-4, warmup_steps=50),
    "gpt2-medium": dict(seq_len=512, micro_batch_size=1, micro_batches=8, epochs=2, lr=2e-4, warmup_steps=100),
    "gpt2-large": dict(seq_len=1024, micro_batch_size=1, micro_batches=8, epochs=2, lr=1e-4, warmup_steps=100),
    "gpt2-xl": dict(seq_len=1024, micro_batch_size=1, micro_batches=8, epochs=2, lr=5e-5, warmup_steps=100),
    "bert-tiny": dict(seq_len=64, micro_batch_size=8, micro_batches=4, epochs=3, lr=1e-3, warmup_steps=10),
    "bert-mini": dict(seq_len=64, micro_batch_size=8, micro_batches=4, epochs=3, lr=5e-4, warmup_steps=10),
    "bert-small": dict(seq_len=128, micro_batch_size=8, micro_batches=4, epochs=3, lr=3e-4, warmup_steps=20),
    "bert-base": dict(seq_len=128, micro_batch_size=8, micro_batches=4, epochs=3, lr=5e-5, warmup_steps=50),
    "bert-large": dict(seq_len=128, micro_batch_size=4, micro_batches=8, epochs=3, lr=3e-5, warmup_steps=50),
    "llama-tiny": dict(seq_len=64, micro_batch_size=4, micro_batches=4, epochs=3, lr=1e-3, warmup_steps=10),
    "qwen2-tiny": dict(seq_len=64, micro_batch_size=4, micro_batches=4, epochs=3, lr=1e-3, warmup_steps=10),
    "mistral-tiny": dict(seq_len=64, micro_batch_size=4, micro_batches=4, epochs=3, lr=1e-3, warmup_steps=10),
    "smollm2-135m": dict(seq_len=128, micro_batch_size=4, micro_batches=4, epochs=3, lr=5e-5, warmup_steps=10),
    "minilm-l6": dict(seq_len=64, micro_batch_size=8, micro_batches=4, epochs=3, lr=1e-4, warmup_steps=10),
}

def resolve(cfg: RunConfig) -> ResolvedConfig:
    """A new config: `cfg` (left as given) with the preset's and the machine's defaults filled in, every value checked;
    raises ConfigError on the first problem found."""
    cfg = RunConfig(**dataclasses.asdict(cfg))
    parsed = _check_choices(cfg)
    preset = PRESET_TRAINING.get(cfg.model, PRESET_TRAINING["default"])
    for key, value in preset.items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    if cfg.device is None:
        cfg.device = "cuda" if _cuda_available() else "cpu"
    if cfg.out is None:
        cfg.out = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    if cfg.first_sight is None:
        cfg.first_sight = DEFAULT_FIRST_SIGHT if parsed["fw_spec"].keeps_messages else "fp32"
        parsed["first_sight_spec"] = check_first_sight(cfg.first_sight)
    if cfg.tied_exchange is None:
        cfg.tied_exchange = default_exchange(cfg.fw, cfg.bw)
        parsed["tied_spec"] = parse_exchange(cfg.tied_exchange)
    if cfg.task is None:
        from aqpipe.stages.models import model_task

        cfg.task = model_task(cfg.model) or "lm"
    _validate(cfg)
    resolved = ResolvedConfig(**dataclasses.asdict(cfg))
    resolved.__dict__.update(parsed)  # its cached parsed settings, as parsed here (each string is parsed once)
    return resolved


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_choices(cfg: RunConfig) -> dict[str, Any]:
    """Codec specs and named choices are known; the parsed codec and grad-sync settings, by the name under which a
    ResolvedConfig hands each out (`fw_spec`, …; `first_sight_spec` and `tied_spec` only where given)."""
    from aqpipe.compress.link.specs import CodecError, check_eval_codec, parse_spec

    parsed: dict[str, Any] = {}
    try:
        parsed["fw_spec"] = fw = parse_spec(cfg.fw, "fw")
        parsed["bw_spec"] = parse_spec(cfg.bw, "bw")
        if cfg.first_sight is not None:
            parsed["first_sight_spec"] = check_first_sight(cfg.first_sight)
        parsed["eval_spec"] = check_eval_codec(cfg.eval_codec)
    except CodecError as e:
        raise ConfigError(str(e)) from None
    if cfg.first_sight not in (None, "fp32") and not fw.keeps_messages:
        raise ConfigError(f"--first-sight {cfg.first_sight} codes the first sight of a sample on an AQ-SGD link "
                          f"(--fw aqsgd:B); --fw {cfg.fw} sends every sample alike")
    for name, value, allowed in (("quant-scales", cfg.quant_scales, SCALES),
                                 ("quant-rounding", cfg.quant_rounding, ROUNDINGS),
                                 ("quant-grid", cfg.quant_grid, GRIDS),
                                 ("link-rows", cfg.link_rows, tuple(LINK_ROWS)),
                                 ("store-check", cfg.store_check, ("on", "off")),
                                 ("store-dump", cfg.store_dump, ("on", "off"))):
        if value not in allowed:
            raise ConfigError(f"--{name} {value!r} is not one of {', '.join(allowed)}")
    if cfg.tied_exchange is not None:
        try:
            parsed["tied_spec"] = parse_exchange(cfg.tied_exchange)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    from aqpipe.compress.grad.methods import GradSpecError, check_pairing, parse_grad_spec

    try:
        parsed["grad_spec"] = parse_grad_spec(cfg.grad_sync)
        check_pairing(parsed["grad_spec"], cfg.optimizer)
    except GradSpecError as e:
        raise ConfigError(str(e)) from None
    from aqpipe.pipeline.vocab.precisions import PRECISIONS

    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"--precision {cfg.precision!r} is not one of {', '.join(PRECISIONS)}")
    if cfg.store not in ("memory", "lmdb"):
        raise ConfigError(f"--store {cfg.store!r} is not a store; use memory or lmdb")
    if cfg.store_dtype not in STORE_DTYPES:
        raise ConfigError(f"--store-dtype {cfg.store_dtype!r} is not one of {', '.join(STORE_DTYPES)}")
    if cfg.store_dtype not in MEMORY_DTYPES and cfg.store != "lmdb":
        raise ConfigError(f"--store-dtype {cfg.store_dtype} (a low-bit m(ξ)) needs --store lmdb; in memory use "
                          f"{', '.join(MEMORY_DTYPES)}")
    if cfg.store_device not in ("cpu", "cuda"):
        raise ConfigError(f"--store-device {cfg.store_device!r} is not one of cpu, cuda")
    if cfg.store_device == "cuda" and (cfg.store != "memory" or cfg.device != "cuda"):
        raise ConfigError("--store-device cuda keeps m(xi) in GPU memory: it needs --store memory and --device cuda")
    if cfg.store_max_gb is not None and cfg.store_max_gb <= 0:
        raise ConfigError(f"--store-max-gb must be positive, got {cfg.store_max_gb}")
    if cfg.bandwidth is not None:
        parsed["bandwidth_bits"] = bandwidth_bits(cfg.bandwidth)
    if cfg.task not in (None, "lm", "classify"):
        raise ConfigError(f"--task {cfg.task!r} is not a task; use lm or classify")
    from aqpipe.pipeline.vocab.schedule import SCHEDULES

    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {cfg.schedule!r} is not a schedule; use {' or '.join(SCHEDULES)}")
    return parsed


def bandwidth_bits(rate: str) -> int:
    """A `--bandwidth` rate tc understands, in bits per second (whether this machine can shape it is the launcher's
    check: `aqpipe bench` plans for a rate and shapes nothing)."""
    try:
        return parse_rate(rate)
    except ValueError as e:
        raise ConfigError(f"--bandwidth: {e}") from None


def _validate(cfg: RunConfig) -> None:
    def positive(name: str) -> None:
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")

    for name in ("pp", "dp", "seq_len", "micro_batch_size", "micro_batches", "epochs", "steps", "max_samples",
                 "checkpoint_every"):
        positive(name)
    if cfg.checkpoint_replicas is not None and cfg.checkpoint_replicas < 0:
        raise ConfigError(f"--checkpoint-replicas must be at least 0 (0: no copies), got {cfg.checkpoint_replicas}")
    if not 0 < cfg.checkpoint_share <= 1:
        raise ConfigError(f"--checkpoint-share must be above 0 and at most 1 (a share of the link), got "
                          f"{cfg.checkpoint_share}")
    if cfg.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be at least 0 (0: a failed rank ends the run), got {cfg.max_restarts}")
    if cfg.eval_every is not None and cfg.eval_every < 0:
        raise ConfigError(f"--eval-every must be at least 0 (0: never evaluate), got {cfg.eval_every}")
    if cfg.eval_samples is not None and cfg.eval_samples < 1:
        raise ConfigError(f"--eval-samples must be at least 1 (leave it out to evaluate every held-out sample), got "
                          f"{cfg.eval_samples}")
    if cfg.lr is not None and cfg.lr < 0:
        raise ConfigError(f"--lr must not be negative, got {cfg.lr}")
    if cfg.weight_decay < 0:
        raise ConfigError(f"--weight-decay must not be negative, got {cfg.weight_decay}")
    if cfg.momentum is not None and not 0.0 <= cfg.momentum < 1.0:
        raise ConfigError(f"--momentum must be in [0, 1), got {cfg.momentum}")
    if cfg.momentum is not None and cfg.optimizer != "sgd":
        raise ConfigError(f"--momentum applies to --optimizer sgd; {cfg.optimizer} keeps its own moment estimates")
    if cfg.clip < 0:
        raise ConfigError(f"--clip must not be negative (0 turns clipping off), got {cfg.clip}")
    if cfg.warmup_steps is not None and cfg.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must not be negative, got {cfg.warmup_steps}")
    if cfg.warmup_epochs < 0:
        raise ConfigError(f"--warmup-epochs must not be negative, got {cfg.warmup_epochs}")
    if cfg.lora is not None and cfg.lora < 1:
        raise ConfigError(f"--lora (the adapters' rank) must be at least 1, got {cfg.lora}")
    if cfg.lora is None and (cfg.lora_alpha is not None or cfg.lora_targets is not None or cfg.lora_dropout):
        raise ConfigError("--lora-alpha, --lora-dropout and --lora-targets apply to LoRA: add --lora R")
    if cfg.lora is None and cfg.export_adapter:
        raise ConfigError("--export-adapter writes LoRA adapters: add --lora R")
    if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
        raise ConfigError(f"--lora-alpha must be positive, got {cfg.lora_alpha}")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.dropout is not None and not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.vocab_size is not None and cfg.vocab_size < 260:
        raise ConfigError(f"--vocab-size must be at least 260 (256 bytes plus specials), got {cfg.vocab_size}")
    if cfg.stall_timeout <= 0:
        raise ConfigError(f"--stall-timeout must be positive, got {cfg.stall_timeout}")
    if cfg.port is not None and not 1 <= cfg.port <= 65535:
        raise ConfigError(f"--port must be in 1..65535, got {cfg.port}")
    if cfg.optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"--optimizer {cfg.optimizer!r} is not supported; use adamw or sgd")
    if cfg.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {cfg.device!r} is not a device; use cpu or cuda")
    if cfg.device == "cuda" and not _cuda_available():
        raise ConfigError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    partition = cfg.partition
    if partition not in ("parameters", "time") and not re.fullmatch(r"\d+(,\d+)*", partition):
        raise ConfigError(f"--partition {partition!r} must be parameters, time, or a comma list of layers per stage like 2,3,3")
    if re.fullmatch(r"\d+(,\d+)*", partition):
        counts = [int(x) for x in partition.split(",")]
        if len(counts) != cfg.pp:
            raise ConfigError(f"--partition {partition} lists {len(counts)} stages but --pp is {cfg.pp}")
        if any(c < 1 for c in counts):
            raise ConfigError(f"--partition {partition}: every stage needs at least one layer")
    out = Path(cfg.out or ".")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {cfg.out!r} exists and is not a directory")
