"""Validation during training (loss, perplexity, greedy BLEU and chrF) and the run's metrics log."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

import torch

from ..config import Config
from ..engines import PyTorchEngine
from ..evaluate import corpus_scores
from ..model import Transformer
from ..tokenizer import Tokenizer
from ..translate import Translator, source_within
from .data import ValidationSet, epoch_batches
from .loss import LossComputation, batch_loss

logger = logging.getLogger(__name__)


@torch.no_grad()
def validate(
    model: Transformer,
    tokenizer: Tokenizer,
    valid: ValidationSet,
    config: Config,
    device: torch.device,
) -> dict[str, Any]:
    """Validation loss and perplexity (teacher forcing) and BLEU/chrF of greedy decodes of the first
    `data.valid_max_sentences` sentences (all if 0). Leaves the model in eval mode.

    Returns:
        {"loss", "nll", "ppl", "bleu", "chrf", "bleu_signature", "n_sentences", "hypotheses", "hypothesis_ids"}:
        loss and nll per target token; the greedy translations of the scored sentences (texts, and token ids
        without bos/eos), in order. Each corpus (`valid.corpora`) has its first `data.valid_max_sentences` (all if
        0) scored against its own references: "bleu" and "chrf" are the means over the corpora, and a multilingual
        run's "directions" maps each named corpus ("de-en") to its {"bleu", "chrf", "n_sentences"}.
    """
    model.eval()
    total_loss = total_nll = 0.0
    n_tokens = 0
    loss_module = LossComputation(model, config.training.label_smoothing)
    pairs = valid.pairs
    longest = (
        config.model.max_positions
    )  # a longer pair: left out of the loss, its source cut for BLEU
    fits = (pairs.src_lengths <= longest) & (pairs.tgt_lengths <= longest)
    if not fits.all():
        logger.warning(
            "validation: %d pairs longer than model.max_positions=%d tokens are left out of the loss; their "
            "sources are translated from their first %d tokens, as translation does",
            int((~fits).sum()),
            longest,
            longest - 1,
        )
    for indices in epoch_batches(pairs, config, epoch=0):
        indices = indices[fits[indices]]
        if not len(indices):
            continue
        batch = pairs.batch(indices).to(device)
        loss, nll = batch_loss(loss_module, batch)
        total_loss, total_nll = total_loss + loss.item(), total_nll + nll.item()
        n_tokens += batch.n_tgt_tokens
    chosen = [
        range(
            start,
            min(end, start + config.data.valid_max_sentences)
            if config.data.valid_max_sentences
            else end,
        )
        for _, start, end in valid.corpora
    ]
    translator = Translator(PyTorchEngine(model, tokenizer, config, device))
    greedy = dataclasses.replace(config.decoding, beam_size=1, n_best=1)
    hyps = translator.decode_ids(
        [source_within(pairs.src(i).tolist()[:-1], longest)[0] for r in chosen for i in r],
        greedy,
        scores=False,
    )  # BLEU only
    texts = [tokenizer.decode_tgt(h[0].tokens) for h in hyps]
    per_corpus, done = {}, 0
    for (corpus, _, _), indices in zip(valid.corpora, chosen):
        per_corpus[corpus] = corpus_scores(
            texts[done : done + len(indices)],
            [valid.references[i] for i in indices],
            corpus.tgt_lang,
        )
        done += len(indices)
    scores = list(per_corpus.values())
    nll = total_nll / n_tokens
    # the mean over the corpora picks best.pt and drives early stopping
    result = {
        "loss": total_loss / n_tokens,
        "nll": nll,
        "ppl": math.exp(min(nll, 50)),
        "bleu": sum(s.bleu for s in scores) / len(scores),
        "chrf": sum(s.chrf for s in scores) / len(scores),
        "bleu_signature": scores[0].bleu_signature,
        "n_sentences": len(texts),
        "hypotheses": texts,
        "hypothesis_ids": [list(h[0].tokens) for h in hyps],
    }
    named = {
        corpus.files: s for corpus, s in per_corpus.items() if corpus.files
    }  # scored apart, as their files are named apart (`Corpus.files`): a multilingual run's directions
    if named:
        result["directions"] = {
            name: {"bleu": s.bleu, "chrf": s.chrf, "n_sentences": s.n_sentences}
            for name, s in named.items()
        }
        for name, s in named.items():
            logger.info(
                "valid %s: BLEU %.2f chrF %.2f (%d sentences)", name, s.bleu, s.chrf, s.n_sentences
            )
        logger.info(
            "valid: mean of %d directions BLEU %.2f chrF %.2f",
            len(named),
            result["bleu"],
            result["chrf"],
        )
    return result


class MetricsLog:
    """Appends JSON lines to run_dir/metrics.jsonl ("train" records per log interval, "valid" per validation);
    on resume, drops the lines past the resumed step (they are written again)."""

    def __init__(self, path: Path, resume_step: Optional[int]) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        elif resume_step is None:
            path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
