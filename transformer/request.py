"""A translation call resolved once, where it enters (the CLI, the server, the Python API): STYLE.md §13.

    options = resolve_options(config, tokenizer, tgt_lang="en", beam_size=4)   # the target language, decided once
    request = make_request(tokenizer, config, ["Ein Hund rennt."], options)    # texts, source ids, prefixes
    translation = translator.run(request)                                      # translate.py: a `Translation`

`resolve_options` checks the decoding options and decides the target language and its token (`ResolvedOptions`);
`make_request` takes a written `>>fra<<` out of the sentences, tokenizes them and their target prefixes
(`TranslationRequest`). Translation, alignment and attention take the request as it is: nothing below resolves the
language again. The server resolves each HTTP request before batching it, and the batch is the requests joined
(`TranslationRequest.join`), not computed again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from .config import Config, DecodingConfig, OptionError
from .config.languages import (
    TargetLanguage,
    resolve_target,
    target_languages,
    without_written_token,
    written_language,
)
from .decoding.options import decoding_options
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class ResolvedOptions:
    """The options of one call, checked against the model: equal options can share one decoding call."""

    decoding: DecodingConfig
    """The config's decoding section with the call's overrides, validated; its tgt_lang is the model's own code."""
    target: TargetLanguage
    """The language translated into, and its token if the model takes one."""
    source_prefix: tuple[int, ...]
    """The ids put before every source: the target language's token (Johnson et al. 2017, §3); none for a model
    without tokens. Alignments skip them; attention pictures show them, as the model reads them."""


def resolve_options(
    config: Config, tokenizer: Tokenizer, sentences: Optional[list[str]] = None, **overrides: Any
) -> ResolvedOptions:
    """`config.decoding` with the given (non-None) overrides, validated (`decoding/options.py: decoding_options`),
    and the target language they name (`config/languages.py: resolve_target`).

    Args:
        sentences: the sentences of the call, when known: without a tgt_lang, a target-language token written at
            their start (`>>fra<< text`, the same on every one) names the language (`written_language`).
        overrides: fields of `DecodingConfig` (`tgt_lang` among them: None is the language written at the start
            of `sentences`, else the model's only target language).

    Raises:
        OptionError: an unknown option.
        ConfigError: an option out of range (e.g. n_best > beam_size), a sampling option without sampling, or a
            tgt_lang the model does not translate into (key decoding.tgt_lang, naming the model's languages).
        WrittenLanguageError (a ConfigError): without tgt_lang, sentences that start with tokens of different
            languages, or with a language the model does not translate into (`written_language`).
        TokenizerError: the vocabulary lacks the target language's token.
    """
    if overrides.get("tgt_lang") is None and sentences:
        overrides["tgt_lang"] = written_language(sentences, target_languages(config.data))
    options = decoding_options(config.decoding, **overrides)
    target = resolve_target(config.data, options.tgt_lang)
    prefix = tuple(tokenizer.token_id(piece) for piece in (target.token,) if piece)
    return ResolvedOptions(dataclasses.replace(options, tgt_lang=target.code), target, prefix)


@dataclass(frozen=True)
class TranslationRequest:
    """Sentences to translate with their options, resolved (`make_request`)."""

    sentences: list[str]
    """As translated: a target-language token written at the start taken out (a model with tokens)."""
    ids: list[list[int]]
    """Per sentence, the source ids of its stripped text (`Tokenizer.src_ids`): no marks, no eos, not truncated."""
    options: ResolvedOptions
    prefixes: Optional[list[Optional[str]]] = None
    """Per sentence, the text its translation must start with (None or "": none); None: no sentence has one."""
    prefix_ids: Optional[list[Optional[list[int]]]] = field(default=None, repr=False)
    """Per sentence, the target ids of its prefix (None: none); None when `prefixes` is."""

    def __len__(self) -> int:
        return len(self.sentences)

    def take(self, indices: list[int]) -> "TranslationRequest":
        """The request of the sentences at `indices` (in that order; an index may repeat)."""

        def pick(values: Optional[list]) -> Optional[list]:
            return None if values is None else [values[i] for i in indices]

        return TranslationRequest(
            pick(self.sentences),
            pick(self.ids),
            self.options,
            pick(self.prefixes),
            pick(self.prefix_ids),
        )

    @staticmethod
    def join(requests: list["TranslationRequest"]) -> "TranslationRequest":
        """One request of the sentences of `requests`, in order (their options must be equal: the server's batch).

        Raises:
            ValueError: the options differ.
        """
        options = requests[0].options
        if any(r.options != options for r in requests):
            raise ValueError("requests with different options cannot share one decoding call")
        sentences = [s for r in requests for s in r.sentences]
        ids = [i for r in requests for i in r.ids]
        if all(
            r.prefixes is None for r in requests
        ):  # no sentence has one: the search needs no forced-token rule
            return TranslationRequest(sentences, ids, options)
        prefixes = [p for r in requests for p in (r.prefixes or [None] * len(r))]
        prefix_ids = [p for r in requests for p in (r.prefix_ids or [None] * len(r))]
        return TranslationRequest(sentences, ids, options, prefixes, prefix_ids)


def make_request(
    tokenizer: Tokenizer,
    config: Config,
    sentences: list[str],
    options: ResolvedOptions,
    prefixes: Optional[list[Optional[str]]] = None,
) -> TranslationRequest:
    """The request of `sentences` translated with `options` (`resolve_options`).

    Args:
        sentences: the sentences; a target-language token written at the start of one (`>>fra<< text`, as
            OPUS-MT's multi-target models are given their language) is taken out here when it names the language
            translated into, on every model (a model with language tokens puts its own, at id level, once).
        prefixes: per sentence, a target prefix (None or "": none), or None.

    Raises:
        OptionError: prefixes not one per sentence, or a prefix longer than the model can produce before its eos
            (max_positions - 2 tokens).
        WrittenLanguageError (`config/languages.py`, a ConfigError): a sentence starts with another language's token
            than the one translated into; its `sentence` is the index.
    """
    if prefixes is not None and len(prefixes) != len(sentences):
        raise OptionError(f"prefixes: one per sentence ({len(sentences)}), got {len(prefixes)}")
    prefix_ids = target_prefix_ids(tokenizer, config, prefixes)
    only = len(target_languages(config.data)) == 1
    sentences = without_written_token(sentences, options.target.code, only)
    ids = tokenizer.src_ids([s.strip() for s in sentences])
    return TranslationRequest(list(sentences), ids, options, prefixes, prefix_ids)


def target_prefix_ids(
    tokenizer: Tokenizer, config: Config, prefixes: Optional[list[Optional[str]]]
) -> Optional[list[Optional[list[int]]]]:
    """Per prefix, its target ids (None for None or a blank one); None for no prefixes.

    Raises:
        OptionError: a prefix of more tokens than the model can produce before its eos (max_positions - 2).
    """
    if prefixes is None:
        return None
    out = [tokenizer.encode_tgt([p])[0] if p and p.strip() else None for p in prefixes]
    limit = config.model.max_positions - 2
    for i, ids in enumerate(out):
        if ids and len(ids) > limit:
            raise OptionError(
                f"prefix {i + 1} has {len(ids)} tokens; the model's max_positions="
                f"{config.model.max_positions} leaves room for {limit}: shorten it"
            )
    return out


@dataclass
class Translation:
    """What one call (`Translator.run`) gave, with its own notes: nothing about a call is kept on the Translator."""

    n_best: list[list[tuple[str, float]]]
    """Per sentence, the (text, score) hypotheses, best first (sampling: in the order drawn)."""
    finished: list[list[bool]]
    """Per sentence, per hypothesis, whether it ended with eos (False: cut at the length cap; a beam's n-best lists
    put those after every finished one)."""
    truncated: list[int]
    """The sentences (0-based indices) longer than the engine's max_source_len: only their start was translated
    (`translate.source_within`)."""
    n_hit_max_len: int = 0
    """Sentences whose best hypothesis was cut at the length cap."""
    n_output_tokens: int = 0
    """Tokens of the best hypotheses (eos excluded)."""
    n_copied_unknown: int = 0
    """Sentences with text copied through untranslated (`passthrough.py`)."""
    empty: list[int] = field(default_factory=list)
    """The sentences (0-based) with text whose best translation is empty (the model wrote eos first)."""

    @property
    def texts(self) -> list[str]:
        """The best hypothesis of each sentence."""
        return [hyps[0][0] for hyps in self.n_best]
