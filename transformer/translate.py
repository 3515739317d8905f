"""Text in, text out, over any engine: tokenize, copy unknown text through, truncate, batch by length, decode,
pick the n best, detokenize. The Python API is `Translator`.

    from transformer import Translator
    translator = Translator.from_checkpoint("runs/multi30k_de_en/checkpoints/best.pt", device="cpu")
    translator.translate(["Ein Mann fährt Fahrrad."])            # -> ["A man is riding a bike."]

Guarantees, on every engine (`engines/`): one output per input, in input order; empty or whitespace-only inputs
give empty outputs; an input longer than the engine's `max_source_len` tokens (eos included) is truncated: its
start is translated, and the call's `Translation.truncated` lists it (`translate` and `translate_n_best` also log a
warning; the CLI names the line, the server marks the sentence); text the source
vocabulary cannot represent is copied into the output once, unchanged (`passthrough.py`; `copy_unknown`);
`scores=False` gives NaN scores.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from .config import BOS_ID, EOS_ID, DecodingConfig, OptionError
from .config.languages import target_languages
from .decoding import Hypothesis
from .decoding.alignment import align_words
from .decoding.options import distinct_first, n_best_search, warn_length_cap
from .engines import Engine, SourceBatch, open_engine
from .passthrough import PassThrough, with_passthrough
from .request import (
    ResolvedOptions,
    Sentences,
    Translation,
    TranslationRequest,
    check_options,
    make_request,
    read_sentences,
    resolve_options,
)

logger = logging.getLogger(__name__)


def source_within(ids: list[int], max_source_len: int) -> tuple[list[int], bool]:
    """Source ids (without eos) as an engine takes them: eos appended, and cut to their start when longer than
    `max_source_len` tokens (eos included). Returns the ids and whether they were cut. The one truncation rule of
    translation, alignments and attention."""
    if len(ids) + 1 > max_source_len:
        return ids[: max_source_len - 1] + [EOS_ID], True
    return ids + [EOS_ID], False


class DecodingStopped(Exception):
    """A call given `should_stop` (`Translator.run`, `decode_ids`) stopped before its next batch of sentences because
    `should_stop()` said so; nothing of the call is returned."""


class Translator:
    """The text-to-text pipeline over one engine (see the module docstring).

    A call is resolved once where it enters (`resolve_options`, then `request`: `request.py`) and run (`run`), which
    returns a `Translation` with the call's notes; `translate` and `translate_n_best` do the three in one.

    Args:
        engine: what decodes (`engines.Engine`): `engines.open_engine` opens one from a path.

    Attributes:
        engine: the engine.
        config: the engine's config (decoding defaults: `config.decoding`).
        tokenizer: the engine's tokenizer.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config, self.tokenizer = engine.config, engine.tokenizer
        self._passthrough = PassThrough(engine.tokenizer)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path | list[str | Path],
        device: str = "cpu",
        quantization: Optional[str] = None,
        workers: int = 1,
        compile: bool = False,
    ) -> "Translator":
        """A Translator over `engines.open_engine(path, ...)`: a .pt checkpoint (whatever device trained it), a
        MarianMT folder, a CTranslate2 folder, or several paths (an ensemble).

        Raises:
            CheckpointError: a path is missing, corrupt, unsafe, or a folder that is not a model.
            DeviceError: the device is not available.
            OptionError: as `open_engine` (quantization, workers, compile; an ensemble's members differ).
        """
        return cls(
            open_engine(
                path, device=device, quantization=quantization, workers=workers, compile=compile
            )
        )

    def warm_up(self) -> float:
        """The engine's `warm_up` (with compile: compile before the first request). Returns the seconds it took."""
        return self.engine.warm_up()

    @property
    def languages(self) -> list[str]:
        """The languages the model translates into, in the order of its corpora (bilingual: [data.tgt_lang])."""
        return target_languages(self.config.data)

    def resolve_options(
        self, sentences: Optional[Sentences] = None, **overrides: Any
    ) -> ResolvedOptions:
        """The options of a call, the target language decided (`request.resolve_options`).

        Args:
            sentences: the call's sentences (str, or read once: `request.read_sentences`), when known: without
                tgt_lang, a language token written at their start names the language.
            overrides: fields of `DecodingConfig` (None: the config's value).

        Raises:
            OptionError: an unknown option.
            ConfigError: an option out of range (e.g. n_best > beam_size), a sampling option without sampling, or a
                tgt_lang the model cannot translate into (key decoding.tgt_lang, naming the model's languages).
        """
        return resolve_options(self.config, self.tokenizer, sentences, **overrides)

    def check_options(self, **overrides: Any) -> DecodingConfig:
        """The options that do not depend on the sentences, checked before any is read (`request.check_options`).

        Raises:
            OptionError, ConfigError: as `resolve_options`, except what a written token decides.
        """
        return check_options(self.config, **overrides)

    def decoding_options(self, **overrides: Any) -> DecodingConfig:
        """The decoding section of `resolve_options(**overrides)`."""
        return self.resolve_options(**overrides).decoding

    def request(
        self,
        sentences: Sentences,
        options: ResolvedOptions,
        prefixes: Optional[list[Optional[str]]] = None,
    ) -> TranslationRequest:
        """The request of `sentences` (`request.make_request`): a written target-language token taken out, the
        texts tokenized, the prefixes checked.

        Raises:
            OptionError: prefixes not one per sentence, or one too long for the model.
            WrittenLanguageError (a ConfigError): a sentence starts with another language's token than tgt_lang.
        """
        return make_request(self.tokenizer, self.config, sentences, options, prefixes)

    def translate(
        self, sentences: list[str], prefixes: Optional[list[Optional[str]]] = None, **options: Any
    ) -> list[str]:
        """Translate sentences; unset options take the config's `decoding` defaults.

        Args:
            prefixes: per sentence, the text its translation must start with (None or "": free); see
                `translate_n_best`.
            options: any of `DecodingConfig`'s fields but n_best (`decoding/options.py`).

        Returns:
            One detokenized string per input, in input order (with sampling: the first sample).
        """
        return [
            hyps[0][0]
            for hyps in self.translate_n_best(
                sentences, n_best=1, scores=False, prefixes=prefixes, **options
            )
        ]

    def translate_n_best(
        self,
        sentences: list[str],
        n_best: Optional[int] = None,
        scores: bool = True,
        prefixes: Optional[list[Optional[str]]] = None,
        should_stop: Optional[Callable[[], bool]] = None,
        **options: Any,
    ) -> list[list[tuple[str, float]]]:
        """Translate sentences and return the n best (text, score) pairs of each, best first: `resolve_options`,
        `request` and `run` in one call; an input longer than the engine reads is truncated with a logged warning.

        Args:
            prefixes: per sentence, a target prefix (None or "": none): its pieces are produced first, with the
                model's scores (part of each hypothesis' score), then decoding goes on freely; the text returned
                starts with it.
            should_stop: see `run`.
            options: as `translate`.

        Raises:
            DecodingStopped: `should_stop()` returned True.
            OptionError: an unknown option, or prefixes not one per sentence (or one too long).
            ConfigError: an option out of range (e.g. n_best > beam_size), a sampling option without sampling, a
                tgt_lang the model cannot translate into; a WrittenLanguageError for a sentence that starts with
                another language's token.
        """
        read = read_sentences(sentences)  # each written `>>fra<<` read once, for both calls
        request = self.request(read, self.resolve_options(read, n_best=n_best, **options), prefixes)
        result = self.run(request, scores=scores, should_stop=should_stop, warn_truncated=True)
        if result.empty:
            logger.warning(
                "%d of %d inputs have an empty translation (inputs %s)",
                len(result.empty),
                len(sentences),
                ", ".join(str(i + 1) for i in result.empty[:10]),
            )
        return result.n_best

    def run(
        self,
        request: TranslationRequest,
        scores: bool = True,
        should_stop: Optional[Callable[[], bool]] = None,
        warn_truncated: bool = False,
    ) -> Translation:
        """Translate a resolved request: the n best (text, score) pairs of each sentence, best first; with sampling,
        n_best independent samples in the order drawn, each scored by the model's log-probability of its tokens.

        Beam search's n-best texts are distinct where its beam found that many distinct texts (`distinct_first`:
        two piece sequences can spell the same text, e.g. `▁truck` and `▁tr u ck` after BPE-dropout training):
        distinct texts come first, best first, then any repeats; samples are independent draws and may repeat.

        Args:
            scores: False: every score is NaN (and greedy decoding skips its per-step log-softmax), on every engine.
            should_stop: asked before each group of `engine.workers` batches of sentences (from the thread that
                decodes); True stops the call there with `DecodingStopped` (a server's request whose client left).
                None (the default): the engine gets all batches in one call.
            warn_truncated: log a warning for each truncated input (callers that tell their users in their own
                terms read `Translation.truncated` instead).

        Returns:
            The `Translation`: hypotheses, finished flags, truncated inputs and counts of this call.

        Raises:
            DecodingStopped: `should_stop()` returned True.
        """
        options, forced, prefixes = request.options, request.prefix_ids, request.prefixes
        searched, distinct = n_best_search(options.decoding)
        notes = Translation([], [], [])

        def translate(texts: list[str], ids: list[list[int]]) -> list[list[tuple[str, float]]]:
            src_ids, notes.truncated = self._with_eos(
                texts, [list(options.source_prefix) + i for i in ids], warn_truncated
            )
            hypotheses = self.decode_ids(
                src_ids, searched, scores=scores, prefix_ids=forced, should_stop=should_stop
            )
            notes.n_hit_max_len = sum(not hyps[0].finished for hyps in hypotheses)
            notes.n_output_tokens = sum(len(hyps[0].tokens) for hyps in hypotheses)
            outputs = [
                [
                    (
                        self._detokenize(
                            h.tokens,
                            prefixes[i] if forced and forced[i] else None,
                            forced[i] if forced else None,
                        ),
                        h,
                    )
                    for h in hyps
                ]
                for i, hyps in enumerate(hypotheses)
            ]
            if distinct:
                outputs = [
                    [
                        out[i]
                        for i in distinct_first(
                            [t for t, _ in out],
                            options.decoding.n_best,
                            [h.finished for _, h in out],
                        )
                    ]
                    for out in outputs
                ]
            notes.finished = [[h.finished for _, h in out] for out in outputs]
            return [[(text, h.score) for text, h in out] for out in outputs]

        align = (
            functools.partial(self._align_ids, source_prefix=options.source_prefix)
            if self.engine.attention_model is not None
            else None
        )  # else: relative positions
        notes.n_best, notes.n_copied_unknown = with_passthrough(
            self._passthrough,
            [s.strip() for s in request.sentences],
            request.ids,
            prefixes,
            translate,
            options.decoding.copy_unknown,
            align,
        )
        notes.empty = [
            i
            for i, (sentence, hyps) in enumerate(zip(request.sentences, notes.n_best))
            if sentence.strip() and not hyps[0][0].strip()
        ]
        return notes

    def align(
        self,
        request: TranslationRequest,
        translations: list[str],
        layer: int = -1,
        head: Optional[int] = None,
    ) -> list[list[tuple[int, int]]]:
        """Word alignments of each sentence of `request` and its translation, from the encoder-decoder attention of
        the readable model (`decoding/alignment.py`): the translation is tokenized and fed teacher-forced, so any
        target text can be aligned, not only our own output. The source is read as translated (after the request's
        source prefix, which is never aligned to; word indices count the sentence's words only).

        Args:
            translations: one per sentence of the request (for several per sentence: `request.take`).
            layer: the decoder layer (default: the last).
            head: one head, or None for the mean of the layer's heads.

        Returns:
            Per pair, sorted (source word, target word) index pairs over whitespace words (0-based).

        Raises:
            OptionError: an engine without attention to read (CTranslate2), a layer or head the model does not have,
                or not one translation per sentence.
        """
        if len(request) != len(translations):
            raise OptionError(
                f"{len(request)} sentences but {len(translations)} translations to align"
            )
        return self._align_ids(
            request.ids, translations, layer, head, request.options.source_prefix
        )

    @torch.no_grad()
    def _align_ids(
        self,
        ids: list[list[int]],
        translations: list[str],
        layer: int = -1,
        head: Optional[int] = None,
        source_prefix: tuple[int, ...] = (),
    ) -> list[list[tuple[int, int]]]:
        """`align` of source ids (`Tokenizer.src_ids`, without the source prefix) and their translations."""
        model = self.engine.attention_model
        if model is None:
            raise OptionError(
                f"{{alignment}} reads our model's attention; a {self.engine.name} engine has none to "
                "read",
                alignment=True,
            )
        n_layers, n_heads = model.config.n_decoder_layers, model.config.n_heads
        if not -n_layers <= layer < n_layers or (head is not None and not 0 <= head < n_heads):
            raise OptionError(
                f"alignment layer {layer} / head {head}: the model has {n_layers} decoder layers and "
                f"{n_heads} heads"
            )
        limit, device, n_marks = (
            model.config.max_positions,
            next(model.parameters()).device,
            len(source_prefix),
        )
        out = []
        for sentence_ids, translation in zip(ids, translations):
            src_ids = source_within(list(source_prefix) + sentence_ids, limit)[0]  # as translated
            tgt_ids = self.tokenizer.encode_tgt([translation.strip()])[0][: limit - 1]
            if len(src_ids) < n_marks + 2 or not tgt_ids:
                out.append([])
                continue
            src = torch.tensor([src_ids], device=device)
            tgt_in = torch.tensor([[BOS_ID] + tgt_ids], device=device)
            _, weights = model.forward_with_attention(src, tgt_in)
            cross = weights.cross[layer][0][
                ..., n_marks:
            ]  # (n_heads, tgt_len + 1, src_len), the marks off
            cross = cross.mean(0) if head is None else cross[head]
            src_pieces = [self.tokenizer.id_to_piece(i, "src") for i in src_ids[n_marks:-1]]
            # row k is the position that produces target piece k (its input: bos, then the pieces before it)
            out.append(align_words(cross.cpu(), src_pieces, self.tokenizer.tgt_pieces(tgt_ids)))
        return out

    def _detokenize(
        self, tokens: list[int], prefix: Optional[str], prefix_ids: Optional[list[int]]
    ) -> str:
        """The text of an output's tokens; one forced to start with `prefix` (of ids `prefix_ids`) starts with the
        prefix exactly as given, also where the vocabulary could not spell it (characters it lacks, other
        normalizations), and goes on with the text decoded after it."""
        text = self.tokenizer.decode_tgt(tokens)
        if prefix is None or not prefix_ids:
            return text
        spelled, given = self.tokenizer.decode_tgt(prefix_ids), prefix.strip()
        if (
            spelled == given
            or tokens[: len(prefix_ids)] != prefix_ids
            or not text.startswith(spelled)
        ):
            return text
        if spelled:
            return given + text[len(spelled) :]
        rest = tokens[
            len(prefix_ids) :
        ]  # nothing of the prefix spelled: the space before the rest is its first piece's
        space = (
            " "
            if text and rest and self.tokenizer.id_to_piece(rest[0]).startswith("\u2581")
            else ""
        )
        return given + space + text

    def _with_eos(
        self, texts: list[str], ids: list[list[int]], warn: bool
    ) -> tuple[list[Optional[list[int]]], list[int]]:
        """Per stripped sentence and its source ids (the source prefix first), the ids as the engine takes them
        (`source_within`; None for an empty sentence), and the indices of those truncated (logged if `warn`)."""
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
                if warn:
                    logger.warning(
                        "input %d has %d tokens, more than the model's max_positions=%d: truncated to "
                        "its first %d",
                        i + 1,
                        len(sentence_ids) + 1,
                        limit,
                        limit - 1,
                    )
            out.append(within)
        return out, truncated

    def decode_ids(
        self,
        src_ids: list[Optional[list[int]]],
        options: DecodingConfig,
        scores: bool = True,
        prefix_ids: Optional[list[Optional[list[int]]]] = None,
        should_stop: Optional[Callable[[], bool]] = None,
    ) -> list[list[Hypothesis]]:
        """Decode source id sequences with the engine, in batches of similar length (longest first); a None input
        gives `options.n_best` empty hypotheses (score 0).

        Args:
            src_ids: per sentence, source ids ending in eos (at most the engine's max_source_len), or None for an
                empty input.
            options: decoding settings (see `decoding_options`).
            scores: False: every `Hypothesis.score` is NaN (greedy decoding then skips its per-step log-softmax).
            prefix_ids: per sentence, forced target tokens (or None).
            should_stop: see `run`; None: all batches go to the engine in one `search` call.

        Returns:
            Per input, `options.n_best` hypotheses, best first.

        Raises:
            DecodingStopped: `should_stop()` returned True before a group of batches.
        """
        results: list[list[Hypothesis]] = [
            [Hypothesis([], 0.0, True)] * options.n_best for _ in src_ids
        ]
        order = sorted(
            (i for i, ids in enumerate(src_ids) if ids is not None), key=lambda i: -len(src_ids[i])
        )
        chunks = _sentence_batches(order, [len(ids) if ids else 0 for ids in src_ids], options)
        batches = [
            SourceBatch(
                [src_ids[i] for i in chunk],
                None if prefix_ids is None else [prefix_ids[i] for i in chunk],
            )
            for chunk in chunks
        ]
        for chunk, decoded in zip(chunks, self._search(batches, options, scores, should_stop)):
            for i, hyps in zip(chunk, decoded):
                results[i] = hyps
        warn_length_cap(sum(not hyps[0].finished for hyps in results), len(results), options)
        return results

    def _search(
        self,
        batches: list[SourceBatch],
        options: DecodingConfig,
        scores: bool,
        should_stop: Optional[Callable[[], bool]],
    ) -> list[list[list[Hypothesis]]]:
        """`engine.search` of the batches: in one call, or, with `should_stop`, one call per group of
        `engine.workers` batches, each after asking `should_stop()` (DecodingStopped when True)."""
        if should_stop is None:
            return self.engine.search(batches, options, scores)
        decoded: list[list[list[Hypothesis]]] = []
        step = max(1, self.engine.workers)
        for start in range(0, len(batches), step):
            if should_stop():
                raise DecodingStopped(f"stopped before batch {start + 1} of {len(batches)}")
            decoded += self.engine.search(batches[start : start + step], options, scores)
        return decoded


def _sentence_batches(
    order: list[int], lengths: list[int], options: DecodingConfig
) -> list[list[int]]:
    """Cut `order` (sorted longest first) into batches of at most batch_size sentences and, if
    max_tokens_per_batch is set, at most that many padded source tokens."""
    batches: list[list[int]] = [[]]
    for i in order:
        batch = batches[-1]
        too_many_tokens = (
            options.max_tokens_per_batch
            and batch
            and (len(batch) + 1) * lengths[batch[0]] > options.max_tokens_per_batch
        )
        if len(batch) == options.batch_size or too_many_tokens:
            batches.append([])
        batches[-1].append(i)
    return [b for b in batches if b]
