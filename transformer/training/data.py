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
from ..config.languages import Corpus, reserved_pieces
from ..data import DataError, EncodedPairs, get_token_cache, load_split, open_split, token_batches
from ..data.mixing import MixedPairs, direction_shares, epoch_size, mix_directions
from ..data.subword_sampling import SAMPLES_FOLDER, SampledEpochs
from ..tokenizer import Tokenizer, train_tokenizer
from .distributed import Distributed

logger = logging.getLogger(__name__)


@dataclass
class ValidationSet:
    """The validation split of every corpus of a run, encoded in memory, one corpus after the other, with the raw
    references for BLEU."""

    pairs: EncodedPairs
    references: list[str]
    corpora: list[tuple[Corpus, int, int]] = field(default_factory=list)
    """Per corpus, the range [start, end) of its pairs in `pairs` and `references` (its sources start with its
    marks: a multilingual run's target-language token)."""


def prepare_tokenizer(
    config: Config, run_dir: Path, given: Optional[Tokenizer] = None
) -> Tokenizer:
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
            raise ConfigError(
                f"--init-from: {run_dir} holds another tokenizer (spm*.model) than the source's; "
                "fine-tune into a new --run-dir"
            )
        if tokenizer is None:
            given.save(run_dir, data.src_lang, data.tgt_lang)
        tokenizer = given
    elif tokenizer is None:
        reserved = reserved_pieces(data)
        # one model: every language's sentences, the corpora's marks whole pieces
        if data.joint_vocab:
            tokenizer = train_tokenizer(
                joint_sample(data, config.training.seed), [], data, symbols=tuple(reserved)
            )
        else:  # a model per side: one source and one target language (languages.check_directions)
            tokenizer = train_tokenizer(
                *_sample(
                    data.corpora[0].section(data), data.spm_max_sentences, config.training.seed
                ),
                data,
            )
        for path in tokenizer.save(run_dir, data.src_lang, data.tgt_lang):
            logger.info(
                "saved sentencepiece model %s%s",
                path,
                f" (with the reserved pieces {' '.join(reserved)})" if reserved else "",
            )
    else:
        logger.info("reusing the sentencepiece model(s) in %s", run_dir)
    if (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size) != (
        config.model.src_vocab_size,
        config.model.tgt_vocab_size,
    ):
        raise ConfigError(
            f"data.vocab_size={data.vocab_size} but the sentencepiece model(s) in {run_dir} have "
            f"{tokenizer.src_vocab_size}/{tokenizer.tgt_vocab_size} pieces; use a new --run-dir"
        )
    return tokenizer


def joint_sample(data: DataConfig, seed: int) -> list[str]:
    """The sentencepiece sample of a joint vocabulary: data.spm_max_sentences / (number of languages) random
    sentences of each language, taken from the training split of the first corpus that has it (so every language
    weighs the same, and English text shared by several directions is not sampled twice); each corpus is sampled
    once, with `seed`."""
    languages = list(dict.fromkeys(lang for c in data.corpora for lang in (c.src_lang, c.tgt_lang)))
    per_language = -(-data.spm_max_sentences // len(languages))
    samples: dict[Corpus, tuple[list[str], list[str]]] = {}
    texts: list[str] = []
    for lang in languages:
        corpus = next(c for c in data.corpora if lang in (c.src_lang, c.tgt_lang))
        if corpus not in samples:
            samples[corpus] = _sample(corpus.section(data), per_language, seed)
        src, tgt = samples[corpus]
        texts += src if corpus.src_lang == lang else tgt
    return texts


def _sample(data: DataConfig, n_pairs: int, seed: int) -> tuple[list[str], list[str]]:
    """Both sides of `n_pairs` random training pairs of the data section of one corpus, drawn with `seed`."""
    source = open_split(data, data.train_split)
    src, tgt = source.sample(n_pairs, seed)
    logger.info(
        "sentencepiece sample: %d of %d training pairs from %s%s",
        len(src),
        len(source),
        source.origin,
        f" (data.spm_max_sentences={data.spm_max_sentences})" if len(src) < len(source) else "",
    )
    for s, t in list(zip(src, tgt))[:2]:
        logger.info("example pair  %s: %s  ->  %s: %s", data.src_lang, s, data.tgt_lang, t)
    return src, tgt


def load_validation(config: Config, tokenizer: Tokenizer) -> ValidationSet:
    """The validation split of every corpus, encoded (all pairs, none dropped), one corpus after the other, each
    source after the corpus's marks (`Tokenizer.source_prefix`).

    Raises:
        DataError: missing, misaligned or empty files.
    """
    data = config.data
    src: list[list[int]] = []
    tgt: list[list[int]] = []
    references: list[str] = []
    corpora = []
    for corpus in [
        c for c in data.corpora if c.held_out
    ]:  # synthetic corpora have training pairs only
        split = load_split(corpus.section(data), data.valid_split)
        logger.info("valid: %d pairs from %s", len(split), split.origin)
        prefix = tokenizer.source_prefix(corpus)
        corpora.append((corpus, len(references), len(references) + len(split)))
        src += [prefix + ids for ids in tokenizer.encode_src(split.src)]
        tgt += tokenizer.encode_tgt(split.tgt)
        references += split.tgt
    return ValidationSet(EncodedPairs.from_lists(src, tgt), references, corpora)


def prepare_data(
    config: Config,
    run_dir: Path,
    dist: Optional[Distributed] = None,
    tokenizer: Optional[Tokenizer] = None,
) -> tuple[Tokenizer, list[EncodedPairs], Optional[ValidationSet]]:
    """Tokenizer (`tokenizer` if given: fine-tuning), training pairs (a memory-mapped token cache per corpus, in the
    order of data.corpora) and validation set of a run.

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
    for corpus in config.data.corpora:
        train = get_token_cache(
            corpus.section(config.data),
            config.data.train_split,
            tokenizer,
            build=dist.local_rank == 0,
        )
        logger.info(
            "train %s: %d pairs (%d source + %d target tokens, eos included on both sides)",
            corpus.name,
            len(train),
            int(train.src_lengths.sum()),
            int(train.tgt_lengths.sum()),
        )
        if dist.is_main:
            report_unknown_characters(config.data, train)
        caches.append(train)
    return tokenizer, caches, valid


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
    message = (
        f"{found['pairs']} of {len(train)} training pairs hold characters the vocabulary maps to unk, so the "
        f"model learns to write or drop unk for them: {shown}{f' and {more} more' if more > 0 else ''} "
        "(pairs per character)"
    )
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
    """The epochs of a run: each corpus's pairs of the epoch (`CacheEpochs` or `SampledEpochs`) mixed by temperature
    sampling (`data/mixing.py`), fixed by training.seed and the epoch; a run of one corpus has nothing to mix, and
    its epoch is that corpus's pairs as they are (the batches shuffle them)."""

    def __init__(
        self, corpora: list[Union[CacheEpochs, SampledEpochs]], data: DataConfig, seed: int
    ) -> None:
        self.corpora, self.temperature, self.seed = corpora, data.direction_temperature, seed
        self.sizes = [len(c) for c in corpora]
        self.weights = [c.weight for c in data.corpora]
        shares = direction_shares(self.sizes, self.temperature, self.weights)
        if len(corpora) > 1:
            logger.info(
                "corpora mixed with temperature %g: pairs per epoch %s",
                self.temperature,
                ", ".join(
                    f"{c.name} {int(n)} of {size}"
                    for c, n, size in zip(data.corpora, shares, self.sizes)
                ),
            )

    def __len__(self) -> int:
        return epoch_size(self.sizes, self.weights)

    def epoch(self, epoch: int) -> MixedPairs:
        parts = [c.epoch(epoch) for c in self.corpora]
        return mix_directions(parts, self.sizes, self.temperature, self.seed, epoch, self.weights)

    def prefetch(self, epoch: int) -> None:
        for corpus in self.corpora:
            corpus.prefetch(epoch)

    def close(self) -> None:
        for corpus in self.corpora:
            corpus.close()


def training_epochs(
    config: Config,
    run_dir: Path,
    tokenizer: Tokenizer,
    caches: list[EncodedPairs],
    dist: Optional[Distributed] = None,
) -> MixedEpochs:
    """The training pairs of each epoch (`.epoch(e)`): per corpus (`caches`: its token cache), the token cache, or
    with data.subword_sampling a fresh sample for every epoch after the first (`data/subword_sampling.py`; local rank
    0 of each machine builds them; none for a corpus of weight 0); the corpora mixed (`MixedEpochs`)."""
    data = config.data
    return MixedEpochs(
        [
            _epochs(config, run_dir, tokenizer, cache, dist, corpus.section(data), corpus.files)
            if corpus.trained
            else CacheEpochs(cache)  # a student's references: nothing to sample
            for corpus, cache in zip(data.corpora, caches)
        ],
        data,
        config.training.seed,
    )


def _epochs(
    config: Config,
    run_dir: Path,
    tokenizer: Tokenizer,
    cache: EncodedPairs,
    dist: Optional[Distributed],
    data: DataConfig,
    name: str,
) -> Union[CacheEpochs, SampledEpochs]:
    if not data.subword_sampling:
        return CacheEpochs(cache)
    dist = dist or Distributed()
    kind = (
        "BPE-dropout"
        if data.spm_model_type == "bpe"
        else f"unigram {data.subword_nbest_size}-best sampling"
    )
    logger.info(
        "subword sampling (data.subword_sampling): %s, alpha %g; every epoch after the first is encoded "
        "afresh in %s",
        kind,
        data.subword_alpha,
        run_dir / SAMPLES_FOLDER / name,
    )
    return SampledEpochs(
        cache, data, tokenizer, config.training.seed, run_dir, build=dist.local_rank == 0, name=name
    )


def epoch_batches(
    pairs: Union[EncodedPairs, MixedPairs], config: Config, epoch: int
) -> list[np.ndarray]:
    """The batches (arrays of pair indices) of one epoch, fixed by training.seed and the epoch number."""
    return token_batches(
        pairs.src_lengths,
        pairs.tgt_lengths,
        config.data.max_tokens_per_batch,
        config.training.seed,
        epoch,
        config.data.pool_factor,
    )
