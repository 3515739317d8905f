"""Engines: what decodes source ids for the text-to-text pipeline (`translate.Translator`).

`base.py` states the interface (`Engine`, `SourceBatch`), `pytorch.py` and `ctranslate2.py` implement it, and
`open.py` decides which engine opens a path (`open_engine`) and loads our model from a checkpoint or a MarianMT
folder (`load_model`).
"""

from .base import Engine, SourceBatch
from .ctranslate2 import CTranslate2Engine
from .open import load_model, open_engine
from .pytorch import PyTorchEngine, check_workers

__all__ = [
    "CTranslate2Engine",
    "Engine",
    "PyTorchEngine",
    "SourceBatch",
    "check_workers",
    "load_model",
    "open_engine",
]
