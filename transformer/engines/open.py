"""Which engine opens a path, decided here and nowhere else.

    .pt file                       our checkpoint            -> PyTorchEngine
    MarianMT folder (config.json)  converted on loading      -> PyTorchEngine (`hf.load_marian`)
    CTranslate2 folder (model.bin, transformer_nmt.json)     -> CTranslate2Engine
    several paths                  an ensemble of the above but CTranslate2 folders -> PyTorchEngine

Any other folder is refused in one line that says what was expected. A MarianMT folder is converted once, here, into
our model and tokenizer; nothing past this point knows it came from one, but its languages, which its files may
not name, are the placeholders `src` and `tgt` (`hf.UNKNOWN_PAIR`) wherever languages are shown (/health, a
refused tgt_lang).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..checkpoint import load_for_inference
from ..config import Config, OptionError
from ..config.languages import describe
from ..ct2 import METADATA, is_ctranslate2_dir
from ..device import resolve_device
from ..files import CheckpointError
from ..hf import UNKNOWN_PAIR, is_marian_dir, load_marian
from ..model import Transformer
from ..tokenizer import Tokenizer
from .base import Engine
from .ctranslate2 import CTranslate2Engine
from .pytorch import PyTorchEngine


def load_model(
    path: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[Config, Transformer, Tokenizer]:
    """Our model from a .pt checkpoint or a MarianMT folder: its config, the model (eval mode) and its tokenizer.

    Raises:
        CheckpointError: the file is missing, corrupt or unsafe; a CTranslate2 folder (it holds no PyTorch weights) or
            another folder.
        ConfigError: a MarianMT folder whose model ours cannot express (naming the field).
    """
    path = Path(path)
    if is_marian_dir(path):
        return load_marian(path, map_location)
    if is_ctranslate2_dir(path):
        raise CheckpointError(
            f"{path} is a CTranslate2 export, not a checkpoint file: translate, evaluate and serve "
            "take it; this needs the .pt checkpoint it was exported from"
        )
    if (path / "model.bin").is_file():
        raise CheckpointError(
            f"{path} holds a CTranslate2 model.bin without {METADATA}: it was not written by "
            "`transformer export`, which the tokenizer and config come from; export the .pt "
            "checkpoint again"
        )
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder but not a model: give a .pt checkpoint such as "
            f"RUN/checkpoints/best.pt, a CTranslate2 export (model.bin and {METADATA}) or a "
            "Hugging Face MarianMT folder (config.json with model_type marian)"
        )
    return load_for_inference(path, map_location)


def open_engine(
    paths: str | Path | list[str | Path],
    device: str = "cpu",
    quantization: Optional[str] = None,
    workers: int = 1,
    compile: bool = False,
) -> Engine:
    """The engine for one path, or an ensemble of several (the table of the module docstring).

    Args:
        paths: a .pt checkpoint, a MarianMT folder, a CTranslate2 folder, or a list of them (one: as the path
            alone; several: an ensemble of .pt checkpoints and MarianMT folders).
        device: cpu, cuda, cuda:N, mps or auto.
        quantization: None or "int8" (our engine; a CTranslate2 folder's weight type is chosen when exporting).
        workers: batches decoded at once.
        compile: our engine's compiled decoding step (one model).

    Raises:
        CheckpointError: a path that cannot be read, or a folder that is not a model.
        DeviceError: the device is not available.
        OptionError: a quantization or compile for a CTranslate2 folder; a CTranslate2 folder in an ensemble;
            compile with an ensemble; the ensemble's tokenizers, vocabularies or language pairs differ (naming both
            paths); as `PyTorchEngine` and `CTranslate2Engine`.
    """
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    folders = [str(p) for p in paths if is_ctranslate2_dir(p)]
    if folders and len(paths) > 1:
        raise OptionError(
            f"an ensemble is of our checkpoints: {folders[0]} is a CTranslate2 folder (CTranslate2 "
            "decodes one model)"
        )
    if folders:
        if compile:
            raise OptionError(
                f"{{compile}} compiles our own decoder; {folders[0]} is a CTranslate2 folder, which "
                "decodes with CTranslate2's own decoder",
                compile=True,
            )
        if quantization:
            raise OptionError(
                f"{{quantization}}: {folders[0]} is a CTranslate2 folder, whose weight type is chosen "
                "when exporting (transformer export --quantization ...)",
                quantization=quantization,
            )
        return CTranslate2Engine(folders[0], device=device, workers=workers)
    if compile and len(paths) > 1:
        raise OptionError("{compile} compiles one model's decoder, not an ensemble", compile=True)
    resolved = resolve_device(device)
    loaded = [load_model(path) for path in paths]
    _check_ensemble(paths, loaded)
    config, _, tokenizer = loaded[0]
    return PyTorchEngine(
        [model for _, model, _ in loaded],
        tokenizer,
        config,
        resolved,
        quantization=quantization,
        workers=workers,
        compile=compile,
    )


def _check_ensemble(
    paths: list[str | Path], loaded: list[tuple[Config, Transformer, Tokenizer]]
) -> None:
    """Refuse an ensemble whose members differ in tokenizer and vocabulary, or in language pair (OptionError)."""
    first, data = loaded[0][2].digest(), loaded[0][0].data
    for path, (config, _, tokenizer) in zip(paths[1:], loaded[1:]):
        if tokenizer.digest() != first:
            raise OptionError(
                f"an ensemble needs one tokenizer and vocabulary: {paths[0]} and {path} have "
                "different ones"
            )
        translated = {_translated(config), _translated(loaded[0][0])}
        if len(translated) > 1 and ((*UNKNOWN_PAIR, None),) not in translated:
            raise OptionError(
                f"an ensemble translates the same directions with each model: {paths[0]} translates "
                f"{describe(data)}, {path} {describe(config.data)}"
            )


def _translated(config: Config) -> tuple[tuple[str, str, Optional[str]], ...]:
    """What a model translates: the languages and token of each corpus it was scored on (synthetic ones aside)."""
    return tuple(
        (c.src_lang, c.tgt_lang, c.language_token) for c in config.data.corpora if c.held_out
    )
