"""A readable, fast PyTorch implementation of the Transformer of "Attention Is All You Need" for translation.

The public names below are imported on first use, so that importing a torch-free part of the package (the
configuration, the tokenizer, the text and token-cache readers) does not import torch: the background process that
encodes subword samples (`data/subword_sampling.py`) relies on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy_imports import lazy_exports

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "Transformer", "TransformerConfig", "Translator", "load_config"]

_HOMES = {
    "Config": ".config",
    "ConfigError": ".config",
    "TransformerConfig": ".config",
    "load_config": ".config",
    "Transformer": ".model",
    "Translator": ".translate",
}

if TYPE_CHECKING:
    from .config import Config, ConfigError, TransformerConfig, load_config
    from .model import Transformer
    from .translate import Translator


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
