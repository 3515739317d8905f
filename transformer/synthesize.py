"""A parallel corpus made by a model: every sentence of monolingual text with its translation (`transformer
synthesize`), for back-translation (Sennrich et al. 2016: the target-language text of a task translated into the
source language by a reverse model, trained on as extra pairs) and for distillation (a teacher's translations of
the training sources, Kim & Rush 2016).

    transformer synthesize --checkpoint runs/multi30k_en_de/checkpoints/best.pt \\
        --input ../shared/data/multi30k_task2/train.{1,2,3,4,5}.en.gz --output runs/bt/task2_en_de --sampling

The job, in order:

1. read the inputs, strip each line, and drop the empty lines, the repeats of a line already read and the lines of
   the `exclude` files (the parallel corpus's own side in that language: pairs the run has already), each counted;
2. translate the rest in chunks of `chunk_lines`, with a progress bar (sentences/s, time left); each chunk's
   translations are appended to the work folder `.OUTPUT.work` beside the output, and the number of lines done is
   written whole after them (`progress.json`), so that a job stopped anyhow (Ctrl-C, SIGTERM, a crash) and started
   again with the same command goes on after its last complete chunk (the same inputs, model and options are
   checked; a work folder of another job is refused);
3. filter the pairs (`filter_pairs`): an empty translation, a copy of its source, a length ratio beyond
   `max_length_ratio`, or a translation cut at the length cap (a loop the search did not end) is dropped, each
   reason counted;
4. write `OUTPUT/train.{input_lang}.gz` and `OUTPUT/train.{output_lang}.gz` (line i of one is the translation of
   line i of the other) and `OUTPUT/origin.json`: the model (path and SHA-256), the search, the date and the counts;
   the folder is renamed into place when complete (an earlier corpus in its place is replaced only then; any
   other file or folder there is refused before any work: `check_output`), and the work folder removed.

A run uses the folder as a corpus of `data.synthetic` (`config/sections.py: SyntheticCorpusConfig`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from .data import DataError, LineReader
from .decoding.options import warn_length_cap
from .files import sha256_of, write_file, write_folder
from .request import ResolvedOptions
from .translate import Translator

logger = logging.getLogger(__name__)

WORK_SUFFIX = ".work"
"""The work folder of output DIR is .DIR.work beside it: the job's translations while it runs."""


def work_folder(output: str | Path) -> Path:
    """The work folder of a job writing `output`: .OUTPUT.work beside it."""
    output = Path(output)
    return output.parent / f".{output.name}{WORK_SUFFIX}"


@dataclass
class SynthesisCounts:
    """What a job read, kept and dropped (lines)."""

    read: int = 0
    empty: int = 0
    duplicate: int = 0
    excluded: int = 0
    """Lines found in the `exclude` files."""
    translated: int = 0
    truncated: int = 0
    """Lines longer than the model reads (`model.max_positions`): translated from their start."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Per reason of `filter_pairs`, the pairs dropped."""
    kept: int = 0


def check_output(output: Path) -> None:
    """Refuse, before any work, an output that is not a corpus folder this command may write: a file, or a folder
    with files that an earlier `transformer synthesize` did not write (no origin.json). An earlier corpus is
    replaced once the new one is whole; nothing else is deleted.

    Raises:
        DataError: naming the path and what to do.
    """
    if output.is_file() or (output.exists() and not output.is_dir()):
        raise DataError(f"--output {output}: a file, not a corpus folder: choose another --output")
    if output.is_dir() and any(output.iterdir()) and not (output / "origin.json").is_file():
        raise DataError(
            f"--output {output}: a folder that `transformer synthesize` did not write (no origin.json): choose "
            "another --output, or empty it"
        )


def unique_lines(
    paths: list[str],
    counts: SynthesisCounts,
    exclude: Optional[set[str]] = None,
    max_lines: int = 0,
) -> list[str]:
    """The stripped lines of the files, in order, without empty lines, repeats and lines of `exclude` (counted in
    `counts`); with `max_lines`, the first that many (the files read no further).

    Raises:
        DataError: a file cannot be read (missing, invalid UTF-8), naming it and the line.
    """
    seen: set[str] = set()
    out = []
    for path in paths:
        with LineReader(path) as reader:
            while chunk := reader.read(10_000):
                for line in chunk:
                    counts.read += 1
                    line = line.strip()
                    if not line:
                        counts.empty += 1
                    elif line in seen:
                        counts.duplicate += 1
                    elif exclude and line in exclude:
                        counts.excluded += 1
                        seen.add(line)
                    else:
                        seen.add(line)
                        out.append(line)
                        if len(out) == max_lines:
                            return out
    return out


def filter_pairs(
    sources: list[str], translations: list[str], finished: list[bool], max_length_ratio: float
) -> tuple[list[int], dict[str, int]]:
    """Which pairs to keep, and how many were dropped for each reason, the first that applies:

    - "empty": the translation is empty;
    - "copy": the translation is its source (case and spaces aside): the model did not translate;
    - "length_ratio": one side has more than `max_length_ratio` times the other's words;
    - "length_cap": the translation was cut at the length cap (no eos: a loop the search did not end).

    Returns:
        (indices kept, in order; {reason: pairs dropped}).
    """
    dropped = {"empty": 0, "copy": 0, "length_ratio": 0, "length_cap": 0}
    kept = []
    for i, (source, translation, ended) in enumerate(zip(sources, translations, finished)):
        n_src, n_tgt = len(source.split()), len(translation.split())
        if not n_tgt:
            reason = "empty"
        elif " ".join(translation.split()).casefold() == " ".join(source.split()).casefold():
            reason = "copy"
        elif max(n_src, n_tgt) > max_length_ratio * min(n_src, n_tgt):
            reason = "length_ratio"
        elif not ended:
            reason = "length_cap"
        else:
            kept.append(i)
            continue
        dropped[reason] += 1
    return kept, dropped


def synthesize(
    translator: Translator,
    inputs: list[str],
    output: str | Path,
    options: ResolvedOptions,
    checkpoints: list[str],
    input_lang: str,
    chunk_lines: int = 2000,
    max_length_ratio: float = 3.0,
    progress: bool = True,
    exclude: tuple[str, ...] = (),
    max_lines: int = 0,
) -> tuple[Path, SynthesisCounts]:
    """Translate the unique lines of `inputs` into a filtered parallel corpus in `output` (module docstring): checks
    the output (`check_output`), reads the job (`read_job`), translates it (`translate_job`), writes the corpus
    (`write_corpus`).

    Args:
        options: the search (`Translator.resolve_options`; one hypothesis per line).
        checkpoints: the model's paths, recorded with their SHA-256 in origin.json.
        input_lang: the language of the inputs (the model's source language).
        chunk_lines: lines translated between two saves of the progress.
        exclude: files whose lines are not translated (the parallel corpus's side in the inputs' language).
        max_lines: translate only the first this many unique lines (0: all), e.g. to try a chain at toy scale.

    Returns:
        (the output folder, the counts).

    Raises:
        DataError: an input cannot be read, or `output` holds the work of another job (other inputs, model or
            options): remove it or choose another folder.
        KeyboardInterrupt: the job was interrupted; started again, it goes on after its last complete chunk.
    """
    output = Path(output)
    check_output(output)
    job = read_job(inputs, exclude, options, checkpoints, input_lang, max_lines)
    translations, ends = translate_job(
        translator, job, options, work_folder(output), chunk_lines, progress
    )
    counts = write_corpus(output, job, translations, ends, max_length_ratio, _describe(options))
    shutil.rmtree(work_folder(output))
    return output, counts


@dataclass
class SynthesisJob:
    """What a job translates (step 1 of the module docstring): the unique lines, the counts of what was left out,
    and the job's identity (`identity`: inputs, model, search, languages), which a stopped job's work folder must
    match to go on."""

    lines: list[str]
    counts: SynthesisCounts
    identity: dict[str, Any]


def read_job(
    inputs: list[str],
    exclude: tuple[str, ...],
    options: ResolvedOptions,
    checkpoints: list[str],
    input_lang: str,
    max_lines: int = 0,
) -> SynthesisJob:
    """Step 1: the unique lines of `inputs` less those of `exclude`, and the job's identity.

    Raises:
        DataError: a file cannot be read, naming it and the line.
    """
    counts = SynthesisCounts()
    excluded = set(unique_lines(list(exclude), SynthesisCounts()))
    lines = unique_lines(inputs, counts, excluded, max_lines)
    identity = {  # max_lines is in lines_sha256
        "inputs": [str(Path(p).resolve()) for p in inputs],
        "exclude": [str(Path(p).resolve()) for p in exclude],
        "lines_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
        "model": [
            {"path": str(Path(c).resolve()), "sha256": sha256_of(Path(c))} for c in checkpoints
        ],
        "search": dataclasses.asdict(options.decoding),
        "input_lang": input_lang,
        "output_lang": options.target.code,
    }
    return SynthesisJob(lines, counts, identity)


def translate_job(
    translator: Translator,
    job: SynthesisJob,
    options: ResolvedOptions,
    work: Path,
    chunk_lines: int,
    progress: bool,
) -> tuple[list[str], list[bool]]:
    """Step 2: the translations of the job's lines and whether each ended with eos, chunk by chunk, each chunk saved
    in `work` before the next (a stopped job goes on after its last complete chunk).

    Raises:
        DataError: `work` holds another job's translations.
        KeyboardInterrupt: interrupted; what was saved stays.
    """
    lines = job.lines
    translations, ends, done, job.counts.truncated = _resume(work, job.identity)
    search = _describe(options)
    logger.info(
        "synthesize: %d lines read, %d unique (%d empty, %d repeats dropped); %s; %d done before",
        job.counts.read,
        len(lines),
        job.counts.empty,
        job.counts.duplicate,
        search,
        done,
    )
    with (
        open(work / "translations.txt", "a", encoding="utf-8") as out,
        open(work / "finished.txt", "a", encoding="utf-8") as out_ends,
        tqdm(
            total=len(lines),
            initial=done,
            unit="sent",
            desc=f"synthesize ({search})",
            file=sys.stderr,
            disable=not progress or not sys.stderr.isatty(),
        ) as bar,
    ):
        began = time.monotonic()
        for start in range(done, len(lines), chunk_lines):
            chunk = lines[start : start + chunk_lines]
            with _quiet(cap_logger):  # said once for the whole job below, not once per chunk
                result = translator.run(translator.request(chunk, options), scores=False)
            texts = [
                " ".join(t.split()) for t in result.texts
            ]  # one line each, whatever the model wrote
            out.write("".join(t + "\n" for t in texts))
            out_ends.write("".join(("1" if hyps[0] else "0") + "\n" for hyps in result.finished))
            for f in (out, out_ends):
                f.flush()
            translations += texts
            ends += [hyps[0] for hyps in result.finished]
            job.counts.truncated += len(result.truncated)
            _save_progress(work, job.identity, start + len(chunk), job.counts.truncated)
            bar.update(len(chunk))
            if (
                progress and bar.disable
            ):  # redirected: a plain line per chunk instead of a bar's redraws
                _progress_line(start + len(chunk) - done, start + len(chunk), len(lines), began)
    warn_length_cap(sum(not ended for ended in ends), len(ends), options.decoding)
    if job.counts.truncated:
        logger.warning(
            "synthesize: %d lines longer than the model reads (model.max_positions=%d tokens) were translated from "
            "their start (counted in origin.json)",
            job.counts.truncated,
            translator.engine.max_source_len,
        )
    return translations, ends


def write_corpus(
    output: Path,
    job: SynthesisJob,
    translations: list[str],
    ends: list[bool],
    max_length_ratio: float,
    search: str,
) -> SynthesisCounts:
    """Steps 3 and 4: filter the pairs (`filter_pairs`) and write the corpus folder with its origin.json, whole or
    not at all (an earlier corpus in its place stays until this one is complete); the counts."""
    counts = job.counts
    counts.translated = len(translations)
    kept, counts.dropped = filter_pairs(job.lines, translations, ends, max_length_ratio)
    counts.kept = len(kept)
    origin = {
        **job.identity,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "search_name": search,
        "max_length_ratio": max_length_ratio,
        "counts": dataclasses.asdict(counts),
    }
    sides = ((job.identity["input_lang"], job.lines), (job.identity["output_lang"], translations))

    def write(folder: Path) -> None:
        for lang, side in sides:
            with gzip.open(
                folder / f"train.{lang}.gz", "wt", encoding="utf-8", compresslevel=6
            ) as f:
                f.writelines(side[i] + "\n" for i in kept)
        (folder / "origin.json").write_text(json.dumps(origin, indent=2) + "\n", encoding="utf-8")

    write_folder(output, write)
    return counts


def _progress_line(translated: int, done: int, total: int, began: float) -> None:
    """One line on stderr: lines done, their rate in this process and the time left at that rate."""
    rate = translated / max(time.monotonic() - began, 1e-9)
    left = (total - done) / rate if rate else 0.0
    print(
        f"synthesize: {done} of {total} lines ({done / total:.0%}), {rate:.0f} sentences/s, "
        f"{left / 60:.1f} min left",
        file=sys.stderr,
        flush=True,
    )


cap_logger = logging.getLogger(warn_length_cap.__module__)


@contextlib.contextmanager
def _quiet(log: logging.Logger) -> Iterator[None]:
    """`log`'s warnings left out while the block runs."""
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _describe(options: ResolvedOptions) -> str:
    """The search as one phrase: "beam 4", "greedy", "sampling, top-k 10, temperature 1"."""
    d = options.decoding
    if d.sampling:
        parts = (
            ["sampling"]
            + ([f"top-k {d.top_k}"] if d.top_k else [])
            + ([f"top-p {d.top_p:g}"] if d.top_p < 1 else [])
            + [f"temperature {d.temperature:g}"]
        )
        return ", ".join(parts)
    return "greedy" if d.beam_size == 1 else f"beam {d.beam_size}"


def _resume(work: Path, job: dict[str, Any]) -> tuple[list[str], list[bool], int, int]:
    """The translations and finished flags a stopped job of `job` left in `work`, cut to its last complete chunk,
    the lines done and how many of them were cut at the model's length; an empty start when there is none.

    Raises:
        DataError: `work` holds another job's translations.
    """
    progress = work / "progress.json"
    if not progress.exists():
        work.mkdir(parents=True, exist_ok=True)
        for name in ("translations.txt", "finished.txt"):
            (work / name).write_text("", encoding="utf-8")
        return [], [], 0, 0
    saved = json.loads(progress.read_text(encoding="utf-8"))
    if saved.get("job") != job:
        raise DataError(
            f"{work} holds a stopped job with other inputs, model or options: run that job again to "
            "finish it, or remove the folder to start this one"
        )
    done = int(saved["done"])
    translations = (work / "translations.txt").read_text(encoding="utf-8").split("\n")[:done]
    ends = [
        line == "1"
        for line in (work / "finished.txt").read_text(encoding="utf-8").split("\n")[:done]
    ]
    if len(translations) < done or len(ends) < done:
        raise DataError(
            f"{work}: {done} lines done but fewer saved: remove the folder to start again"
        )
    for name, rows in (
        ("translations.txt", translations),
        ("finished.txt", ["1" if e else "0" for e in ends]),
    ):
        (work / name).write_text(
            "".join(r + "\n" for r in rows), encoding="utf-8"
        )  # a chunk past `done` dropped
    return translations, ends, done, int(saved.get("truncated", 0))


def _save_progress(work: Path, job: dict[str, Any], done: int, truncated: int) -> None:
    data = (json.dumps({"job": job, "done": done, "truncated": truncated}) + "\n").encode()
    write_file(work / "progress.json", lambda f: f.write(data))
