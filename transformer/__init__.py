"""A readable, fast PyTorch implementation of the Transformer of "Attention Is All You Need" for translation.

The public names below are imported on first use, so that importing a torch-free part of the package (the
configuration, the tokenizer, the text and token-cache readers) does not import torch: the background process that
encodes subword samples (`data/subword_sampling.py`) relies on it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "Transformer", "TransformerConfig", "Translator", "load_config"]

_HOMES = {"Config": ".config", "ConfigError": ".config", "TransformerConfig": ".config", "load_config": ".config",
          "Transformer": ".model", "Translator": ".translate"}

if TYPE_CHECKING:
    from .config import Config, ConfigError, TransformerConfig, load_config
    from .model import Transformer
    from .translate import Translator


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
