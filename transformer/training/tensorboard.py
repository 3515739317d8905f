"""TensorBoard logs of a training run, in RUN_DIR/tensorboard/ (`tensorboard --logdir runs/`).

What is written (tags):
    train/loss, train/nll, train/ppl, train/lr, train/grad_norm (before clipping), train/tgt_tokens_per_s,
    train/loss_scale (fp16)
                                        every `training.log_every_steps` updates (the "train" records of
                                        metrics.jsonl)
    valid/loss, valid/ppl, valid/bleu, valid/chrf       at every validation
    valid/samples                       text: source, reference and greedy translation of the first
                                        `SAMPLES` validation sentences
    valid/cross_attention               image: the last decoder layer's encoder-decoder attention (mean of the
                                        heads) while translating the first validation sentence; rows are target
                                        positions, columns source positions, brighter is more weight
    valid/cross_attention_labels        text: that image's source and target pieces

Only rank 0 writes (under torchrun the other processes have no log). On --resume the writer starts with
`purge_step` = the resumed step, so TensorBoard hides the events an interrupted run wrote after that step and
each step shows once. Needs the `tensorboard` package (`pip install 'transformer-nmt[tensorboard]'`), and
Pillow for the image (without it the image is left out, with a warning).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from ..config import BOS_ID, Config, ConfigError
from ..model import Transformer
from ..tokenizer import Tokenizer
from ..translate import source_within
from .data import ValidationSet

logger = logging.getLogger(__name__)

SAMPLES = 3
"""Validation sentences shown as text at each validation."""

_TRAIN_SCALARS = ("loss", "nll", "ppl", "lr", "grad_norm", "tgt_tokens_per_s", "loss_scale")
_VALID_SCALARS = ("loss", "ppl", "bleu", "chrf")
_CELL_PIXELS = 8
"""Each attention weight is drawn as a square of this many pixels."""


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def pillow_available() -> bool:
    return importlib.util.find_spec("PIL") is not None


def wants_tensorboard(config: Config) -> bool:
    """`training.tensorboard` resolved: null means on exactly when the tensorboard package is installed.

    Raises:
        ConfigError: `training.tensorboard: true` without the package.
    """
    wanted = config.training.tensorboard
    if wanted is None:
        return tensorboard_available()
    if wanted and not tensorboard_available():
        raise ConfigError(
            "training.tensorboard: true needs the tensorboard package: pip install tensorboard "
            "(or pip install 'transformer-nmt[tensorboard]'), or set it to false"
        )
    return bool(wanted)


class TensorBoardLog:
    """Writes the run's records to RUN_DIR/tensorboard/ as described in the module docstring."""

    def __init__(self, log_dir: Path, resume_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=resume_step)
        # TensorBoard encodes images with Pillow, which it does not require
        self.images = pillow_available()
        if not self.images:
            logger.warning(
                "TensorBoard: Pillow is not installed, so no cross-attention image is written "
                "(pip install pillow)"
            )

    def write(self, record: dict[str, Any]) -> None:
        """Scalars of one metrics.jsonl record ("train" or "valid")."""
        kind = record["type"]
        for key in _TRAIN_SCALARS if kind == "train" else _VALID_SCALARS:
            if record.get(key) is not None:
                self.writer.add_scalar(f"{kind}/{key}", record[key], record["step"])
        self.writer.flush()

    def write_samples(
        self, step: int, sources: list[str], references: list[str], hypotheses: list[str]
    ) -> None:
        rows = ["| | source | reference | translation |", "|---|---|---|---|"]
        for i, (src, ref, hyp) in enumerate(zip(sources, references, hypotheses)):
            rows.append(f"| {i} | {_cell(src)} | {_cell(ref)} | {_cell(hyp)} |")
        self.writer.add_text("valid/samples", "\n".join(rows), step)
        self.writer.flush()

    def write_attention(
        self, step: int, weights: torch.Tensor, src_pieces: list[str], tgt_pieces: list[str]
    ) -> None:
        """`weights`: (T, S) attention weights in [0, 1] (rows: target positions, columns: source positions)."""
        if self.images:
            image = (
                weights.float()
                .clamp(0, 1)
                .repeat_interleave(_CELL_PIXELS, 0)
                .repeat_interleave(_CELL_PIXELS, 1)
            )
            self.writer.add_image("valid/cross_attention", image, step, dataformats="HW")
        self.writer.add_text(
            "valid/cross_attention_labels",
            f"source (columns): {' '.join(src_pieces)}\n\ntarget (rows): {' '.join(tgt_pieces)}",
            step,
        )
        self.writer.flush()

    def write_validation(
        self,
        step: int,
        model: Transformer,
        tokenizer: Tokenizer,
        valid: ValidationSet,
        hypotheses: list[str],
        hypothesis_ids: list[list[int]],
        device: torch.device,
    ) -> None:
        """The first `SAMPLES` validation translations with their sources and references, and the cross-attention
        image of the first validation sentence's translation."""
        n = min(SAMPLES, len(hypotheses))
        sources = [source_text(tokenizer, valid.pairs.src(i).tolist()) for i in range(n)]
        self.write_samples(step, sources, valid.references[:n], hypotheses[:n])
        if hypothesis_ids:
            src = valid.pairs.src(0).tolist()[:-1]  # cut as validation translated it
            src = source_within(src, model.config.max_positions)[0]
            weights, src_pieces, tgt_pieces = cross_attention(
                model, tokenizer, src, hypothesis_ids[0], device
            )
            self.write_attention(step, weights, src_pieces, tgt_pieces)

    def close(self) -> None:
        self.writer.close()


@torch.no_grad()
def cross_attention(
    model: Transformer,
    tokenizer: Tokenizer,
    src_ids: list[int],
    tgt_ids: list[int],
    device: torch.device,
) -> tuple[torch.Tensor, list[str], list[str]]:
    """The last decoder layer's encoder-decoder attention, averaged over heads, when the model reads `tgt_ids`
    (its translation of `src_ids`, eos included) after bos: a (len(tgt_ids) + 1, len(src_ids)) tensor, with the
    source pieces and the predicted target pieces (eos last) as labels. Leaves the model in eval mode."""
    model.eval()
    src = torch.tensor([src_ids], device=device)
    tgt_in = torch.tensor([[BOS_ID] + list(tgt_ids)], device=device)
    _, weights = model.forward_with_attention(src, tgt_in)
    src_pieces = [tokenizer.id_to_piece(i, "src") for i in src_ids[:-1]] + ["</s>"]
    tgt_pieces = tokenizer.tgt_pieces(list(tgt_ids)) + ["</s>"]
    return weights.cross[-1][0].mean(0).cpu(), src_pieces, tgt_pieces


def source_text(tokenizer: Tokenizer, src_ids: list[int]) -> str:
    """A readable source sentence from its ids (eos dropped), for display."""
    pieces = [tokenizer.id_to_piece(i, "src") for i in src_ids if i > 3]
    return "".join(pieces).replace("▁", " ").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
