"""One validated run configuration: defaults, config files, flags, and every check made before a worker starts."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aqpipe.compress.grids import DEFAULT_GRID, GRIDS
from aqpipe.storage.dtypes import MEMORY_DTYPES, STORE_DTYPES


class ConfigError(ValueError):
    """A usage or configuration error: one line saying what is wrong and how to fix it (exit code 2)."""


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
# What `--resume` may change about a run; everything else must stay as the run was configured.
RESUME_MAY_CHANGE = {"resume", "out", "steps", "epochs", "eval_every", "checkpoint_every", "bandwidth", "device",
                     "stall_timeout", "port", "recompute"}



@dataclass
class RunConfig:
    """Every setting of a run; `None` means "take the model preset's default" until `resolve` fills it."""

    model: str = "gpt2-tiny"
    task: str | None = None
    data: str = "builtin"
    pp: int = 4
    dp: int = 1
    partition: str = "parameters"
    schedule: str = "gpipe"
    precision: str = "fp32"
    recompute: bool = False
    lora: int | None = None  # LoRA rank; None: every weight trains
    lora_alpha: float | None = None  # None: 2 x rank
    lora_dropout: float = 0.0
    lora_targets: str | None = None  # comma list of module names; None: the model family's default
    export_adapter: bool = False  # with --lora: also write the adapters as a peft directory (export-adapter/)
    seq_len: int | None = None
    micro_batch_size: int | None = None
    micro_batches: int | None = None
    epochs: int | None = None
    steps: int | None = None
    optimizer: str = "adamw"
    lr: float | None = None
    weight_decay: float = 0.0
    momentum: float | None = None  # sgd only; None: 0.9, or 0 under a sign-based --grad-sync
    warmup_steps: int | None = None
    clip: float = 1.0
    fw: str = "aqsgd:4"
    bw: str = "directq:8"
    warmup_epochs: int = 1
    grad_sync: str = "none"
    store: str = "memory"
    store_dtype: str = "fp16"
    store_max_gb: float | None = None
    store_device: str = "cpu"
    bandwidth: str | None = None
    device: str | None = None
    out: str | None = None
    resume: str | None = None
    checkpoint_every: int | None = None
    eval_every: int | None = None
    seed: int = 0
    # Beyond the contract: knobs a demanding user needs.
    vocab_size: int | None = None
    dropout: float | None = None
    max_samples: int | None = None
    quant_scales: str = "channel"
    quant_rounding: str = "nearest"
    quant_grid: str = DEFAULT_GRID
    store_check: str = "on"
    store_dump: str = "off"
    stall_timeout: float = 300.0
    port: int | None = None
    # Filled by `resolve`: the explicit stage boundaries (layer index where each stage starts, plus the end).
    stage_bounds: list[int] | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain JSON-able values."""
        return dataclasses.asdict(self)

    def fixed_settings(self) -> dict[str, Any]:
        """The settings a resume may not change (everything but RESUME_MAY_CHANGE), as their JSON values: what a
        checkpoint records and a resume must match."""
        fixed = {k: v for k, v in self.to_dict().items() if k not in RESUME_MAY_CHANGE}
        return json.loads(json.dumps(fixed))

    @property
    def world_size(self) -> int:
        """Number of ranks: pp × dp."""
        return self.pp * self.dp

    @property
    def samples_per_step(self) -> int:
        """Samples one replica consumes per optimizer step."""
        assert self.micro_batch_size is not None and self.micro_batches is not None
        return self.micro_batch_size * self.micro_batches


FIELD_NAMES = {f.name for f in dataclasses.fields(RunConfig)}
BOOLEAN_WORDS = {"true": True, "on": True, "yes": True, "1": True, "false": False, "off": False, "no": False, "0": False}


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML or JSON config whose keys are flag names with `_` for `-`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path!r} does not exist or is not a file")
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parse failure is a user error
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config file {path!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {first}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of flag names to values, not {type(data).__name__}")
    normalized = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(normalized) - FIELD_NAMES)
    if unknown:
        raise ConfigError(f"config file {path!r} has unknown key(s): {', '.join(unknown)}")
    return normalized


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> RunConfig:
    """Merge defaults < config file < flags into a RunConfig, checking value types."""
    merged: dict[str, Any] = {}
    merged.update(file_values)
    merged.update({k: v for k, v in flag_values.items() if v is not None})
    cfg = RunConfig()
    for f in dataclasses.fields(RunConfig):
        if f.name in merged:
            setattr(cfg, f.name, _coerce(f.name, merged[f.name], f.type))
    return cfg


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    ann = str(annotation)
    flag = "--" + name.replace("_", "-")
    if value is None:
        return None
    if ann.startswith("bool"):
        text = str(value).strip().lower()
        if text not in BOOLEAN_WORDS:
            raise ConfigError(f"{flag} must be true or false, got {value!r}")
        return BOOLEAN_WORDS[text]
    if ann.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not re.fullmatch(r"-?\d+", str(value).strip()):
            raise ConfigError(f"{flag} must be an integer, got {value!r}")
        return int(value)
    if ann.startswith("float"):
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not math.isfinite(out):
            raise ConfigError(f"{flag} must be a finite number, got {value!r}")
        return out
    if ann.startswith("list"):
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list of integers")
        return [int(v) for v in value]
    return str(value)


def resolve(cfg: RunConfig) -> RunConfig:
    """Fill preset defaults and validate every value; raises ConfigError on the first problem found."""
    _check_choices(cfg)
    preset = PRESET_TRAINING.get(cfg.model, PRESET_TRAINING["default"])
    for key, value in preset.items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    if cfg.device is None:
        cfg.device = "cuda" if _cuda_available() else "cpu"
    if cfg.out is None:
        cfg.out = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    if cfg.task is None:
        from aqpipe.stages.models import model_task

        cfg.task = model_task(cfg.model) or "lm"
    _validate(cfg)
    return cfg


def resume_values(run_dir: str, file_values: dict[str, Any], flag_values: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run being resumed: its recorded config.json, with only the settings a resume may change
    taken from the config file or flags; anything else given must equal what the run used."""
    path = Path(run_dir) / "config.json"
    if not Path(run_dir).is_dir():
        raise ConfigError(f"--resume {run_dir!r} is not a run directory")
    try:
        saved = json.loads(path.read_text())
    except OSError:
        raise ConfigError(f"--resume {run_dir!r} has no config.json; is it an aqpipe run directory?") from None
    except ValueError:
        raise ConfigError(f"--resume: {path} is damaged (not JSON)") from None
    if not isinstance(saved, dict) or set(saved) - FIELD_NAMES:
        raise ConfigError(f"--resume: {path} is not an aqpipe config (unknown keys)")
    given = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    if given.get("out") is not None and Path(str(given["out"])).resolve() != Path(run_dir).resolve():
        raise ConfigError(f"--out {given['out']!r} differs from --resume {run_dir!r}; a resumed run writes to its own directory")
    values = dict(saved)
    for key, value in given.items():
        if key in RESUME_MAY_CHANGE:
            values[key] = value
            continue
        before = build_config({}, {key: saved.get(key)}) if saved.get(key) is not None else RunConfig()
        after = build_config({}, {key: value})
        if getattr(before, key) != getattr(after, key):
            raise ConfigError(f"--{key.replace('_', '-')} cannot change on --resume: the run used "
                              f"{getattr(before, key)!r}, got {getattr(after, key)!r}")
    values["out"], values["resume"] = run_dir, run_dir
    return values


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_choices(cfg: RunConfig) -> None:
    """Codec specs and named choices are known."""
    from aqpipe.compress.specs import CodecError, parse_spec

    try:
        parse_spec(cfg.fw, "fw")
        parse_spec(cfg.bw, "bw")
    except CodecError as e:
        raise ConfigError(str(e)) from None
    for name, value, allowed in (("quant-scales", cfg.quant_scales, ("channel", "token")),
                                 ("quant-rounding", cfg.quant_rounding, ("nearest", "stochastic")),
                                 ("quant-grid", cfg.quant_grid, GRIDS),
                                 ("store-check", cfg.store_check, ("on", "off")),
                                 ("store-dump", cfg.store_dump, ("on", "off"))):
        if value not in allowed:
            raise ConfigError(f"--{name} {value!r} is not one of {', '.join(allowed)}")
    from aqpipe.compress.grad.methods import GradSpecError, check_pairing, parse_grad_spec

    try:
        check_pairing(parse_grad_spec(cfg.grad_sync), cfg.optimizer)
    except GradSpecError as e:
        raise ConfigError(str(e)) from None
    from aqpipe.runtime.precisions import PRECISIONS

    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"--precision {cfg.precision!r} is not one of {', '.join(PRECISIONS)}")
    if cfg.store not in ("memory", "lmdb"):
        raise ConfigError(f"--store {cfg.store!r} is not a store; use memory or lmdb")
    if cfg.store_dtype not in STORE_DTYPES:
        raise ConfigError(f"--store-dtype {cfg.store_dtype!r} is not one of {', '.join(STORE_DTYPES)}")
    if cfg.store_dtype not in MEMORY_DTYPES and cfg.store != "lmdb":
        raise ConfigError(f"--store-dtype {cfg.store_dtype} (low-bit m) needs --store lmdb; in memory use "
                          f"{', '.join(MEMORY_DTYPES)}")
    if cfg.store_device not in ("cpu", "cuda"):
        raise ConfigError(f"--store-device {cfg.store_device!r} is not one of cpu, cuda")
    if cfg.store_device == "cuda" and (cfg.store != "memory" or cfg.device != "cuda"):
        raise ConfigError("--store-device cuda keeps m(xi) in GPU memory: it needs --store memory and --device cuda")
    if cfg.store_max_gb is not None and cfg.store_max_gb <= 0:
        raise ConfigError(f"--store-max-gb must be positive, got {cfg.store_max_gb}")
    if cfg.bandwidth is not None:
        _check_bandwidth(cfg.bandwidth)
    if cfg.task not in (None, "lm", "classify"):
        raise ConfigError(f"--task {cfg.task!r} is not a task; use lm or classify")
    from aqpipe.runtime.schedule import SCHEDULES

    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {cfg.schedule!r} is not a schedule; use {' or '.join(SCHEDULES)}")


def _check_bandwidth(rate: str) -> None:
    """A rate tc understands, and a machine where this process may build namespaces and qdiscs."""
    from aqpipe.launch.netns import can_throttle, parse_rate

    try:
        parse_rate(rate)
    except ValueError as e:
        raise ConfigError(f"--bandwidth: {e}") from None
    problem = can_throttle()
    if problem:
        raise ConfigError(problem)


def _validate(cfg: RunConfig) -> None:
    def positive(name: str) -> None:
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")

    for name in ("pp", "dp", "seq_len", "micro_batch_size", "micro_batches", "epochs", "steps", "max_samples",
                 "checkpoint_every"):
        positive(name)
    if cfg.eval_every is not None and cfg.eval_every < 0:
        raise ConfigError(f"--eval-every must be at least 0 (0: never evaluate), got {cfg.eval_every}")
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
