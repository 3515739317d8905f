"""A translation call resolved once, where it enters (the CLI, the server, the Python API): STYLE.md §13.

    options = resolve_options(config, tokenizer, tgt_lang="en", beam_size=4)   # the target language, decided once
    request = make_request(tokenizer, config, ["Ein Hund rennt."], options)    # texts, source ids, prefixes
    translation = translator.run(request)                                      # translate.py: a `Translation`

`resolve_options` checks the decoding options and decides the target language and its token (`ResolvedOptions`);
`make_request` takes a written `>>fra<<` out of the sentences, tokenizes them and their target prefixes
(`TranslationRequest`). Translation, alignment and attention take the request as it is: nothing below resolves the
language again. The server resolves each HTTP request before batching it, and the batch is the requests joined
(`TranslationRequest.join`), not computed again.

The request-time language work lives here: a token written at the start of a sentence (`>>fra<< text`) is read once
per sentence (`read_sentences`: the CLI and the server read each line or text once and hand the result to both
calls), names the language when no tgt_lang is given (`written_language`) and is taken out (`without_written_token`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .config import Config, ConfigError, DecodingConfig, OptionError
from .config.languages import describe, find_language, target_languages
from .decoding.options import decoding_options
from .tokenizer import Tokenizer

# ---- a target-language token written at the start of a sentence -----------------------------------------------

_WRITTEN_TOKEN = re.compile(r"\s*(>>[A-Za-z][A-Za-z0-9_]*<<)\s*")


@dataclass(frozen=True)
class WrittenSentence:
    """A sentence as given, read once (`read_sentences`): the target-language token written at its very start, as
    OPUS-MT's multi-target models are given their language (`>>fra<< A dog runs.`), and the text after it."""

    token: Optional[str]
    """The token as written (`>>fra<<`, `>>FR<<`); None: the sentence starts with none."""
    text: str
    """The sentence without the token and the whitespace around it; the whole sentence when it has none. A token
    later in the sentence is text."""

    def names(self, languages: list[str]) -> Optional[str]:
        """The one of `languages` the token names, in any spelling `find_language` takes (fr: `>>fra<<`, `>>fr<<`,
        `>>FRA<<`); None without a token or for a token naming none of them."""
        return find_language(self.token[2:-2], languages) if self.token else None


Sentences = Union[Sequence[str], Sequence[WrittenSentence]]
"""Sentences as given (str) or as read once (`read_sentences`): every function here takes either."""


def read_sentences(sentences: Sentences) -> list[WrittenSentence]:
    """Each sentence read once into its written token and its text (`WrittenSentence`); those already read pass
    through, so that a caller reads a call's sentences once and hands the result to `resolve_options` and
    `make_request`."""
    return [s if isinstance(s, WrittenSentence) else read_written(s) for s in sentences]


def read_written(sentence: str) -> WrittenSentence:
    """One sentence's written token and text (`WrittenSentence`)."""
    written = _WRITTEN_TOKEN.match(sentence)
    if not written:
        return WrittenSentence(None, sentence)
    return WrittenSentence(written.group(1), sentence[written.end() :])


class WrittenLanguageError(ConfigError):
    """A sentence starts with the token of another language (`>>deu<<`) than the one translated into
    (`without_written_token`): `sentence` is its index in the sentences given, so that callers can name the line
    (the CLI) or the field (the server)."""

    def __init__(self, detail: str, sentence: int) -> None:
        super().__init__(f"decoding.tgt_lang: {detail}", key="decoding.tgt_lang", detail=detail)
        self.sentence = sentence


def without_written_token(sentences: Sentences, tgt_lang: str, only: bool = False) -> list[str]:
    """The sentences without a target-language token written at their start when it names `tgt_lang`, in any
    spelling `find_language` takes (`>>fra<< text`, `>>fr<< text`, `>>FRA<< text` -> `text` for fr; whitespace
    around it dropped); others unchanged. Only the very start of a sentence is read: `>>fra<<` later in it is text.

    Args:
        only: `tgt_lang` is the model's only target language (it was not chosen, so the message says so).

    Raises:
        WrittenLanguageError: a sentence starts with another language's token.
    """
    out = []
    for i, sentence in enumerate(read_sentences(sentences)):
        if sentence.token and sentence.names([tgt_lang]) is None:
            why = (
                f"the model translates into {tgt_lang} only"
                if only
                else "the language is given by tgt_lang, and a token written at the start of a sentence "
                "must name the same one"
            )
            raise WrittenLanguageError(
                f"a sentence starts with {sentence.token} but the target language is "
                f"{tgt_lang} ({(sentence.token + ' ' + sentence.text)[:40].strip()!r}): {why}",
                i,
            )
        out.append(sentence.text)
    return out


def written_language(sentences: Sentences, languages: list[str]) -> Optional[str]:
    """The one of `languages` named by the target-language tokens written at the start of `sentences` (in any
    spelling `find_language` takes), when no tgt_lang is given: the token chooses the language, as OPUS-MT's
    multi-target models are told theirs. None when no sentence starts with a token.

    Raises:
        WrittenLanguageError: a token naming none of `languages`, sentences naming different languages, or (a model
            with several target languages) some starting with a token and others not: one call translates into one
            language.
    """
    read = read_sentences(sentences)
    named: dict[str, int] = {}
    plain = None
    for i, sentence in enumerate(read):
        if not sentence.token:
            plain = i if plain is None else plain
            continue
        code = sentence.names(languages)
        if code is None:
            raise WrittenLanguageError(
                f"a sentence starts with {sentence.token} "
                f"({(sentence.token + ' ' + sentence.text)[:40].strip()!r}), a language this model "
                f"does not translate into: it translates into {', '.join(languages)}",
                i,
            )
        named.setdefault(code, i)
    if not named:
        return None
    if len(named) > 1 or (plain is not None and len(languages) > 1):
        first, second = (
            sorted(named.values())[:2] if len(named) > 1 else sorted((min(named.values()), plain))
        )
        first_token, second_token = (read[i].token or "no language token" for i in (first, second))
        detail = (
            f"sentence {first + 1} starts with {first_token} and sentence {second + 1} with {second_token}: one "
            f"call translates into one language; give tgt_lang or the same token on every sentence"
        )
        raise WrittenLanguageError(detail, second)
    return next(iter(named))


def written_runs(sentences: Sentences, languages: list[str]) -> list[tuple[int, int]]:
    """The (start, end) index ranges of the consecutive sentences whose starts name the same language of
    `languages` (a written token in any spelling; a sentence without one, or with a token naming none of them,
    is a language of its own): a file whose lines carry their own target tokens is translated run by run."""
    keys = [s.names(languages) or s.token for s in read_sentences(sentences)]
    runs, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            runs.append((start, i))
            start = i
    return runs


# ---- the target language of a call ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetLanguage:
    """The language a request translates into, resolved against the model once (`resolve_target`)."""

    code: str
    """The model's own code of it (fra and FR given: fr)."""
    token: Optional[str]
    """Its token, put first on every source (a multilingual model); None: the model takes no token."""


def resolve_target(data: Any, tgt_lang: Optional[str]) -> TargetLanguage:
    """The target language a request names (`decoding.tgt_lang`), checked against the model's: None names the
    model's only target language; a code is matched as `find_language` matches it.

    Raises:
        ConfigError (key decoding.tgt_lang): None for a model with several target languages, or a language the model
            does not translate into; the message lists the model's languages.
    """
    languages = target_languages(data)
    tokens = {c.tgt_lang: c.language_token for c in data.corpora}
    code = languages[0] if tgt_lang is None and len(languages) == 1 else tgt_lang
    code = find_language(code, languages) if code is not None else None
    if code is not None:
        return TargetLanguage(code, tokens[code])
    if tgt_lang is None:
        detail = (
            f"this model translates into {len(languages)} languages: give the one to translate into, one of "
            f"{', '.join(languages)}"
        )
    elif not any(tokens.values()):
        detail = (
            f"this model translates {describe(data)} only; tgt_lang {tgt_lang!r} is not its language (give "
            f"{languages[0]} or leave it out)"
        )
    else:
        detail = f"this model translates into {', '.join(languages)}, not {tgt_lang!r}"
    raise ConfigError(f"decoding.tgt_lang: {detail}", key="decoding.tgt_lang", detail=detail)


def check_options(config: Config, **overrides: Any) -> DecodingConfig:
    """The options of a call that do not depend on its sentences, checked before any is read (a file translated
    line by line): `config.decoding` with the overrides (`decoding/options.py: decoding_options`), and a tgt_lang
    among them checked against the model (`resolve_target`); without one, each run of sentences names its own
    language (`resolve_options`).

    Raises:
        OptionError, ConfigError: as `resolve_options`, except what a sentence's written token decides.
    """
    options = decoding_options(config.decoding, **overrides)
    if overrides.get("tgt_lang") is not None:
        resolve_target(config.data, overrides["tgt_lang"])
    return options


# ---- the options and request of a call --------------------------------------------------------------------------


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
    config: Config, tokenizer: Tokenizer, sentences: Optional[Sentences] = None, **overrides: Any
) -> ResolvedOptions:
    """`config.decoding` with the given (non-None) overrides, validated (`decoding/options.py: decoding_options`),
    and the target language they name (`resolve_target`).

    Args:
        sentences: the sentences of the call (str, or read once: `read_sentences`), when known: without a tgt_lang,
            a target-language token written at their start (`>>fra<< text`, the same on every one) names the
            language (`written_language`).
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
    sentences: Sentences,
    options: ResolvedOptions,
    prefixes: Optional[list[Optional[str]]] = None,
) -> TranslationRequest:
    """The request of `sentences` translated with `options` (`resolve_options`).

    Args:
        sentences: the sentences (str, or read once: `read_sentences`); a target-language token written at the
            start of one (`>>fra<< text`, as OPUS-MT's multi-target models are given their language) is taken out
            here when it names the language translated into, on every model (a model with language tokens puts its
            own, at id level, once).
        prefixes: per sentence, a target prefix (None or "": none), or None.

    Raises:
        OptionError: prefixes not one per sentence, or a prefix longer than the model can produce before its eos
            (max_positions - 2 tokens).
        WrittenLanguageError (a ConfigError): a sentence starts with another language's token
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
