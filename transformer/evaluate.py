"""What `transformer evaluate` does: a test set (a split of the checkpoint's corpus, or given files) translated, and
corpus BLEU and chrF with sacrebleu on the detokenized text, with sacrebleu's signatures."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import sacrebleu
from tqdm import tqdm

from .config import Config, ConfigError, DataConfig, DecodingConfig, OptionError, override_config
from .config.languages import Corpus, find_language
from .data import DataError, load_split, read_lines
from .files import write_file
from .request import ResolvedOptions
from .translate import Translator

logger = logging.getLogger(__name__)

# Target languages whose text is not space-separated need another BLEU tokenizer than the default 13a.
_BLEU_TOKENIZERS = {"zh": "zh", "ja": "ja-mecab", "ko": "ko-mecab"}


@dataclass
class Scores:
    """Corpus-level scores and how they were computed.

    Attributes:
        bleu: sacreBLEU (0-100); chrf: chrF2 (0-100).
        bleu_signature, chrf_signature: sacrebleu's signatures, to report with the numbers.
        n_sentences: number of hypothesis/reference pairs.
    """

    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    n_sentences: int

    def to_dict(self) -> dict:
        return asdict(self)


def bleu_tokenizer(tgt_lang: str) -> str:
    """sacrebleu tokenizer for a target language: zh, ja-mecab, ko-mecab for those languages, else 13a.

    Falls back to "char" when a mecab tokenizer's extra package is not installed (with a warning).
    """
    name = _BLEU_TOKENIZERS.get(tgt_lang.split("_")[0].split("-")[0].lower(), "13a")
    if name.endswith("mecab"):
        try:
            sacrebleu.BLEU(tokenize=name)
        except (ImportError, RuntimeError, SystemExit):
            logger.warning(
                "sacrebleu tokenizer %s needs an extra package (pip install sacrebleu[%s]); using 'char'",
                name,
                name.split("-")[0],
            )
            name = "char"
    return name


def check_bleu_tokenizer(name: str) -> None:
    """Raise OptionError (a ValueError naming the parameter `tokenize`), listing sacrebleu's BLEU tokenizers, unless
    `name` is one (checked before any decoding)."""
    names = list(getattr(sacrebleu.BLEU, "TOKENIZERS", []))
    if names and name not in names:
        raise OptionError(
            f"{{tokenize}}: sacrebleu's BLEU tokenizers are {', '.join(names)}", tokenize=name
        )


EVALUATE_CHUNK = 2000
"""Sentences `translate_test_set` decodes between progress-bar updates (sorted by length within each)."""


def translate_test_set(
    translator: Translator, src: list[str], options: ResolvedOptions
) -> list[str]:
    """Translate a test set (the best hypothesis of each line) with a progress bar on stderr, and name once the lines
    longer than the model reads (translated from their start: `translate.source_within`).

    Args:
        options: the call's options (`Translator.resolve_options`).

    Raises:
        WrittenLanguageError (a ConfigError): a line starts with another language's token than tgt_lang.
    """
    hyps: list[str] = []
    truncated: list[int] = []
    with tqdm(  # on a terminal only: redirected, a bar's redraws are noise
        total=len(src),
        unit="line",
        file=sys.stderr,
        desc="evaluate",
        disable=not sys.stderr.isatty(),
    ) as bar:
        for start in range(0, len(src), EVALUATE_CHUNK):
            result = translator.run(
                translator.request(src[start : start + EVALUATE_CHUNK], options), scores=False
            )
            hyps += result.texts
            truncated += [start + i + 1 for i in result.truncated]
            bar.update(min(EVALUATE_CHUNK, len(src) - start))
    if truncated:
        logger.warning(
            "%d source lines have more than the model's max_positions=%d tokens: truncated, their start "
            "translated (lines %s)",
            len(truncated),
            translator.engine.max_source_len,
            ", ".join(map(str, truncated[:10])) + (", ..." if len(truncated) > 10 else ""),
        )
    return hyps


def corpus_scores(
    hypotheses: list[str],
    references: list[str] | list[list[str]],
    tgt_lang: str = "en",
    tokenize: str | None = None,
) -> Scores:
    """Corpus BLEU and chrF of detokenized hypotheses, as the sacrebleu command line scores them.

    Args:
        hypotheses: detokenized sentences.
        references: one reference per hypothesis (a list of str), or several reference streams (a list of such
            lists, e.g. one per reference file), each aligned with the hypotheses.
        tgt_lang: picks the BLEU tokenizer (see `bleu_tokenizer`) unless `tokenize` is given.
        tokenize: a sacrebleu tokenizer name, e.g. "13a", "zh", "intl".

    Raises:
        ValueError: if a reference stream and the hypotheses differ in length.
    """
    streams = [references] if not references or isinstance(references[0], str) else references
    for i, stream in enumerate(streams):
        if len(stream) != len(hypotheses):
            raise ValueError(
                f"{len(hypotheses)} hypotheses but {len(stream)} references in stream {i + 1}"
            )
    # force: our hypotheses are detokenized; a weak model's " ." endings are its output, not a tokenized test set
    bleu = sacrebleu.BLEU(tokenize=tokenize or bleu_tokenizer(tgt_lang), force=True)
    chrf = sacrebleu.CHRF()
    bleu_score = bleu.corpus_score(hypotheses, streams)
    chrf_score = chrf.corpus_score(hypotheses, streams)
    return Scores(
        bleu_score.score,
        chrf_score.score,
        str(bleu.get_signature()),
        str(chrf.get_signature()),
        len(hypotheses),
    )


def evaluation_data(
    config: Config,
    split: Optional[str],
    src_path: Optional[str],
    ref_paths: Optional[list[str]],
    overrides: list[str],
    checkpoint: str,
    direction: Optional[str] = None,
    tgt_lang: Optional[str] = None,
) -> tuple[list[str], list[list[str]], Optional[str], str]:
    """What `transformer evaluate` scores: source lines, reference streams (one list of lines per reference file),
    the target language (of the split's direction; with --src/--ref the `tgt_lang` given, else the model's one
    target language, None for a model of several), and where they came from. Either a split of the checkpoint's
    data section (with `--set data.KEY=VALUE` overrides; of a multilingual model, the split of one of its
    `direction`s) or --src and --ref files.

    Raises:
        ConfigError: both or neither given, overrides without a split, a multilingual model's split without one of
            its directions, a direction the model does not translate (or one given with --src/--ref), a `tgt_lang` (the
            --tgt-lang flag) that is not the direction's target language.
        DataError: unreadable or misaligned files.
    """
    if split:
        if src_path or ref_paths:
            raise ConfigError(
                f"evaluate: --split {split} and --src/--ref name two test sets; give one of them"
            )
        config = override_config(config, overrides, sections=("data",), source=checkpoint)
        corpus = _corpus(config.data, split, direction)
        if (
            direction
            and tgt_lang is not None
            and find_language(tgt_lang, [corpus.tgt_lang]) is None
        ):
            raise ConfigError(
                f"evaluate: --tgt-lang {tgt_lang} and --direction {direction} name two target "
                f"languages; give one of them"
            )
        data = corpus.section(config.data)
        name = {"test": data.test_split, "valid": data.valid_split}.get(split, split)
        test = load_split(data, name)
        return test.src, [test.tgt], corpus.tgt_lang, test.origin
    if overrides:
        raise ConfigError(
            "evaluate: --set changes the data section for --split; with --src/--ref it has no use"
        )
    if not (src_path and ref_paths):
        raise ConfigError("evaluate: give --src and --ref files, or --split NAME")
    if direction:
        raise ConfigError(
            f"evaluate: --direction {direction} picks the split of one direction (with --split); with "
            f"--src/--ref give the language to translate into with --tgt-lang"
        )
    src = read_lines(src_path)
    refs = []
    for path in ref_paths:
        refs.append(read_lines(path))
        if len(refs[-1]) != len(src):
            raise DataError(
                f"reference {path} has {len(refs[-1])} lines but the source {src_path} has {len(src)}"
            )
    held_out = [c for c in config.data.corpora if c.held_out]
    language = tgt_lang or (held_out[0].tgt_lang if len(held_out) == 1 else None)
    return src, refs, language, f"{src_path} + {' + '.join(ref_paths)}"


def _corpus(data: DataConfig, split: str, direction: Optional[str]) -> Corpus:
    """The corpus whose split `transformer evaluate --split` scores: the one named by `direction` (--direction), or
    the model's only one.

    Raises:
        ConfigError: no direction for a model of several, or one the model does not have.
    """
    held_out = [c for c in data.corpora if c.held_out]  # synthetic corpora have no test split
    found = [c for c in held_out if direction in (None, c.name)]
    if len(found) == 1:
        return found[0]
    names = ", ".join(c.name for c in held_out)
    if direction is None:
        raise ConfigError(
            f"evaluate: --split {split} of a model of several directions: give --direction, one of {names}"
        )
    raise ConfigError(
        f"evaluate: --direction {direction}: this model translates {names}, not {direction} (give one of them)"
    )


def write_results(json_path: str | Path, hypotheses: list[str], record: dict[str, Any]) -> Path:
    """Write the hypotheses (one per line) to JSON_PATH with the suffix .hyp.txt, then `record` with their path
    under "hypotheses" as JSON to `json_path`; each file whole or not at all (`files.write_file`).
    Returns the hypotheses' path.

    Raises:
        DataError: a file cannot be written (a full disk, a folder in the way), naming it.
    """
    json_path = Path(json_path)
    hyp_path = json_path.with_suffix(".hyp.txt")
    for path, text in (
        (hyp_path, "".join(h + "\n" for h in hypotheses)),
        (json_path, json.dumps({**record, "hypotheses": str(hyp_path)}, indent=2) + "\n"),
    ):
        data = text.encode("utf-8")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file(path, lambda f, data=data: f.write(data))
        except OSError as err:
            raise DataError(f"--json: cannot write {path}: {err.strerror or err}") from None
    return hyp_path


def report(
    scores: Scores,
    hypotheses: list[str],
    options: DecodingConfig,
    origin: str,
    json_path: Optional[str],
    **record: Any,
) -> None:
    """Print what `transformer evaluate` measured (BLEU and chrF with their signatures, the sentences and the
    search); with `json_path`, also write the hypotheses and a JSON of the scores, `record` (checkpoint, data,
    direction, tgt_lang, the engine's options) and the search (`write_results`).

    Raises:
        DataError: a file cannot be written (`write_results`).
    """
    # greedy search does not use it
    length_penalty = options.length_penalty if options.beam_size > 1 else None
    print(f"BLEU = {scores.bleu:.2f}  ({scores.bleu_signature})")
    print(f"chrF = {scores.chrf:.2f}  ({scores.chrf_signature})")
    print(
        f"{scores.n_sentences} sentences from {origin}; beam_size={options.beam_size}"
        + (f", length_penalty={length_penalty}" if length_penalty is not None else " (greedy)")
    )
    if json_path:
        record = {
            **scores.to_dict(),
            **record,
            "beam_size": options.beam_size,
            "length_penalty": length_penalty,
        }
        print(f"wrote {json_path} and {write_results(json_path, hypotheses, record)}")
