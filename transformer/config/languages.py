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
from typing import Any, Optional

from .errors import ConfigError, _require

OPUS_CODES = {
    "ar": "ara", "bg": "bul", "ca": "cat", "cs": "ces", "cy": "cym", "da": "dan", "de": "deu", "el": "ell",
    "en": "eng", "es": "spa", "et": "est", "eu": "eus", "fi": "fin", "fr": "fra", "ga": "gle", "gl": "glg",
    "he": "heb", "hi": "hin", "hr": "hrv", "hu": "hun", "hy": "hye", "id": "ind", "is": "isl", "it": "ita",
    "ja": "jpn", "ka": "kat", "ko": "kor", "lt": "lit", "lv": "lav", "mk": "mkd", "mt": "mlt", "nl": "nld",
    "pl": "pol", "pt": "por", "ro": "ron", "ru": "rus", "sk": "slk", "sl": "slv", "sq": "sqi", "sr": "srp",
    "sv": "swe", "th": "tha", "tr": "tur", "uk": "ukr", "vi": "vie",
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


class WrittenLanguageError(ConfigError):
    """A sentence starts with the token of another language (`>>deu<<`) than the one translated into
    (`without_written_token`): `sentence` is its index in the sentences given, so that callers can name the line
    (the CLI) or the field (the server)."""

    def __init__(self, detail: str, sentence: int) -> None:
        super().__init__(f"decoding.tgt_lang: {detail}", key="decoding.tgt_lang", detail=detail)
        self.sentence = sentence


def without_written_token(sentences: list[str], tgt_lang: str) -> list[str]:
    """The sentences without a target-language token written at their start when it is `tgt_lang`'s
    (`>>fra<< text` -> `text`; whitespace around it dropped); others unchanged.

    Raises:
        WrittenLanguageError: a sentence starts with another language's token.
    """
    out = []
    for i, sentence in enumerate(sentences):
        written = _WRITTEN_TOKEN.match(sentence)
        if written and written.group(1) != language_token(tgt_lang):
            raise WrittenLanguageError(f"a sentence starts with {written.group(1)} but the target language is "
                                       f"{tgt_lang} ({sentence[:40].strip()!r}): the language is given by tgt_lang, "
                                       f"and a token written at the start of a sentence must name the same one", i)
        out.append(sentence[written.end():] if written else sentence)
    return out


def parse_direction(direction: str) -> tuple[str, str]:
    """("de", "en") of "de-en".

    Raises:
        ConfigError: not two different language codes (letters, digits, "_") joined by one "-", naming
            data.directions.
    """
    parts = direction.split("-") if isinstance(direction, str) else []
    _require(len(parts) == 2 and all(_CODE.fullmatch(p) for p in parts) and parts[0] != parts[1], "data.directions",
             f"each direction is 'src-tgt' with two different language codes (e.g. de-en), got {direction!r}")
    return parts[0], parts[1]


def check_directions(data: Any) -> None:
    """The `DataConfig` checks of `directions` and `direction_temperature` (called by its `__post_init__`).

    Raises:
        ConfigError: a malformed or repeated direction, a temperature below 1, or several languages with
            data.joint_vocab false (one vocabulary must spell every language and hold the tokens).
    """
    _require(data.direction_temperature >= 1.0, "data.direction_temperature",
             f"must be at least 1 (1: directions in proportion to their sizes; larger: closer to uniform), got "
             f"{data.direction_temperature}")
    if not data.directions:
        return
    _require(isinstance(data.directions, (list, tuple)), "data.directions",
             f"a list of 'src-tgt' strings, e.g. [de-en, fr-en], got {data.directions!r}")
    pairs = [parse_direction(d) for d in data.directions]
    repeated = sorted({d for d in data.directions if data.directions.count(d) > 1})
    _require(not repeated, "data.directions", f"{', '.join(repeated)} listed more than once")
    _require(data.joint_vocab, "data.joint_vocab", "a multilingual run (data.directions) needs one joint "
             "vocabulary for every language and its tokens: set data.joint_vocab: true")
    tokens = {}
    for _, tgt in pairs:
        other = tokens.setdefault(language_token(tgt), tgt)
        _require(other == tgt, "data.directions", f"target languages {other} and {tgt} have the same token "
                 f"{language_token(tgt)}: use one code for one language")


def language_pairs(data: Any) -> list[tuple[str, str]]:
    """The (source, target) languages the run trains on: each of data.directions, or (src_lang, tgt_lang)."""
    return [parse_direction(d) for d in data.directions] or [(data.src_lang, data.tgt_lang)]


def describe(data: Any) -> str:
    """The directions of a data section as messages name them: "de->en", or "de->en, fr->en" for a multilingual run."""
    return ", ".join(f"{src}->{tgt}" for src, tgt in language_pairs(data))


def target_languages(data: Any) -> list[str]:
    """The languages the model translates into, in the order of data.directions (bilingual: [tgt_lang])."""
    return list(dict.fromkeys(tgt for _, tgt in language_pairs(data)))


def language_tokens(data: Any) -> list[str]:
    """The tokens a multilingual run's vocabulary holds, one per target language; none for a bilingual run."""
    return [language_token(lang) for lang in target_languages(data)] if data.directions else []


def for_direction(data: Any, direction: str) -> Any:
    """The data section of one direction of a multilingual run: src_lang and tgt_lang are its languages and
    directions holds it alone, so that file names, token caches and samples are those of that direction and
    `source_token` gives its target's token."""
    src, tgt = parse_direction(direction)
    return dataclasses.replace(data, src_lang=src, tgt_lang=tgt, directions=[direction])


def source_token(data: Any) -> Optional[str]:
    """The token put at the start of every source of this data: None for a bilingual run; for the data section of
    one direction (`for_direction`) its target language's token.

    Raises:
        ValueError: several directions (take `for_direction` first).
    """
    if not data.directions:
        return None
    if len(data.directions) > 1:
        raise ValueError(f"{len(data.directions)} directions: take one with for_direction first")
    return language_token(parse_direction(data.directions[0])[1])
