"""A run's test scores in one call: `transformer evaluate --run-dir RUN_DIR` (what `make evaluate` and the
evaluate step of `transformer chain` run).

1. the average of the run's last N step checkpoints (`--average-last`, 5; of as many as there are if fewer, said)
   is written to checkpoints/avg_lastN.pt;
2. best.pt and that average translate the test split (data.test_split) of each of the run's directions (its
   corpora with a test split: one for a bilingual run), greedy and with the run's beam search, into
   `eval_test_CKPT[_DIRECTION]_{greedy,beam}.json` (scores) and `.hyp.txt` (outputs), as `transformer evaluate
   --json` writes them;
3. a multilingual run also scores each `zero_shot` pair it never trained (e.g. de-fr), with best.pt: directly
   ("zero-shot", --tgt-lang TGT) and through the pivot language ("via en": SRC -> en -> TGT, both legs with the same
   search), into zero_shot/{zero,pivot}_best_SRC-TGT_{greedy,beam}.json, with the share of output lines written
   in each of the run's languages (`output_languages`); a pair the run trains, or whose legs it does not, is
   skipped, saying why;
4. scores.md: every score in one table (`scores_table`), written last and whole: a run with a scores.md has been
   evaluated (the rule `transformer chain` reads).

The run's directions, languages and data come from its config (`data.corpora`), read by the package.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from .config import Config, ConfigError, config_from_dict
from .config.languages import language_tokens
from .evaluate import corpus_scores, evaluation_data, report, translate_test_set
from .files import write_file
from .translate import Translator

SEARCHES = ("greedy", "beam")
WORD = re.compile(r"\w+", re.UNICODE)


def run_config(run_dir: str | Path) -> Config:
    """The config a run was trained with (RUN_DIR/config.yaml).

    Raises:
        ConfigError: RUN_DIR has no config.yaml (not a run folder) or it does not load.
    """
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(
            f"--run-dir {run_dir}: no config.yaml (not a run folder of `transformer train`)"
        )
    return config_from_dict(yaml.safe_load(path.read_text(encoding="utf-8")))


def run_directions(config: Config) -> list[str]:
    """The directions a run is scored in, "src-tgt": its corpora with a test split (one for a bilingual run)."""
    return [f"{c.src_lang}-{c.tgt_lang}" for c in config.data.corpora if c.held_out]


def evaluate_run(
    run_dir: str | Path,
    average_last: int = 5,
    zero_shot: tuple[str, ...] = (),
    overrides: tuple[str, ...] = (),
    pivot: str = "en",
    out: Callable[[str], None] = print,
) -> Path:
    """Score a run (module docstring) and return its scores.md.

    Args:
        average_last: step checkpoints to average (0: best.pt only).
        zero_shot: "src-tgt" pairs a multilingual run never trained, scored directly and through `pivot`.
        overrides: `data.KEY=VALUE` settings of the run's data section (e.g. data.path=DIR).

    Raises:
        ConfigError, CheckpointError, DataError: as `transformer evaluate`; no best.pt in the run.
    """
    from .training.average import average_to_file, step_checkpoints

    run_dir = Path(run_dir)
    config = run_config(run_dir)
    best = run_dir / "checkpoints" / "best.pt"
    if not best.is_file():
        raise ConfigError(
            f"--run-dir {run_dir}: no checkpoints/best.pt to evaluate (has the run validated?)"
        )
    checkpoints = {"best": best}
    n = min(len(step_checkpoints(run_dir)), average_last)
    if n:
        average = run_dir / "checkpoints" / f"avg_last{n}.pt"
        average_to_file(step_checkpoints(run_dir)[-n:], average)
        checkpoints[f"avg_last{n}"] = average
    if n < average_last:
        out(
            f"evaluate: {n} step checkpoints in {run_dir / 'checkpoints'}, fewer than --average-last "
            f"{average_last}: {f'avg_last{n}' if n else 'no average'} scored beside best.pt"
        )
    for name, path in checkpoints.items():
        translator = Translator.from_checkpoint(path)
        for corpus in (c for c in config.data.corpora if c.held_out):
            for search in SEARCHES:
                src, refs, tgt_lang, origin = evaluation_data(
                    translator.config, "test", None, None, list(overrides), str(path), corpus.name
                )
                _score(
                    translator,
                    path,
                    src,
                    refs,
                    tgt_lang,
                    origin,
                    search,
                    run_dir / f"eval_test_{name}{corpus.suffix}_{search}.json",
                    corpus.name,
                )
        del translator
    if zero_shot:
        score_zero_shot(run_dir, config, zero_shot, overrides, pivot, out)
    text = (
        f"test split BLEU / chrF (sacreBLEU) of {run_dir}, from its eval_test_*.json files\n\n"
        + scores_table(run_dir)
    )
    shot = zero_shot_table(run_dir)
    if shot:
        measured = any((run_dir / "zero_shot").glob("languages_*.jsonl"))
        text += (
            "\ndirections never trained, directly and through the pivot language (zero_shot/*.json"
            + (
                "; in brackets the share of output lines written in the target language"
                if measured
                else ""
            )
            + ")\n\n"
            + shot
        )
    scores = run_dir / "scores.md"
    data = text.encode("utf-8")
    write_file(scores, lambda f: f.write(data))
    out(text.rstrip("\n"))
    return scores


def _score(
    translator: Translator,
    checkpoint: Path,
    src: list[str],
    refs: list[list[str]],
    tgt_lang: str,
    origin: str,
    search: str,
    json_path: Path,
    direction: Optional[str] = None,
) -> list[str]:
    """What `transformer evaluate --json` does for one test set and search ("greedy" or "beam": the run's); the
    hypotheses."""
    options = _options(translator, tgt_lang, search)
    hyps = translate_test_set(translator, src, options)
    scores = corpus_scores(hyps, refs, options.target.code)
    report(
        scores,
        hyps,
        options.decoding,
        origin,
        str(json_path),
        checkpoint=str(checkpoint),
        data=origin,
        direction=direction,
        tgt_lang=options.target.code,
        quantization=None,
        compile=False,
        workers=1,
    )
    return hyps


def _options(translator: Translator, tgt_lang: str, search: str) -> Any:
    return translator.resolve_options(
        beam_size=1 if search == "greedy" else None, tgt_lang=tgt_lang, n_best=1
    )


def score_zero_shot(
    run_dir: Path,
    config: Config,
    pairs: tuple[str, ...],
    overrides: tuple[str, ...] = (),
    pivot: str = "en",
    out: Callable[[str], None] = print,
) -> None:
    """Step 3 of the module docstring: each pair of `pairs` with the run's best.pt, directly and through `pivot`,
    into RUN_DIR/zero_shot/; pairs it cannot score are skipped, saying why."""
    from .config import override_config
    from .data.text import read_lines

    if not language_tokens(config.data):
        out(
            f"zero-shot: {run_dir} is not a multilingual run (no data.directions, so no target-language "
            "tokens to ask for another language): nothing to score"
        )
        return
    data = override_config(config, list(overrides), sections=("data",), source=str(run_dir)).data
    trained = set(run_directions(config))
    folder = Path(data.path or "")
    split = data.test_split
    hyps, translator = [], None
    for pair in pairs:
        src, _, tgt = pair.partition("-")
        files = [folder / f"{split}.{lang}.gz" for lang in (src, tgt)]
        if pair in trained:
            out(f"zero-shot: {pair} is a trained direction of {run_dir}: skipped")
            continue
        if f"{src}-{pivot}" not in trained or f"{pivot}-{tgt}" not in trained:
            out(
                f"zero-shot: {pair}: {run_dir} does not train {src}-{pivot} and {pivot}-{tgt}: skipped"
            )
            continue
        if not all(f.is_file() for f in files):
            out(f"zero-shot: {pair}: no {files[0]} or {files[1]}: skipped")
            continue
        shot = run_dir / "zero_shot"
        shot.mkdir(parents=True, exist_ok=True)
        translator = translator or Translator.from_checkpoint(run_dir / "checkpoints" / "best.pt")
        source, refs = read_lines(str(files[0])), [read_lines(str(files[1]))]
        for search in SEARCHES:
            zero = shot / f"zero_best_{pair}_{search}.json"
            _score(
                translator,
                run_dir / "checkpoints" / "best.pt",
                source,
                refs,
                tgt,
                f"{files[0]} + {files[1]}",
                search,
                zero,
            )
            middle = shot / f"pivot_best_{src}-{pivot}_{search}.txt"
            legs = translate_test_set(translator, source, _options(translator, pivot, search))
            data = "".join(line + "\n" for line in legs).encode("utf-8")
            write_file(middle, lambda f, data=data: f.write(data))
            through = shot / f"pivot_best_{pair}_{search}.json"
            _score(
                translator,
                run_dir / "checkpoints" / "best.pt",
                legs,
                refs,
                tgt,
                f"{middle} + {files[1]}",
                search,
                through,
            )
            hyps += [zero.with_suffix(".hyp.txt"), through.with_suffix(".hyp.txt")]
    if hyps:
        from .data import DataError

        languages = list(dict.fromkeys(lang for d in trained for lang in d.split("-")))
        try:
            vocab = vocabularies(folder, languages, data.train_split)
        except DataError as err:  # the scores stand without the shares
            out(f"zero-shot: the output languages were not measured: {err}")
            return
        lines = "".join(json.dumps(output_languages(h, vocab)) + "\n" for h in hyps).encode("utf-8")
        write_file(run_dir / "zero_shot" / "languages_best.jsonl", lambda f: f.write(lines))


# ---- which language output lines are written in --------------------------------------------------------------------


def words(line: str) -> list[str]:
    """The lowercased words of a line (punctuation dropped)."""
    return WORD.findall(line.lower())


def vocabularies(data: Path, langs: list[str], split: str) -> dict[str, set[str]]:
    """Per language, the words of its `split` (DATA/{split}.{lang}[.gz]) seen at least twice (once-seen words are
    mostly names and typos, which the languages share).

    Raises:
        DataError: a language has no such file.
    """
    from .data import DataError
    from .data.text import read_lines

    vocab = {}
    for lang in langs:
        path = next(
            (p for p in (data / f"{split}.{lang}.gz", data / f"{split}.{lang}") if p.is_file()),
            None,
        )
        if path is None:
            raise DataError(
                f"no {split}.{lang}.gz or {split}.{lang} in {data}: the words of each language's training text "
                "tell the languages apart"
            )
        counts = Counter(w for line in read_lines(path) for w in words(line))
        vocab[lang] = {w for w, n in counts.items() if n >= 2}
    return vocab


def language_of(line: str, vocab: dict[str, set[str]]) -> str:
    """The language whose vocabulary knows the largest share of the line's words; "unknown" for ties and lines
    without a known word. On Multi30k's captions the four languages share few words, so the rule assigns each
    language's own test references to it on >= 99% of lines."""
    tokens = words(line)
    if not tokens:
        return "unknown"
    share = {lang: sum(t in known for t in tokens) / len(tokens) for lang, known in vocab.items()}
    top = max(share.values())
    winners = [lang for lang, value in share.items() if value == top]
    return winners[0] if top > 0 and len(winners) == 1 else "unknown"


def output_languages(path: str | Path, vocab: dict[str, set[str]]) -> dict:
    """{"hyp": path, "n_lines": n, "share": {language: share of lines}} of a file of output lines."""
    from .data.text import read_lines

    lines = read_lines(str(path))
    counts = Counter(language_of(line, vocab) for line in lines)
    langs = [*vocab, "unknown"]
    return {
        "hyp": str(path),
        "n_lines": len(lines),
        "share": {lang: round(counts[lang] / len(lines), 4) for lang in langs if counts[lang]},
    }


# ---- scores.md ----------------------------------------------------------------------------------------------------


def read_scores(
    run_dir: Path,
) -> tuple[list[str], list[str], dict[tuple[str, str, str], tuple[float, float]]]:
    """(directions, checkpoints, {(direction, checkpoint, search): (bleu, chrf)}) of the run's eval_test files."""
    directions = run_directions(run_config(run_dir))
    scores, checkpoints = {}, []
    for path in sorted(run_dir.glob("eval_test_*.json")):
        name, _, search = path.stem.removeprefix("eval_test_").rpartition("_")
        if search not in SEARCHES:
            continue
        record = json.loads(path.read_text(encoding="utf-8"))
        direction = record.get("direction") or directions[0]
        checkpoint = name.removesuffix(f"_{direction}")
        if checkpoint not in checkpoints:
            checkpoints.append(checkpoint)
        scores[direction, checkpoint, search] = (record["bleu"], record["chrf"])
    return directions, _in_order(checkpoints), scores


def _in_order(checkpoints: list[str]) -> list[str]:
    """best.pt's name first, then the others by name."""
    return sorted(checkpoints, key=lambda c: (c != "best", c))


def scores_table(run_dir: Path) -> str:
    """The Markdown table of `read_scores`: a row per direction and their mean, a column per
    checkpoint and search, each cell "BLEU / chrF"; a cell with no file is empty."""
    directions, checkpoints, scores = read_scores(Path(run_dir))
    columns = [(c, s) for c in checkpoints for s in SEARCHES]
    lines = [
        "| direction | " + " | ".join(f"{c} {s}" for c, s in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]

    def cell(value: Optional[tuple[float, ...]]) -> str:
        return "" if value is None else f"{value[0]:.2f} / {value[1]:.2f}"

    for direction in directions:
        lines.append(
            f"| {direction} | "
            + " | ".join(cell(scores.get((direction, c, s))) for c, s in columns)
            + " |"
        )
    means = []  # over the directions (a bilingual run's mean is its one row)
    for c, s in columns:
        values = [scores.get((d, c, s)) for d in directions]
        means.append(
            None
            if None in values
            else tuple(sum(v[i] for v in values) / len(values) for i in (0, 1))
        )
    lines.append("| mean | " + " | ".join(cell(m) for m in means) + " |")
    return "\n".join(lines) + "\n"


def zero_shot_table(run_dir: Path) -> str:
    """The Markdown table of RUN_DIR/zero_shot/{zero,pivot}_CKPT_SRC-TGT_{greedy,beam}.json, each cell with the
    share of lines in the target language where it was measured (languages_CKPT.jsonl); "" if there are none."""
    folder, rows, scores, checkpoints = Path(run_dir) / "zero_shot", [], {}, []
    shares = {}  # hypotheses file name -> {language: share of lines}
    for path in sorted(folder.glob("languages_*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            shares[Path(record["hyp"]).name] = record["share"]
    for path in sorted(folder.glob("*.json")):
        rest, _, search = path.stem.rpartition("_")
        rest, _, pair = rest.rpartition("_")
        kind, _, checkpoint = rest.partition("_")
        if search not in SEARCHES or kind not in ("zero", "pivot") or "-" not in pair:
            continue
        record = json.loads(path.read_text(encoding="utf-8"))
        tgt = pair.split("-")[1]
        share = shares.get(path.with_suffix(".hyp.txt").name, {}).get(tgt)
        pivot = re.search(r"pivot_.*_[^_-]+-([^_-]+)_(?:greedy|beam)\.txt", record.get("data", ""))
        label = (
            f"{pair} zero-shot"
            if kind == "zero"
            else f"{pair} via {pivot.group(1) if pivot else 'the pivot'}"
        )
        if label not in rows:
            rows.append(label)
        if checkpoint not in checkpoints:
            checkpoints.append(checkpoint)
        scores[label, checkpoint, search] = (record["bleu"], record["chrf"], share, tgt)
    if not rows:
        return ""
    columns = [(c, s) for c in _in_order(checkpoints) for s in SEARCHES]
    lines = [
        "| direction (never trained) | " + " | ".join(f"{c} {s}" for c, s in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]

    def cell(value: Optional[tuple]) -> str:
        if value is None:
            return ""
        bleu, chrf, share, tgt = value
        return f"{bleu:.2f} / {chrf:.2f}" + ("" if share is None else f" ({share:.0%} {tgt})")

    for label in sorted(rows):
        lines.append(
            f"| {label} | " + " | ".join(cell(scores.get((label, c, s))) for c, s in columns) + " |"
        )
    return "\n".join(lines) + "\n"
