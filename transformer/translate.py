"""Text in, text out, over any engine: tokenize, copy unknown text through, truncate, batch by length, decode,
pick the n best, detokenize. The Python API is `Translator`.

    from transformer import Translator
    translator = Translator.from_checkpoint("runs/multi30k_de_en/checkpoints/best.pt", device="cpu")
    translator.translate(["Ein Mann fährt Fahrrad."])            # -> ["A man is riding a bike."]

Guarantees, on every engine (`engines/`): one output per input, in input order; empty or whitespace-only inputs
give empty outputs; an input longer than the engine's `max_source_len` tokens (eos included) is truncated: its
start is translated, and `stats.truncated` lists it (with a logged warning unless `warn_truncated` is False, for
callers that tell their users themselves: the CLI names the line, the server marks the sentence); text the source
vocabulary cannot represent is copied into the output once, unchanged (`passthrough.py`; `copy_unknown`);
`scores=False` gives NaN scores.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .config import BOS_ID, EOS_ID, ConfigError, DecodingConfig, OptionError
from .config.languages import find_language, language_token, target_languages, without_written_token
from .decoding import Hypothesis
from .decoding.alignment import align_words
from .decoding.options import decoding_options, distinct_first, n_best_search, warn_length_cap
from .engines import Engine, SourceBatch, open_engine
from .passthrough import PassThrough, with_passthrough

logger = logging.getLogger(__name__)

def source_within(ids: list[int], max_source_len: int) -> tuple[list[int], bool]:
    """Source ids (without eos) as an engine takes them: eos appended, and cut to their start when longer than
    `max_source_len` tokens (eos included). Returns the ids and whether they were cut. The one truncation rule of
    translation, alignments and attention."""
    if len(ids) + 1 > max_source_len:
        return ids[:max_source_len - 1] + [EOS_ID], True
    return ids + [EOS_ID], False


class DecodingStopped(Exception):
    """A call given `should_stop` (`Translator.translate_n_best`, `decode_ids`) stopped before its next batch of
    sentences because `should_stop()` said so; nothing of the call is returned."""


@dataclass
class TranslationStats:
    """Counts of the last call (`translate`, `translate_n_best` or `decode_ids`) only: sentences, truncated
    inputs, outputs cut at the length cap, output tokens (eos excluded), sentences with text copied through
    untranslated (`transformer/passthrough.py`)."""

    n_sentences: int = 0
    truncated: list[int] = field(default_factory=list)
    """The inputs (0-based indices in the call's order) longer than the engine's max_source_len: only their start
    was translated (`source_within`)."""
    n_hit_max_len: int = 0
    n_output_tokens: int = 0
    n_copied_unknown: int = 0
    finished: list[list[bool]] = field(default_factory=list)
    """`translate_n_best` only: per input, per hypothesis returned, whether it ended with eos (False: cut at the
    length cap; a beam's n-best lists put those after every finished one)."""

    @property
    def n_truncated(self) -> int:
        return len(self.truncated)


class Translator:
    """The text-to-text pipeline over one engine (see the module docstring).

    Args:
        engine: what decodes (`engines.Engine`): `engines.open_engine` opens one from a path.

    Attributes:
        engine: the engine.
        config: the engine's config (decoding defaults: `config.decoding`).
        tokenizer: the engine's tokenizer.
        stats: counts of the last call.
        warn_truncated: log a warning for each truncated input (True); callers that report `stats.truncated` to
            their users in their own terms set it to False.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.warn_truncated = True
        self.config, self.tokenizer = engine.config, engine.tokenizer
        self._passthrough = PassThrough(engine.tokenizer)
        self.stats = TranslationStats()

    @classmethod
    def from_checkpoint(cls, path: str | Path | list[str | Path], device: str = "cpu",
                        quantization: Optional[str] = None, workers: int = 1, compile: bool = False) -> "Translator":
        """A Translator over `engines.open_engine(path, ...)`: a .pt checkpoint (whatever device trained it), a
        MarianMT folder, a CTranslate2 folder, or several paths (an ensemble).

        Raises:
            CheckpointError: a path is missing, corrupt, unsafe, or a folder that is not a model.
            DeviceError: the device is not available.
            OptionError: as `open_engine` (quantization, workers, compile; an ensemble's members differ).
        """
        return cls(open_engine(path, device=device, quantization=quantization, workers=workers, compile=compile))

    def warm_up(self) -> float:
        """The engine's `warm_up` (with compile: compile before the first request). Returns the seconds it took."""
        return self.engine.warm_up()

    def decoding_options(self, **overrides: Optional[float]) -> DecodingConfig:
        """The config's decoding section with the given (non-None) overrides, validated
        (`decoding/options.py: decoding_options`).

        Raises:
            ConfigError: an option out of range (e.g. n_best > beam_size), a sampling option without sampling, or a
                tgt_lang the model cannot translate into (`source_prefix`).
        """
        options = decoding_options(self.config.decoding, **overrides)
        tgt_lang = self._target_language(options.tgt_lang)  # one the model lacks (or none for several) is refused
        return options if options.tgt_lang is None else dataclasses.replace(options, tgt_lang=tgt_lang)

    @property
    def languages(self) -> list[str]:
        """The languages the model translates into: a multilingual model's (data.directions), else data.tgt_lang."""
        return target_languages(self.config.data)

    def source_prefix(self, tgt_lang: Optional[str]) -> list[int]:
        """The ids put before every source to translate into `tgt_lang`: a multilingual model's token of it
        (`config/languages.py`, Johnson et al. 2017); nothing for a bilingual model.

        Raises:
            ConfigError (key decoding.tgt_lang): a multilingual model without tgt_lang (unless it translates into
                one language only: then that one) or with one it lacks, or a bilingual model with another language
                than its data.tgt_lang; the message lists the model's languages.
        """
        tgt_lang = self._target_language(tgt_lang)
        return [self.tokenizer.token_id(language_token(tgt_lang))] if self.config.data.directions else []

    def _target_language(self, tgt_lang: Optional[str]) -> Optional[str]:
        """tgt_lang checked against the model's languages (None: a one-language multilingual model's), as
        `source_prefix` describes."""
        data, detail = self.config.data, None
        tgt_lang = find_language(tgt_lang, self.languages) or tgt_lang if tgt_lang is not None else None  # fra: fr
        if not data.directions:
            if tgt_lang is not None and tgt_lang != data.tgt_lang:
                detail = (f"this model translates {data.src_lang}->{data.tgt_lang} only; tgt_lang {tgt_lang!r} is "
                          f"not its language (give {data.tgt_lang} or leave it out)")
        elif tgt_lang is None and len(self.languages) == 1:  # one direction (a fine-tuned multilingual model)
            tgt_lang = self.languages[0]
        elif tgt_lang is None:
            detail = (f"this model translates into {len(self.languages)} languages: give the one to translate into, "
                      f"one of {', '.join(self.languages)}")
        elif tgt_lang not in self.languages:
            detail = f"this model translates into {', '.join(self.languages)}, not {tgt_lang!r}"
        if detail is not None:
            raise ConfigError(f"decoding.tgt_lang: {detail}", key="decoding.tgt_lang", detail=detail)
        return tgt_lang

    def without_language_token(self, sentences: list[str], tgt_lang: Optional[str]) -> list[str]:
        """A multilingual model's sentences without a target-language token written at their start (`>>fra<<
        text`, as OPUS-MT's multi-target models are given their language): the token of `tgt_lang` is removed (the
        translation puts it at id level, once); a bilingual model's sentences are returned as they are.

        Raises:
            WrittenLanguageError (`config/languages.py`, a ConfigError): a sentence starts with the token of
                another language than tgt_lang.
            ConfigError (key decoding.tgt_lang): tgt_lang is missing or one the model lacks (`source_prefix`).
        """
        if not self.config.data.directions:
            return sentences
        return without_written_token(sentences, self._target_language(tgt_lang))

    def translate(self, sentences: list[str], prefixes: Optional[list[Optional[str]]] = None,
                  **options: Any) -> list[str]:
        """Translate sentences; unset options take the config's `decoding` defaults.

        Args:
            prefixes: per sentence, the text its translation must start with (None or "": free); see
                `translate_n_best`.
            options: any of `DecodingConfig`'s fields but n_best (`decoding/options.py`).

        Returns:
            One detokenized string per input, in input order (with sampling: the first sample).
        """
        return [hyps[0][0] for hyps in self.translate_n_best(sentences, n_best=1, scores=False, prefixes=prefixes,
                                                             **options)]

    def translate_n_best(self, sentences: list[str], n_best: Optional[int] = None, scores: bool = True,
                         prefixes: Optional[list[Optional[str]]] = None,
                         should_stop: Optional[Callable[[], bool]] = None,
                         **options: Any) -> list[list[tuple[str, float]]]:
        """Translate sentences and return the n best (text, score) pairs of each, best first; with sampling, n_best
        independent samples in the order drawn, each scored by the model's log-probability of its tokens.

        Beam search's n-best texts are distinct where its beam found that many distinct texts (`distinct_first`:
        two piece sequences can spell the same text, e.g. `▁truck` and `▁tr u ck` after BPE-dropout training):
        distinct texts come first, best first, then any repeats; samples are independent draws and may repeat.

        With scores=False every score is NaN (and greedy decoding skips its per-step log-softmax), on every engine.

        Args:
            prefixes: per sentence, a target prefix (None or "": none): its pieces are produced first, with the
                model's scores (part of each hypothesis' score), then decoding goes on freely; the text returned
                starts with it.
            should_stop: asked before each group of `engine.workers` batches of sentences (from the thread that
                decodes); True stops the call there with `DecodingStopped` (a server's request whose client left).
                Not an option of `DecodingConfig`: the outputs do not depend on it. None (the default): the engine
                gets all batches in one call.
            options: as `translate`.

        Raises:
            DecodingStopped: `should_stop()` returned True.
            ConfigError: an option is out of range (e.g. n_best > beam_size), or a sampling option is given
                without sampling.
            OptionError: an unknown option, or prefixes not one per sentence.
        """
        options = self.decoding_options(n_best=n_best, **options)
        if prefixes is not None and len(prefixes) != len(sentences):
            raise OptionError(f"prefixes: one per sentence ({len(sentences)}), got {len(prefixes)}")
        forced = self.prefix_ids(prefixes)
        sentences = self.without_language_token(sentences, options.tgt_lang)
        searched, distinct = n_best_search(options)
        language = self.source_prefix(options.tgt_lang)  # a multilingual model's target-language token

        def translate(texts: list[str], ids: list[list[int]]) -> list[list[tuple[str, float]]]:
            src_ids, truncated = self._with_eos(texts, [language + sentence for sentence in ids])
            hypotheses = self.decode_ids(src_ids, searched, scores=scores, prefix_ids=forced,
                                         should_stop=should_stop)
            self.stats.truncated = truncated
            outputs = [[(self._detokenize(h.tokens, prefixes[i] if forced and forced[i] else None,
                                          forced[i] if forced else None), h) for h in hyps]
                       for i, hyps in enumerate(hypotheses)]
            if distinct:
                outputs = [[out[i] for i in distinct_first([t for t, _ in out], options.n_best,
                                                           [h.finished for _, h in out])] for out in outputs]
            self.stats.finished = [[h.finished for _, h in out] for out in outputs]
            return [[(text, h.score) for text, h in out] for out in outputs]

        align = (functools.partial(self.align, tgt_lang=options.tgt_lang)
                 if self.engine.attention_model is not None else None)  # else: relative positions
        results, n_copied = with_passthrough(self._passthrough, sentences, prefixes, translate, options.copy_unknown,
                                             align)
        self.stats.n_copied_unknown = n_copied
        return results

    @torch.no_grad()
    def align(self, sentences: list[str], translations: list[str], layer: int = -1,
              head: Optional[int] = None, tgt_lang: Optional[str] = None) -> list[list[tuple[int, int]]]:
        """Word alignments of each (sentence, translation) pair from the encoder-decoder attention of the readable
        model (`decoding/alignment.py`): the translation is tokenized and fed teacher-forced, so any target text can
        be aligned, not only our own output.

        Args:
            layer: the decoder layer (default: the last).
            head: one head, or None for the mean of the layer's heads.
            tgt_lang: the language translated into (a multilingual model's sources start with its token, as when
                translating; the token is never aligned to, and word indices count the sentence's words only).

        Returns:
            Per pair, sorted (source word, target word) index pairs over whitespace words (0-based).

        Raises:
            OptionError: an engine without attention to read (CTranslate2), a layer or head the model does not have,
                or lists of different lengths.
            ConfigError: tgt_lang missing for a multilingual model, or one it lacks (`source_prefix`).
        """
        language = self.source_prefix(tgt_lang)
        sentences = self.without_language_token(sentences, tgt_lang)
        model = self.engine.attention_model
        if model is None:
            raise OptionError(f"{{alignment}} reads our model's attention; a {self.engine.name} engine has none to "
                              "read", alignment=True)
        n_layers, n_heads = model.config.n_decoder_layers, model.config.n_heads
        if not -n_layers <= layer < n_layers or (head is not None and not 0 <= head < n_heads):
            raise OptionError(f"alignment layer {layer} / head {head}: the model has {n_layers} decoder layers and "
                              f"{n_heads} heads")
        if len(sentences) != len(translations):
            raise OptionError(f"{len(sentences)} sentences but {len(translations)} translations to align")
        limit, device = model.config.max_positions, next(model.parameters()).device
        out = []
        for sentence, translation in zip(sentences, translations):
            src_ids = source_within(language + self.tokenizer.src_ids([sentence.strip()])[0], limit)[0]  # as translated
            tgt_ids = self.tokenizer.encode_tgt([translation.strip()])[0][: limit - 1]
            if len(src_ids) < len(language) + 2 or not tgt_ids:
                out.append([])
                continue
            src = torch.tensor([src_ids], device=device)
            tgt_in = torch.tensor([[BOS_ID] + tgt_ids], device=device)
            _, weights = model.forward_with_attention(src, tgt_in)
            cross = weights.cross[layer][0][..., len(language):]  # (n_heads, tgt_len + 1, src_len), token off
            cross = cross.mean(0) if head is None else cross[head]
            src_pieces = [self.tokenizer.id_to_piece(i, "src") for i in src_ids[len(language):-1]]
            # row k is the position that produces target piece k (its input: bos, then the pieces before it)
            out.append(align_words(cross.cpu(), src_pieces, self.tokenizer.tgt_pieces(tgt_ids)))
        return out

    def prefix_ids(self, prefixes: Optional[list[Optional[str]]]) -> Optional[list[Optional[list[int]]]]:
        """Per prefix, its target ids (None for None or a blank one); None for no prefixes.

        Raises:
            OptionError: a prefix of more tokens than the model can produce before its eos (max_positions - 2).
        """
        if prefixes is None:
            return None
        out = [self.tokenizer.encode_tgt([p])[0] if p and p.strip() else None for p in prefixes]
        limit = self.config.model.max_positions - 2
        for i, ids in enumerate(out):
            if ids and len(ids) > limit:
                raise OptionError(f"prefix {i + 1} has {len(ids)} tokens; the model's max_positions="
                                  f"{self.config.model.max_positions} leaves room for {limit}: shorten it")
        return out

    def _detokenize(self, tokens: list[int], prefix: Optional[str], prefix_ids: Optional[list[int]]) -> str:
        """The text of an output's tokens; one forced to start with `prefix` (of ids `prefix_ids`) starts with the
        prefix exactly as given, also where the vocabulary could not spell it (characters it lacks, other
        normalizations), and goes on with the text decoded after it."""
        text = self.tokenizer.decode_tgt(tokens)
        if prefix is None or not prefix_ids:
            return text
        spelled, given = self.tokenizer.decode_tgt(prefix_ids), prefix.strip()
        if spelled == given or tokens[:len(prefix_ids)] != prefix_ids or not text.startswith(spelled):
            return text
        if spelled:
            return given + text[len(spelled):]
        rest = tokens[len(prefix_ids):]  # nothing of the prefix spelled: the space before the rest is its first piece's
        space = " " if text and rest and self.tokenizer.id_to_piece(rest[0]).startswith("\u2581") else ""
        return given + space + text

    def _with_eos(self, texts: list[str], ids: list[list[int]]) -> tuple[list[Optional[list[int]]], list[int]]:
        """Per stripped sentence and its source ids (`Tokenizer.src_ids`), the ids as the engine takes them
        (`source_within`; None for an empty sentence), and the indices of those truncated."""
        truncated: list[int] = []
        limit = self.engine.max_source_len
        out: list[Optional[list[int]]] = []
        for i, (text, sentence_ids) in enumerate(zip(texts, ids)):
            if not text:
                out.append(None)
                continue
            within, cut = source_within(sentence_ids, limit)
            if cut:
                truncated.append(i)
                if self.warn_truncated:
                    logger.warning("input %d has %d tokens, more than the model's max_positions=%d: truncated to "
                                   "its first %d", i + 1, len(sentence_ids) + 1, limit, limit - 1)
            out.append(within)
        return out, truncated

    def decode_ids(self, src_ids: list[Optional[list[int]]], options: DecodingConfig, scores: bool = True,
                   prefix_ids: Optional[list[Optional[list[int]]]] = None,
                   should_stop: Optional[Callable[[], bool]] = None) -> list[list[Hypothesis]]:
        """Decode source id sequences with the engine, in batches of similar length (longest first); a None input
        gives `options.n_best` empty hypotheses (score 0).

        Args:
            src_ids: per sentence, source ids ending in eos (at most the engine's max_source_len), or None for an
                empty input.
            options: decoding settings (see `decoding_options`).
            scores: False: every `Hypothesis.score` is NaN (greedy decoding then skips its per-step log-softmax).
            prefix_ids: per sentence, forced target tokens (or None).
            should_stop: see `translate_n_best`; None: all batches go to the engine in one `search` call.

        Returns:
            Per input, `options.n_best` hypotheses, best first.

        Raises:
            DecodingStopped: `should_stop()` returned True before a group of batches.
        """
        self.stats = TranslationStats(n_sentences=len(src_ids))
        results: list[list[Hypothesis]] = [[Hypothesis([], 0.0, True)] * options.n_best for _ in src_ids]
        order = sorted((i for i, ids in enumerate(src_ids) if ids is not None), key=lambda i: -len(src_ids[i]))
        chunks = _sentence_batches(order, [len(ids) if ids else 0 for ids in src_ids], options)
        batches = [SourceBatch([src_ids[i] for i in chunk],
                               None if prefix_ids is None else [prefix_ids[i] for i in chunk]) for chunk in chunks]
        for chunk, decoded in zip(chunks, self._search(batches, options, scores, should_stop)):
            for i, hyps in zip(chunk, decoded):
                results[i] = hyps
        for hyps in results:
            self.stats.n_hit_max_len += not hyps[0].finished
            self.stats.n_output_tokens += len(hyps[0].tokens)
        warn_length_cap(self.stats.n_hit_max_len, len(results), options)
        return results

    def _search(self, batches: list[SourceBatch], options: DecodingConfig, scores: bool,
                should_stop: Optional[Callable[[], bool]]) -> list[list[list[Hypothesis]]]:
        """`engine.search` of the batches: in one call, or, with `should_stop`, one call per group of
        `engine.workers` batches, each after asking `should_stop()` (DecodingStopped when True)."""
        if should_stop is None:
            return self.engine.search(batches, options, scores)
        decoded: list[list[list[Hypothesis]]] = []
        step = max(1, self.engine.workers)
        for start in range(0, len(batches), step):
            if should_stop():
                raise DecodingStopped(f"stopped before batch {start + 1} of {len(batches)}")
            decoded += self.engine.search(batches[start:start + step], options, scores)
        return decoded


def _sentence_batches(order: list[int], lengths: list[int], options: DecodingConfig) -> list[list[int]]:
    """Cut `order` (sorted longest first) into batches of at most batch_size sentences and, if
    max_tokens_per_batch is set, at most that many padded source tokens."""
    batches: list[list[int]] = [[]]
    for i in order:
        batch = batches[-1]
        too_many_tokens = (options.max_tokens_per_batch and batch
                           and (len(batch) + 1) * lengths[batch[0]] > options.max_tokens_per_batch)
        if len(batch) == options.batch_size or too_many_tokens:
            batches.append([])
        batches[-1].append(i)
    return [b for b in batches if b]
