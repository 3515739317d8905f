"""A readable, fast PyTorch implementation of the Transformer of "Attention Is All You Need" for translation."""

from .config import Config, ConfigError, TransformerConfig, load_config
from .model import Transformer

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "Transformer", "TransformerConfig", "load_config"]
