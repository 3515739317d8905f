"""Data for a training run: the tokenizer (trained once per run directory), the training split's token cache, the
validation set, and the batches of each epoch.

Under torchrun: rank 0 trains (or reuses) the tokenizer and loads the validation set; then local rank 0 of every
machine finds or builds the token cache while the other processes of that machine wait, then map it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..config import Config, ConfigError, DataConfig, check_trainable
from ..config.languages import for_direction, language_pairs, language_tokens
from ..data import DataError, EncodedPairs, get_token_cache, load_split, open_split, token_batches
from ..data.mixing import MixedPairs, direction_shares, mix_directions
from ..data.subword_sampling import SAMPLES_FOLDER, SampledEpochs
from ..tokenizer import Tokenizer, train_tokenizer
from .distributed import Distributed

logger = logging.getLogger(__name__)


@dataclass
class ValidationSet:
    """The validation split, encoded in memory, with its raw references for BLEU."""

    pairs: EncodedPairs
    references: list[str]
    directions: list[tuple[str, int, int]] = field(default_factory=list)
    """A multilingual run: per direction ("de-en"), the range [start, end) of its pairs in `pairs` and
    `references` (its sources start with its target's token); empty for a bilingual run."""


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
    elif tokenizer is None and data.directions:
        tokenizer = train_tokenizer(multilingual_sample(data, config.training.seed), [], data,
                                    symbols=tuple(language_tokens(data)))
        for path in tokenizer.save(run_dir, data.src_lang, data.tgt_lang):
            logger.info("saved sentencepiece model %s (with the language tokens %s)", path,
                        " ".join(language_tokens(data)))
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


def multilingual_sample(data: DataConfig, seed: int) -> list[str]:
    """The sentencepiece sample of a multilingual run: data.spm_max_sentences / (number of languages) random
    sentences of each language, from the training split of the first direction that has it (so every language
    weighs the same, and English text shared by several directions is not sampled twice)."""
    languages = list(dict.fromkeys(lang for pair in language_pairs(data) for lang in pair))
    per_language = -(-data.spm_max_sentences // len(languages))
    texts: list[str] = []
    for lang in languages:
        direction = next(f"{s}-{t}" for s, t in language_pairs(data) if lang in (s, t))
        source = open_split(for_direction(data, direction), data.train_split)
        src, tgt = source.sample(per_language, seed)
        texts += src if direction.startswith(f"{lang}-") else tgt
        logger.info("sentencepiece sample: %d %s sentences of %d from %s", len(src), lang, len(source), source.origin)
    return texts


def load_validation(config: Config, tokenizer: Tokenizer) -> ValidationSet:
    """The validation split, encoded (all pairs, none dropped); of a multilingual run, every direction's, one after
    the other, each source after its target's token.

    Raises:
        DataError: missing, misaligned or empty files.
    """
    data = config.data
    src: list[list[int]] = []
    tgt: list[list[int]] = []
    references: list[str] = []
    directions = []
    for direction in data.directions or [None]:
        view = data if direction is None else for_direction(data, direction)
        corpus = load_split(view, data.valid_split)
        logger.info("valid: %d pairs from %s", len(corpus), corpus.origin)
        prefix = tokenizer.source_prefix(view)
        directions.append((direction, len(references), len(references) + len(corpus)))
        src += [prefix + ids for ids in tokenizer.encode_src(corpus.src)]
        tgt += tokenizer.encode_tgt(corpus.tgt)
        references += corpus.tgt
    return ValidationSet(EncodedPairs.from_lists(src, tgt), references, directions if data.directions else [])


def prepare_data(config: Config, run_dir: Path, dist: Optional[Distributed] = None,
                 tokenizer: Optional[Tokenizer] = None
                 ) -> tuple[Tokenizer, Union[EncodedPairs, list[EncodedPairs]], Optional[ValidationSet]]:
    """Tokenizer (`tokenizer` if given: fine-tuning), training pairs (memory-mapped token cache; of a multilingual
    run, one per direction, in the order of data.directions) and validation set of a run.

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
    caches = []
    for direction in config.data.directions or [None]:
        view = config.data if direction is None else for_direction(config.data, direction)
        train = get_token_cache(view, config.data.train_split, tokenizer, build=dist.local_rank == 0)
        logger.info("train%s: %d pairs (%d source + %d target tokens, eos included on both sides)",
                    f" {direction}" if direction else "", len(train), int(train.src_lengths.sum()),
                    int(train.tgt_lengths.sum()))
        if dist.is_main:
            report_unknown_characters(config.data, train)
        caches.append(train)
    return tokenizer, caches if config.data.directions else caches[0], valid


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


class MixedEpochs:
    """The epochs of a multilingual run: each direction's pairs of the epoch (`CacheEpochs` or `SampledEpochs`)
    mixed by temperature sampling (`data/mixing.py`), fixed by training.seed and the epoch."""

    def __init__(self, directions: list[Union[CacheEpochs, SampledEpochs]], data: DataConfig, seed: int) -> None:
        self.directions, self.temperature, self.seed = directions, data.direction_temperature, seed
        self.sizes = [len(d) for d in directions]
        shares = direction_shares(self.sizes, self.temperature)
        logger.info("directions mixed with temperature %g: pairs per epoch %s", self.temperature, ", ".join(
            f"{d} {int(n)} of {size}" for d, n, size in zip(data.directions, shares, self.sizes)))

    def __len__(self) -> int:
        return sum(self.sizes)

    def epoch(self, epoch: int) -> MixedPairs:
        return mix_directions([d.epoch(epoch) for d in self.directions], self.sizes, self.temperature, self.seed,
                              epoch)

    def prefetch(self, epoch: int) -> None:
        for direction in self.directions:
            direction.prefetch(epoch)

    def close(self) -> None:
        for direction in self.directions:
            direction.close()


def training_epochs(config: Config, run_dir: Path, tokenizer: Tokenizer,
                    cache: Union[EncodedPairs, list[EncodedPairs]], dist: Optional[Distributed] = None
                    ) -> Union[CacheEpochs, SampledEpochs, MixedEpochs]:
    """The training pairs of each epoch (`.epoch(e)`): the token cache, or with data.subword_sampling a fresh
    sample for every epoch after the first (`data/subword_sampling.py`; local rank 0 of each machine builds them);
    of a multilingual run (`cache`: one per direction), the directions' mixed (`MixedEpochs`)."""
    data = config.data
    if data.directions:
        return MixedEpochs([_epochs(config, run_dir, tokenizer, part, dist, for_direction(data, direction),
                                    direction) for direction, part in zip(data.directions, cache)],
                           data, config.training.seed)
    return _epochs(config, run_dir, tokenizer, cache, dist, data)


def _epochs(config: Config, run_dir: Path, tokenizer: Tokenizer, cache: EncodedPairs, dist: Optional[Distributed],
            data: DataConfig, name: str = "") -> Union[CacheEpochs, SampledEpochs]:
    if not data.subword_sampling:
        return CacheEpochs(cache)
    dist = dist or Distributed()
    kind = "BPE-dropout" if data.spm_model_type == "bpe" else f"unigram {data.subword_nbest_size}-best sampling"
    logger.info("subword sampling (data.subword_sampling): %s, alpha %g; every epoch after the first is encoded "
                "afresh in %s", kind, data.subword_alpha, run_dir / SAMPLES_FOLDER / name)
    return SampledEpochs(cache, data, tokenizer, config.training.seed, run_dir, build=dist.local_rank == 0,
                         name=name)


def epoch_batches(pairs: Union[EncodedPairs, MixedPairs], config: Config, epoch: int) -> list[np.ndarray]:
    """The batches (arrays of pair indices) of one epoch, fixed by training.seed and the epoch number."""
    return token_batches(pairs.src_lengths, pairs.tgt_lengths, config.data.max_tokens_per_batch,
                         config.training.seed, epoch, config.data.pool_factor)
