"""Checkpoint files: atomic save, safe load, and the loader the inference path uses.

A checkpoint is a dict of plain data and tensors only, loadable with `torch.load(weights_only=True)`. Inference
reads four of its keys (`load_for_inference`); the full list, and what training adds for an exact resume, is in
`transformer/training/checkpoint.py`, which writes them:

    model        state_dict of the Transformer
    config       the resolved config as a plain dict (`Config.to_dict()`)
    vocab_sizes  [src_vocab_size, tgt_vocab_size]
    tokenizer    {"src": bytes, "tgt": bytes or None}: serialized sentencepiece models; an imported vocabulary
                 adds "vocab" (the piece of each id, see `Tokenizer`)
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from .config import Config, config_from_dict
from .files import CheckpointError, write_file
from .model import Transformer
from .tokenizer import Tokenizer


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """Write `state` to `path` atomically: a temporary file in the same folder, fsync, then rename.

    A process killed while saving leaves the previous file at `path` intact. A symbolic link is written through
    (its target is replaced, the link stays).

    Raises:
        CheckpointError: `path` exists and is not a regular file (a folder, a device such as /dev/stdout, a pipe).
    """
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    if path.exists() and not path.is_file():
        raise CheckpointError(
            f"{path}: exists and is not a regular file; a checkpoint is written to a file path"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint safely (`weights_only=True`: no pickled objects are executed).

    Args:
        path: the `.pt` file.
        map_location: device for the tensors; "cpu" loads a CUDA checkpoint on a machine without CUDA.

    Raises:
        CheckpointError: naming the file, if it is missing, truncated/corrupt, not a checkpoint of this
            project, or holds pickled objects.
    """
    path = Path(path)
    # model folders (CTranslate2, MarianMT) are told apart by `engines.load_model`
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder, not a checkpoint file: give a .pt file such as "
            "RUN/checkpoints/best.pt"
        )
    if not path.is_file():
        parts = path.as_posix().split("/")
        # looks like a Hub id
        if len(parts) == 2 and all(parts) and not path.suffix and not path.parent.exists():
            raise CheckpointError(
                f"{path}: checkpoint not found (if it names a Hugging Face model, download it to a "
                f"folder and give that: hf download {path} --local-dir {parts[1]})"
            )
        raise CheckpointError(f"{path}: checkpoint not found")
    with open(path, "rb") as f:
        head = f.read(4)
    # torch.save's zip format; its older pickle format
    if head[:4] != b"PK\x03\x04" and head[:1] != b"\x80":
        raise CheckpointError(
            f"{path}: not a checkpoint (a .pt file written by `transformer train` or "
            "`transformer average`); its first bytes are not those of a PyTorch file"
        )
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{path}: refused to load: besides tensors and plain data the file holds pickled "
            "Python objects, which could run code when loaded; it was not written by this "
            "project"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0][
            :200
        ]  # its first sentence
        raise CheckpointError(
            f"{path}: not a readable checkpoint (truncated or corrupt?): {reason}"
        ) from None
    # torch.load does not check the zip's CRC-32s: damaged bytes would load as weights
    if head[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged is not None:
            raise CheckpointError(
                f"{path}: corrupt: the bytes of {damaged} do not match their stored checksum "
                "(damaged after it was written)"
            )
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise CheckpointError(
            f"{path}: not a checkpoint of this project (no model weights and config)"
        )
    return state


def load_for_inference(
    path: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[Config, Transformer, Tokenizer]:
    """Rebuild what translation needs from one checkpoint file: its config, the model (eval mode, on map_location)
    and the tokenizer. Works for last.pt, best.pt, step_N.pt and averaged checkpoints alike (model folders:
    `engines.load_model`).

    Raises:
        CheckpointError: the file is missing, corrupt, unsafe, or its weights do not fit its config.
    """
    state = load_checkpoint(path, map_location=map_location)
    try:
        config = config_from_dict(state["config"], vocab_sizes=tuple(state["vocab_sizes"]))
        tokenizer = Tokenizer.from_dict(state["tokenizer"])
    except KeyError as err:
        raise CheckpointError(
            f"{path}: not a checkpoint of this project (no {err.args[0]!r})"
        ) from None
    model = Transformer(config.model)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise CheckpointError(
            f"{path}: the weights do not fit the checkpoint's model config: "
            f"{str(err).splitlines()[0][:200]}"
        ) from None
    return config, model.to(map_location).eval(), tokenizer
