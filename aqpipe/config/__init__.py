"""A run's configuration: the one definition of its settings (`settings`), values from files and flags
(`values`), and resolution with every check made before a worker starts (`checks`)."""

from aqpipe.config.checks import PRESET_TRAINING, resolve
from aqpipe.config.settings import FIELD_NAMES, RESUME_MAY_CHANGE, SECTIONS, ResolvedConfig, RunConfig, settings
from aqpipe.config.values import ConfigError, build_config, load_config_file, resume_values

__all__ = ["ConfigError", "FIELD_NAMES", "PRESET_TRAINING", "RESUME_MAY_CHANGE", "ResolvedConfig", "RunConfig", "SECTIONS",
           "build_config", "load_config_file", "resolve", "resume_values", "settings"]
