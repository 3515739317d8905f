"""Languages of a multilingual model: the target-language token and the directions of `data.directions`.

A multilingual model (Johnson et al. 2017, "Google's Multilingual Neural Machine Translation System") is one
encoder-decoder trained on several directions at once; the language to translate into is told by a token at the
start of the source. We name the tokens as OPUS-MT's multi-target models do, `>>fra<<` with the ISO 639-3 code, so
that our exports and Marian's imports agree (`language_token`).

`data.directions` lists "src-tgt" strings such as "de-en"; empty, the run is bilingual (`data.src_lang` ->
`data.tgt_lang`, no token). Functions here take the `DataConfig` (`sections.py`, below this module) as it comes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

from .errors import ConfigError, _require

OPUS_CODES = {
    "ar": "ara",
    "bg": "bul",
    "ca": "cat",
    "cs": "ces",
    "cy": "cym",
    "da": "dan",
    "de": "deu",
    "el": "ell",
    "en": "eng",
    "es": "spa",
    "et": "est",
    "eu": "eus",
    "fi": "fin",
    "fr": "fra",
    "ga": "gle",
    "gl": "glg",
    "he": "heb",
    "hi": "hin",
    "hr": "hrv",
    "hu": "hun",
    "hy": "hye",
    "id": "ind",
    "is": "isl",
    "it": "ita",
    "ja": "jpn",
    "ka": "kat",
    "ko": "kor",
    "lt": "lit",
    "lv": "lav",
    "mk": "mkd",
    "mt": "mlt",
    "nl": "nld",
    "pl": "pol",
    "pt": "por",
    "ro": "ron",
    "ru": "rus",
    "sk": "slk",
    "sl": "slv",
    "sq": "sqi",
    "sr": "srp",
    "sv": "swe",
    "th": "tha",
    "tr": "tur",
    "uk": "ukr",
    "vi": "vie",
}
"""ISO 639-1 code -> the ISO 639-3 code OPUS-MT's target-language tokens use (`>>fra<<`). Codes not listed (a
three-letter code already, or one such as Chinese and Norwegian, where OPUS-MT names scripts or variants:
`>>cmn_Hans<<`, `>>nob<<`) are used as given."""

_ISO_639_1 = {three: two for two, three in OPUS_CODES.items()}

_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def language_token(code: str) -> str:
    """The target-language token of a language code, as OPUS-MT names it: `>>` + ISO 639-3 code + `<<`.

    de -> `>>deu<<`, en -> `>>eng<<`, fr -> `>>fra<<`, cs -> `>>ces<<` (`OPUS_CODES`); any other code as given
    (`>>cmn_Hans<<` for "cmn_Hans"). It is put at the start of every source of a multilingual model (Johnson et al.
    2017, §3) and is one piece of the model's vocabulary.
    """
    return f">>{OPUS_CODES.get(code, code)}<<"


def token_language(piece: str) -> Optional[str]:
    """The language code of a target-language token, the inverse of `language_token`: `>>fra<<` -> fr,
    `>>cmn_Hans<<` -> cmn_Hans; None for any other piece (also `>>fr<<`, which `language_token` never writes)."""
    code = piece[2:-2] if piece.startswith(">>") and piece.endswith("<<") else ""
    code = _ISO_639_1.get(code, code)
    return code if _CODE.fullmatch(code) and language_token(code) == piece else None


def find_language(code: str, languages: list[str]) -> Optional[str]:
    """The one of `languages` that `code` names: itself, or the same language written as OPUS-MT's token writes it
    or in other case (fr, fra, FR and Fra all name fr: one target-language token, compared without case); None
    if none or several do."""
    if code in languages:
        return code
    token = language_token(code.lower()).lower()
    named = [lang for lang in languages if language_token(lang.lower()).lower() == token]
    return named[0] if len(named) == 1 else None


_WRITTEN_TOKEN = re.compile(r"\s*(>>[A-Za-z][A-Za-z0-9_]*<<)\s*")
"""A target-language token written at the start of a sentence, as OPUS-MT's multi-target models are given one."""


def _written_token(sentence: str, languages: list[str]) -> tuple[Optional[str], Optional[str], int]:
    """The target-language token written at the very start of `sentence` (`>>fra<<`), the one of `languages` it
    names in any spelling `find_language` takes (None if none), and where the text after it begins; (None, None, 0)
    when the sentence starts with no token."""
    written = _WRITTEN_TOKEN.match(sentence)
    if not written:
        return None, None, 0
    return written.group(1), find_language(written.group(1)[2:-2], languages), written.end()


class WrittenLanguageError(ConfigError):
    """A sentence starts with the token of another language (`>>deu<<`) than the one translated into
    (`without_written_token`): `sentence` is its index in the sentences given, so that callers can name the line
    (the CLI) or the field (the server)."""

    def __init__(self, detail: str, sentence: int) -> None:
        super().__init__(f"decoding.tgt_lang: {detail}", key="decoding.tgt_lang", detail=detail)
        self.sentence = sentence


def without_written_token(sentences: list[str], tgt_lang: str, only: bool = False) -> list[str]:
    """The sentences without a target-language token written at their start when it names `tgt_lang`, in any
    spelling `find_language` takes (`>>fra<< text`, `>>fr<< text`, `>>FRA<< text` -> `text` for fr; whitespace
    around it dropped); others unchanged. Only the very start of a sentence is read: `>>fra<<` later in it is text.

    Args:
        only: `tgt_lang` is the model's only target language (it was not chosen, so the message says so).

    Raises:
        WrittenLanguageError: a sentence starts with another language's token.
    """
    out = []
    for i, sentence in enumerate(sentences):
        token, code, end = _written_token(sentence, [tgt_lang])
        if token and code is None:
            why = (
                f"the model translates into {tgt_lang} only"
                if only
                else "the language is given by tgt_lang, and a token written at the start of a sentence "
                "must name the same one"
            )
            raise WrittenLanguageError(
                f"a sentence starts with {token} but the target language is "
                f"{tgt_lang} ({sentence[:40].strip()!r}): {why}",
                i,
            )
        out.append(sentence[end:])
    return out


def written_language(sentences: list[str], languages: list[str]) -> Optional[str]:
    """The one of `languages` named by the target-language tokens written at the start of `sentences` (in any
    spelling `find_language` takes), when no tgt_lang is given: the token chooses the language, as OPUS-MT's
    multi-target models are told theirs. None when no sentence starts with a token.

    Raises:
        WrittenLanguageError: a token naming none of `languages`, sentences naming different languages, or (a model
            with several target languages) some starting with a token and others not: one call translates into one
            language.
    """
    named: dict[str, int] = {}
    plain = None
    for i, sentence in enumerate(sentences):
        token, code, _ = _written_token(sentence, languages)
        if not token:
            plain = i if plain is None else plain
            continue
        if code is None:
            raise WrittenLanguageError(
                f"a sentence starts with {token} ({sentence[:40].strip()!r}), a language this model "
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
        first_token, second_token = (
            _written_token(sentences[i], languages)[0] or "no language token"
            for i in (first, second)
        )
        detail = (
            f"sentence {first + 1} starts with {first_token} and sentence {second + 1} with {second_token}: one "
            f"call translates into one language; give tgt_lang or the same token on every sentence"
        )
        raise WrittenLanguageError(detail, second)
    return next(iter(named))


def written_runs(sentences: list[str], languages: list[str]) -> list[tuple[int, int]]:
    """The (start, end) index ranges of the consecutive sentences whose starts name the same language of
    `languages` (a written token in any spelling; a sentence without one, or with a token naming none of them,
    is a language of its own): a file whose lines carry their own target tokens is translated run by run."""
    keys = []
    for sentence in sentences:
        token, code, _ = _written_token(sentence, languages)
        keys.append(code or token)
    runs, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            runs.append((start, i))
            start = i
    return runs


def parse_direction(direction: str) -> tuple[str, str]:
    """("de", "en") of "de-en".

    Raises:
        ConfigError: not two different language codes (letters, digits, "_") joined by one "-", naming
            data.directions.
    """
    parts = direction.split("-") if isinstance(direction, str) else []
    _require(
        len(parts) == 2 and all(_CODE.fullmatch(p) for p in parts) and parts[0] != parts[1],
        "data.directions",
        f"each direction is 'src-tgt' with two different language codes (e.g. de-en), got {direction!r}",
    )
    return parts[0], parts[1]


def check_synthetic(data: Any) -> None:
    """The `DataConfig` checks of `synthetic` and `parallel_weight` (called by its `__post_init__`; the directions
    and names are checked by `corpora_of`).

    Raises:
        ConfigError: a weight that is not positive (data.parallel_weight may be 0 beside synthetic corpora), a tag
            with whitespace or written as a language token, or a tag with data.joint_vocab false (the one
            vocabulary holds the tags as whole pieces).
    """
    _require(
        data.parallel_weight > 0 or (data.parallel_weight == 0 and bool(data.synthetic)),
        "data.parallel_weight",
        f"must be positive, or 0 beside data.synthetic (the parallel pairs then validate only, as for a "
        f"distilled student), got {data.parallel_weight}",
    )
    for i, entry in enumerate(data.synthetic):
        key = f"data.synthetic[{i}]"
        _require(entry.weight > 0, f"{key}.weight", f"must be positive, got {entry.weight}")
        _require(
            bool(entry.name) and not any(c.isspace() or c == "/" for c in entry.name),
            f"{key}.name",
            f"a name without spaces or '/', got {entry.name!r}",
        )
        _require(
            not any(c.isspace() for c in entry.tag) and not _WRITTEN_TOKEN.fullmatch(entry.tag),
            f"{key}.tag",
            f"one piece without spaces, not a language token (e.g. <bt>), got {entry.tag!r}",
        )
        _require(
            not entry.tag or data.joint_vocab,
            "data.joint_vocab",
            f"{key}.tag {entry.tag} is a reserved piece "
            "of one joint vocabulary: set data.joint_vocab: true (or tag: '' for none)",
        )


def check_directions(data: Any) -> None:
    """The `DataConfig` checks of `directions` and `direction_temperature` (called by its `__post_init__`).

    Raises:
        ConfigError: a malformed or repeated direction, a temperature below 1, or several languages with
            data.joint_vocab false (one vocabulary must spell every language and hold the tokens).
    """
    _require(
        data.direction_temperature >= 1.0,
        "data.direction_temperature",
        f"must be at least 1 (1: directions in proportion to their sizes; larger: closer to uniform), got "
        f"{data.direction_temperature}",
    )
    if not data.directions:
        return
    _require(
        isinstance(data.directions, (list, tuple)),
        "data.directions",
        f"a list of 'src-tgt' strings, e.g. [de-en, fr-en], got {data.directions!r}",
    )
    pairs = [parse_direction(d) for d in data.directions]
    repeated = sorted({d for d in data.directions if data.directions.count(d) > 1})
    _require(not repeated, "data.directions", f"{', '.join(repeated)} listed more than once")
    _require(
        data.joint_vocab,
        "data.joint_vocab",
        "a multilingual run (data.directions) needs one joint "
        "vocabulary for every language and its tokens: set data.joint_vocab: true",
    )
    tokens = {}
    for _, tgt in pairs:
        other = tokens.setdefault(language_token(tgt), tgt)
        _require(
            other == tgt,
            "data.directions",
            f"target languages {other} and {tgt} have the same token "
            f"{language_token(tgt)}: use one code for one language",
        )


@dataclass(frozen=True)
class Corpus:
    """One corpus of a run: the languages it translates and the marks its sources carry (STYLE.md §13).

    A run is a list of corpora, `DataConfig.corpora`, made once when the data section is built (`corpora_of`): the
    short form `data.src_lang`/`data.tgt_lang` is a list of one corpus with no marks; `data.directions` is one corpus
    per entry, each source starting with its target language's token. Everything after the config walks the list.
    """

    src_lang: str
    tgt_lang: str
    name: str = ""
    """How the run's files, logs and metrics name this corpus: the direction ("de-en") of an entry of
    data.directions; empty for the one corpus of the short form, whose files keep the run's own names."""
    language_token: Optional[str] = None
    """The target-language token put first on each source (`>>eng<<`); None: no token (a bilingual run)."""
    tag: Optional[str] = None
    """A piece put on each source after the language token, that marks the corpus's kind (tagged back-translation,
    Caswell et al. 2019); None: none."""
    weight: float = 1.0
    """How much of each epoch the corpus gets relative to its size (1: in proportion to its pairs;
    `data/mixing.py`)."""
    path: Optional[str] = None
    """The folder of its files, when not data.path (a synthetic corpus: `data.synthetic`)."""
    held_out: bool = True
    """It has validation and test splits, scored during training and by `evaluate` (False: training pairs only, a
    synthetic corpus)."""

    @property
    def trained(self) -> bool:
        """Whether its pairs are trained on: weight > 0 (a distilled student's references, weight 0, validate only and
        add no pairs to an epoch: `data/mixing.py`)."""
        return self.weight > 0

    @property
    def source_pieces(self) -> tuple[str, ...]:
        """The pieces put before every source of this corpus, in order: its language token, then its tag."""
        return tuple(piece for piece in (self.language_token, self.tag) if piece)

    @property
    def direction(self) -> str:
        """ "src-tgt", e.g. "de-en"."""
        return f"{self.src_lang}-{self.tgt_lang}"

    def section(self, data: Any) -> Any:
        """The data section that reads this corpus: `data` with its languages as src_lang and tgt_lang, and this
        corpus its only one (so that file names, token caches and samples are this corpus's)."""
        view = dataclasses.replace(
            data,
            src_lang=self.src_lang,
            tgt_lang=self.tgt_lang,
            directions=[self.direction] if self.name else [],
            path=self.path or data.path,
            hf_dataset=None if self.path else data.hf_dataset,
            synthetic=[],
            parallel_weight=1.0,  # the view reads one corpus; its weight is the corpus's
        )
        object.__setattr__(view, "corpora", (self,))
        return view


def corpora_of(data: Any) -> tuple[Corpus, ...]:
    """The corpora of a data section, the one place that reads its short or long form: one per entry of
    data.directions (named by it, with its target language's token), else (src_lang, tgt_lang) with no marks; each
    weighted data.parallel_weight. Then one per entry of data.synthetic, with its direction's languages and token,
    its own tag, weight and folder, and no held-out splits.

    Raises:
        ConfigError: a synthetic corpus whose direction the run does not train, or whose name is taken.
    """
    weight = data.parallel_weight
    if data.directions:
        parallel = tuple(
            Corpus(src, tgt, name=direction, language_token=language_token(tgt), weight=weight)
            for direction, (src, tgt) in ((d, parse_direction(d)) for d in data.directions)
        )
    else:
        parallel = (Corpus(data.src_lang, data.tgt_lang, weight=weight),)
    synthetic: list[Corpus] = []
    for i, entry in enumerate(data.synthetic):
        key = f"data.synthetic[{i}]"
        found = [c for c in parallel if entry.direction in ("", c.direction)]
        _require(
            len(found) == 1,
            f"{key}.direction",
            f"{entry.direction!r} is not one direction of the run's "
            f"{', '.join(c.direction for c in parallel)}: give the direction the corpus translates",
        )
        taken = {c.name for c in (*parallel, *synthetic)}
        _require(
            entry.name not in taken,
            f"{key}.name",
            f"{entry.name!r} is taken: give each corpus its own name",
        )
        synthetic.append(
            dataclasses.replace(
                found[0],
                name=entry.name,
                tag=entry.tag or None,
                weight=entry.weight,
                path=entry.path,
                held_out=False,
            )
        )
    return parallel + tuple(synthetic)


def language_pairs(data: Any) -> list[tuple[str, str]]:
    """The (source, target) languages the run trains on, each once (corpora of one direction, a parallel and a
    synthetic one say, give one pair)."""
    return list(dict.fromkeys((corpus.src_lang, corpus.tgt_lang) for corpus in data.corpora))


def describe(data: Any) -> str:
    """The directions of a data section as messages name them: "de->en", or "de->en, fr->en" for a multilingual run."""
    return ", ".join(f"{src}->{tgt}" for src, tgt in language_pairs(data))


def target_languages(data: Any) -> list[str]:
    """The languages the model translates into, in the order of its corpora (bilingual: [tgt_lang])."""
    return list(dict.fromkeys(tgt for _, tgt in language_pairs(data)))


def language_tokens(data: Any) -> list[str]:
    """The target-language tokens the run's vocabulary holds, one per target language; none for a bilingual run."""
    return list(dict.fromkeys(c.language_token for c in data.corpora if c.language_token))


def reserved_pieces(data: Any) -> list[str]:
    """Every piece the run's corpora put before their sources (language tokens, then tags): the vocabulary holds
    each as one whole piece."""
    return list(dict.fromkeys(piece for corpus in data.corpora for piece in corpus.source_pieces))


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
