"""Configuration: the sections of a recipe (`sections.py`: dataclasses, defaults, meanings), reading one
(`loading.py`: YAML, type checks, `--set` overrides) and the errors both raise (`errors.py`)."""

from .errors import ConfigError, OptionError
from .loading import config_from_dict, load_config, override_config, read_raw_config, save_config
from .sections import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Config,
    DataConfig,
    DecodingConfig,
    TrainingConfig,
    TransformerConfig,
    check_trainable,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "Config",
    "ConfigError",
    "DataConfig",
    "DecodingConfig",
    "OptionError",
    "TrainingConfig",
    "TransformerConfig",
    "check_trainable",
    "config_from_dict",
    "load_config",
    "override_config",
    "read_raw_config",
    "save_config",
]
