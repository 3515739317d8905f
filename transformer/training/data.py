"""Data for a training run: the tokenizer (trained once per run directory), the training split's token cache, the
validation set, and the batches of each epoch.

Under torchrun: rank 0 trains (or reuses) the tokenizer and loads the validation set; then local rank 0 of every
machine finds or builds the token cache while the other processes of that machine wait, then map it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..config import Config, ConfigError, DataConfig, check_trainable
from ..data import DataError, EncodedPairs, get_token_cache, load_split, open_split, token_batches
from ..data.subword_sampling import SAMPLES_FOLDER, SampledEpochs
from ..tokenizer import Tokenizer, train_tokenizer
from .distributed import Distributed

logger = logging.getLogger(__name__)


@dataclass
class ValidationSet:
    """The validation split, encoded in memory, with its raw references for BLEU."""

    pairs: EncodedPairs
    references: list[str]


def prepare_tokenizer(config: Config, run_dir: Path, given: Optional[Tokenizer] = None) -> Tokenizer:
    """The run's tokenizer: `given` (fine-tuning: the source's, saved in run_dir), else the one saved in run_dir,
    else one trained on a sample of the training split and saved.

    The sample is `data.spm_max_sentences` sentences per model (see its docstring), drawn with training.seed.

    Raises:
        DataError: bad training files.
        TokenizerError: vocabulary size unreachable.
        ConfigError: the saved tokenizer's vocabulary size differs from data.vocab_size, or run_dir holds another
            tokenizer than `given`.
    """
    data = config.data
    tokenizer = Tokenizer.load(run_dir, data.src_lang, data.tgt_lang, data.joint_vocab)
    if given is not None:
        if tokenizer is not None and tokenizer.digest() != given.digest():
            raise ConfigError(f"--init-from: {run_dir} holds another tokenizer (spm*.model) than the source's; "
                              "fine-tune into a new --run-dir")
        if tokenizer is None:
            given.save(run_dir, data.src_lang, data.tgt_lang)
        tokenizer = given
    elif tokenizer is None:
        source = open_split(data, data.train_split)
        n_pairs = len(source)
        per_model = -(-data.spm_max_sentences // 2) if data.joint_vocab else data.spm_max_sentences
        src, tgt = source.sample(per_model, config.training.seed)
        logger.info("sentencepiece sample: %d of %d training pairs from %s%s", len(src), n_pairs, source.origin,
                    f" (data.spm_max_sentences={data.spm_max_sentences})" if len(src) < n_pairs else "")
        for s, t in list(zip(src, tgt))[:2]:
            logger.info("example pair  %s: %s  ->  %s: %s", data.src_lang, s, data.tgt_lang, t)
        tokenizer = train_tokenizer(src, tgt, data)
        del src, tgt
        for path in tokenizer.save(run_dir, data.src_lang, data.tgt_lang):
            logger.info("saved sentencepiece model %s", path)
    else:
        logger.info("reusing the sentencepiece model(s) in %s", run_dir)
    if (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size) != (config.model.src_vocab_size,
                                                                config.model.tgt_vocab_size):
        raise ConfigError(f"data.vocab_size={data.vocab_size} but the sentencepiece model(s) in {run_dir} have "
                          f"{tokenizer.src_vocab_size}/{tokenizer.tgt_vocab_size} pieces; use a new --run-dir")
    return tokenizer


def load_validation(config: Config, tokenizer: Tokenizer) -> ValidationSet:
    """The validation split, encoded (all pairs, none dropped).

    Raises:
        DataError: missing, misaligned or empty files.
    """
    corpus = load_split(config.data, config.data.valid_split)
    logger.info("valid: %d pairs from %s", len(corpus), corpus.origin)
    pairs = EncodedPairs.from_lists(tokenizer.encode_src(corpus.src), tokenizer.encode_tgt(corpus.tgt))
    return ValidationSet(pairs, corpus.tgt)


def prepare_data(config: Config, run_dir: Path, dist: Optional[Distributed] = None,
                 tokenizer: Optional[Tokenizer] = None) -> tuple[Tokenizer, EncodedPairs, Optional[ValidationSet]]:
    """Tokenizer (`tokenizer` if given: fine-tuning), training pairs (memory-mapped token cache) and validation set
    of a run.

    Every process calls this; the collectives inside order the work as the module docstring says.

    Returns:
        (tokenizer, train, valid); valid is None on every process but rank 0 (only rank 0 validates).

    Raises:
        ConfigError, DataError, TokenizerError, TokenCacheError: before any long work where possible.
    """
    check_trainable(config)
    dist = dist or Distributed()
    given, valid = tokenizer, None
    if dist.is_main:
        created = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            tokenizer = prepare_tokenizer(config, run_dir, given)
            valid = load_validation(config, tokenizer)
        except BaseException:  # bad data or config: leave no empty run folder behind
            if created and not any(run_dir.iterdir()):
                run_dir.rmdir()
            raise
    dist.broadcast(None)  # the others wait for the tokenizer
    if not dist.is_main:
        tokenizer = prepare_tokenizer(config, run_dir, given)
    train = get_token_cache(config.data, config.data.train_split, tokenizer, build=dist.local_rank == 0)
    logger.info("train: %d pairs (%d source + %d target tokens, eos included on both sides)", len(train),
                int(train.src_lengths.sum()), int(train.tgt_lengths.sum()))
    if dist.is_main:
        report_unknown_characters(config.data, train)
    return tokenizer, train, valid


def report_unknown_characters(data: DataConfig, train: EncodedPairs) -> None:
    """Say how many training pairs hold characters the vocabulary maps to unk, and which (`UnknownCharacters`);
    with data.unknown_characters "refuse", stop.

    Raises:
        DataError: with "refuse", when there are such pairs.
    """
    found = train.unknown_characters
    if not found or not found["pairs"]:
        return
    shown = ", ".join(f"{c!r} ({n})" for c, n in found["characters"][:10])
    more = found["distinct"] - min(10, len(found["characters"]))
    message = (f"{found['pairs']} of {len(train)} training pairs hold characters the vocabulary maps to unk, so the "
               f"model learns to write or drop unk for them: {shown}{f' and {more} more' if more > 0 else ''} "
               "(pairs per character)")
    if data.unknown_characters == "refuse":
        raise DataError(f"{message}; data.unknown_characters=refuse (warn: train anyway)")
    logger.warning("%s; data.unknown_characters=refuse stops instead", message)


class CacheEpochs:
    """Every epoch trains on the token cache (data.subword_sampling off); `SampledEpochs` is the other kind."""

    def __init__(self, cache: EncodedPairs) -> None:
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def epoch(self, epoch: int) -> EncodedPairs:
        return self.cache

    def prefetch(self, epoch: int) -> None:
        pass

    def close(self) -> None:
        pass


def training_epochs(config: Config, run_dir: Path, tokenizer: Tokenizer, cache: EncodedPairs,
                    dist: Optional[Distributed] = None) -> Union[CacheEpochs, SampledEpochs]:
    """The training pairs of each epoch (`.epoch(e)`): the token cache, or with data.subword_sampling a fresh
    sample for every epoch after the first (`data/subword_sampling.py`; local rank 0 of each machine builds them)."""
    if not config.data.subword_sampling:
        return CacheEpochs(cache)
    dist = dist or Distributed()
    data = config.data
    kind = "BPE-dropout" if data.spm_model_type == "bpe" else f"unigram {data.subword_nbest_size}-best sampling"
    logger.info("subword sampling (data.subword_sampling): %s, alpha %g; every epoch after the first is encoded "
                "afresh in %s", kind, data.subword_alpha, run_dir / SAMPLES_FOLDER)
    return SampledEpochs(cache, data, tokenizer, config.training.seed, run_dir, build=dist.local_rank == 0)


def epoch_batches(pairs: EncodedPairs, config: Config, epoch: int) -> list[np.ndarray]:
    """The batches (arrays of pair indices) of one epoch, fixed by training.seed and the epoch number."""
    return token_batches(pairs.src_lengths, pairs.tgt_lengths, config.data.max_tokens_per_batch,
                         config.training.seed, epoch, config.data.pool_factor)
