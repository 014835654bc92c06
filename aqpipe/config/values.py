"""A run's settings from a config file and flags: reading the file, typing each value by its field's annotation,
merging defaults < file < flags, and the resume rule (what a resumed run may change)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

from aqpipe.config.settings import FIELD_NAMES, RESUME_MAY_CHANGE, RunConfig
from aqpipe.pipeline.vocab.link_rows import recorded


class ConfigError(ValueError):
    """A usage or configuration error: one line saying what is wrong and how to fix it (exit code 2)."""


def one_line(text: str) -> str:
    """Collapse a message (some libraries' errors span lines) into the single line the contract promises."""
    return " ".join(text.split())


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
            setattr(cfg, f.name, _coerce(f.name, merged[f.name]))
    return cfg


def value_type(name: str) -> Any:
    """The type a value of field `name` has once given (its annotation without `| None`): bool, int, float, str or
    list[int]."""
    annotation = _HINTS[name]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation


def _is_integer(value: Any) -> bool:
    """Whether a file's or a flag's value is an integer (a number, or its digits as text; not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, str)) and bool(re.fullmatch(r"-?\d+", str(value).strip()))


def _coerce(name: str, value: Any) -> Any:
    """`value` (from a file or a flag's text) as field `name`'s type, or ConfigError naming the flag."""
    kind = value_type(name)
    flag = "--" + name.replace("_", "-")
    if value is None:
        return None
    if kind is bool:
        text = str(value).strip().lower()
        if text not in BOOLEAN_WORDS:
            raise ConfigError(f"{flag} must be true or false, got {value!r}")
        return BOOLEAN_WORDS[text]
    if kind is int:
        if not _is_integer(value):
            raise ConfigError(f"{flag} must be an integer, got {value!r}")
        return int(value)
    if kind is float:
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not math.isfinite(out):
            raise ConfigError(f"{flag} must be a finite number, got {value!r}")
        return out
    if typing.get_origin(kind) is list:
        if not isinstance(value, list) or not all(_is_integer(v) for v in value):
            raise ConfigError(f"{name} must be a list of integers, got {value!r}")
        return [int(v) for v in value]
    return str(value)


_HINTS = typing.get_type_hints(RunConfig)


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
    values = recorded(saved)
    for key, value in given.items():
        if key in RESUME_MAY_CHANGE:
            values[key] = value
            continue
        before = build_config({}, {key: values.get(key)}) if values.get(key) is not None else RunConfig()
        after = build_config({}, {key: value})
        if getattr(before, key) != getattr(after, key):
            raise ConfigError(f"--{key.replace('_', '-')} cannot change on --resume: the run used "
                              f"{getattr(before, key)!r}, got {getattr(after, key)!r}")
    values["out"], values["resume"] = run_dir, run_dir
    return values


