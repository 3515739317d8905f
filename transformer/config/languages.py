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

from .errors import _require

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

LANGUAGE_TOKEN = re.compile(r">>[A-Za-z][A-Za-z0-9_]*<<")
"""The shape of a target-language token (`>>fra<<`, `>>de<<`, `>>cmn_Hans<<`): a tag may not take it."""


def language_token(code: str) -> str:
    """The target-language token of a language code, as OPUS-MT names it: `>>` + ISO 639-3 code + `<<`.

    de -> `>>deu<<`, en -> `>>eng<<`, fr -> `>>fra<<`, cs -> `>>ces<<` (`OPUS_CODES`); any other code as given
    (`>>cmn_Hans<<` for "cmn_Hans"). It is put at the start of every source of a multilingual model (Johnson et al.
    2017, §3) and is one piece of the model's vocabulary.
    """
    return f">>{OPUS_CODES.get(code, code)}<<"


def token_language(piece: str) -> Optional[str]:
    """The language code of a target-language token as OPUS-MT vocabularies write them: `>>fra<<` -> fr (ISO 639-3
    names read back to the two-letter code of `OPUS_CODES`), `>>fr<<` -> fr (the older two-letter style),
    `>>cmn_Hans<<` -> cmn_Hans; None for any other piece."""
    if not LANGUAGE_TOKEN.fullmatch(piece):
        return None
    code = piece[2:-2]
    return _ISO_639_1.get(code, code)


def token_of(data: Any, code: str) -> str:
    """The token a run's vocabulary holds for target language `code`: data.language_tokens's entry (an imported
    OPUS-MT model's own spelling, `>>de<<`), else `language_token(code)` (`>>deu<<`)."""
    return data.language_tokens.get(code) or language_token(code)


def find_language(code: str, languages: list[str]) -> Optional[str]:
    """The one of `languages` that `code` names: itself, or the same language written as OPUS-MT's token writes it
    or in other case (fr, fra, FR and Fra all name fr: one target-language token, compared without case); None
    if none or several do."""
    if code in languages:
        return code
    token = language_token(code.lower()).lower()
    named = [lang for lang in languages if language_token(lang.lower()).lower() == token]
    return named[0] if len(named) == 1 else None


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
            not any(c.isspace() for c in entry.tag) and not LANGUAGE_TOKEN.fullmatch(entry.tag),
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
    _require(
        not data.language_tokens or bool(data.directions),
        "data.language_tokens",
        "names the tokens of data.directions' target languages; a run without data.directions takes none",
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
    targets = [tgt for _, tgt in pairs]
    for code, token in data.language_tokens.items():
        _require(
            code in targets,
            "data.language_tokens",
            f"{code!r} is not a target language of data.directions ({', '.join(dict.fromkeys(targets))})",
        )
        _require(
            isinstance(token, str) and bool(LANGUAGE_TOKEN.fullmatch(token)),
            f"data.language_tokens.{code}",
            f"a token such as >>de<< or >>deu<<, got {token!r}",
        )
    tokens = {}
    for tgt in targets:
        other = tokens.setdefault(token_of(data, tgt), tgt)
        _require(
            other == tgt,
            "data.directions",
            f"target languages {other} and {tgt} have the same token "
            f"{token_of(data, tgt)}: use one code for one language",
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
    """How logs, messages and `--direction` name this corpus: its direction ("de-en") for a parallel corpus, its
    `data.synthetic[].name` for a synthetic one (`corpora_of` names every corpus)."""
    files: str = ""
    """The name its files carry in a run (evaluation files, subword samples, per-corpus metrics): its name, except
    for the one corpus of the short form data.src_lang/tgt_lang, whose files keep the run's own names (""):
    `eval_test_best_beam.json`, not `eval_test_best_de-en_beam.json`. The bilingual layout is decided here only."""
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
    def suffix(self) -> str:
        """What its files' names add: "_" + `files` ("_de-en"), or "" for the short form's corpus."""
        return f"_{self.files}" if self.files else ""

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
            directions=[self.direction] if self.files else [],
            path=self.path or data.path,
            hf_dataset=None if self.path else data.hf_dataset,
            synthetic=[],
            parallel_weight=1.0,  # the view reads one corpus; its weight is the corpus's
        )
        object.__setattr__(view, "corpora", (self,))
        return view


def corpora_of(data: Any) -> tuple[Corpus, ...]:
    """The corpora of a data section, the one place that reads its short or long form: one per entry of
    data.directions (named by it, with its target language's token), else (src_lang, tgt_lang), named by its
    direction, with no marks and the run's own file names (`Corpus.files`); each weighted data.parallel_weight.
    Then one per entry of data.synthetic, with its direction's languages and token, its own name, tag, weight and
    folder, and no held-out splits.

    Raises:
        ConfigError: a synthetic corpus whose direction the run does not train, or whose name is taken.
    """
    weight = data.parallel_weight
    if data.directions:
        parallel = tuple(
            Corpus(src, tgt, direction, direction, token_of(data, tgt), weight=weight)
            for direction, (src, tgt) in ((d, parse_direction(d)) for d in data.directions)
        )
    else:
        direction = f"{data.src_lang}-{data.tgt_lang}"
        parallel = (Corpus(data.src_lang, data.tgt_lang, direction, weight=weight),)
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
                files=entry.name,
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
