"""A run's configuration: the one definition of its settings (`settings`), values from files and flags
(`values`, rates such as `100mbit`: `rates`), resolution with every check made before a worker starts and each
codec and grad-sync setting parsed once (`checks`), and what the settings say to people: flag help and the generated
reference with the training defaults per model (`reference`)."""

from aqpipe.config.checks import PRESET_TRAINING, resolve
from aqpipe.config.settings import FIELD_NAMES, RESUME_MAY_CHANGE, SECTIONS, ResolvedConfig, RunConfig, settings
from aqpipe.config.values import ConfigError, build_config, load_config_file, resume_values

__all__ = ["ConfigError", "FIELD_NAMES", "PRESET_TRAINING", "RESUME_MAY_CHANGE", "ResolvedConfig", "RunConfig", "SECTIONS",
           "build_config", "load_config_file", "resolve", "resume_values", "settings"]
