"""A readable, fast PyTorch implementation of the Transformer of "Attention Is All You Need" for translation."""

from .config import Config, ConfigError, TransformerConfig, load_config
from .model import Transformer
from .translate import Translator

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "Transformer", "TransformerConfig", "Translator", "load_config"]
