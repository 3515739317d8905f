"""The `transformer` command: train, prepare, chain, average, translate, evaluate, synthesize, export, attention, plot,
serve.

Each subcommand is one entry of `COMMANDS`: its help, the function that declares its flags (placed just above the
`cmd_*` function that reads them) and that function. User mistakes (bad config, data, checkpoint, device,
decoding option or plot option: the exceptions in `USER_ERRORS`) print one line on stderr and exit with status 2;
anything else is a bug and keeps its traceback. Ctrl-C prints one line and exits with status 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from .attention_plot import AttentionPlotError
from .checkpoint import CheckpointError
from .config import ConfigError, OptionError, load_config
from .ct2 import QUANTIZATIONS, ExportError
from .data import DataError, LineReader, count_lines
from .data.text import TranslationOutput, input_chunks, is_streaming, silence_stdout
from .decoding.alignment import pharaoh
from .decoding.options import option_fields
from .device import DeviceError, reuse_freed_memory
from .tokenizer import TokenizerError

logger = logging.getLogger("transformer")

USER_ERRORS = (
    ConfigError,
    DataError,
    TokenizerError,
    CheckpointError,
    DeviceError,
    AttentionPlotError,
    ExportError,
)


def _add_decoding_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """A flag per field of `DecodingConfig` but those in `exclude` (--beam-size for beam_size, --no-copy-unknown for
    a switch that is on by default); unset flags are None and take the checkpoint config's values."""
    group = parser.add_argument_group(
        "decoding (defaults: the checkpoint config's decoding section)"
    )
    for option in option_fields(exclude):
        flag, text, metavar = (
            "--" + option.name.replace("_", "-"),
            option.metadata["help"],
            option.metadata["metavar"],
        )
        # int, float, bool, Optional[str]
        kind = option.type if isinstance(option.type, str) else option.type.__name__
        if kind == "bool" and option.default:
            group.add_argument(
                flag.replace("--", "--no-"),
                dest=option.name,
                action="store_const",
                const=False,
                help=f"turn off (on by default): {text}",
            )
        elif kind == "bool":
            group.add_argument(flag, action="store_const", const=True, help=text)
        else:
            group.add_argument(
                flag,
                type={"int": int, "float": float, "Optional[str]": str}[kind],
                metavar=metavar,
                help=text,
            )


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps or auto")
    group.add_argument(
        "--quantization",
        choices=["int8"],
        help="int8: decode with int8 dynamically quantized linear layers (CPU; docs/decoding.md)",
    )
    group.add_argument(
        "--workers",
        type=int,
        default=1,
        help="batches decoded at once, each on the CPU threads "
        "divided by this (CPU; 2 on 2 cores decodes a file faster, see docs/decoding.md)",
    )
    group.add_argument(
        "--compile",
        action="store_true",
        help="decode with the decoder step compiled by torch.compile: "
        "faster after a one-time compile of 20-60 s (CPU, float32; needs a C++ compiler)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transformer", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    # -v also after the subcommand (transformer translate -v ...); SUPPRESS keeps the top-level value when absent
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging"
    )

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[verbose])

    for name, (help, add_flags, _) in COMMANDS.items():
        add_flags(command(name, help))
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        return f"{version('transformer-nmt')} (torch {torch.__version__})"
    except PackageNotFoundError:
        return "(not installed as a package)"


def _decoding_kwargs(args: argparse.Namespace) -> dict:
    """The decoding flags given (None for those not given), n_best aside (translate reads it itself)."""
    return {
        option.name: getattr(args, option.name)
        for option in option_fields(("n_best",))
        if hasattr(args, option.name)
    }


def _as_typed(err: Exception, command: str) -> str:
    """A user error in the flags the user typed: a library call's parameters (`OptionError`) as flags, and in
    translate, evaluate and attention a decoding option (decoding.n_best) as its flag (--n-best)."""
    if isinstance(err, OptionError):
        return err.as_flags()
    key = getattr(err, "key", None) or ""
    if command in ("translate", "evaluate", "attention") and key.startswith("decoding."):
        return f"--{key.removeprefix('decoding.').replace('_', '-')}: {err.detail}"
    return str(err)


def _train_flags(train: argparse.ArgumentParser) -> None:
    """`transformer train`'s flags, read by `cmd_train` below."""
    train.add_argument(
        "--config",
        help="YAML recipe, e.g. configs/multi30k_de_en.yaml (with --resume: by default the run's own config.yaml)",
    )
    train.add_argument("--run-dir", help="output folder (default: runs/<config name>)")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value, e.g. --set training.max_steps=200 (repeatable)",
    )
    train.add_argument(
        "--resume", action="store_true", help="continue from RUN_DIR/checkpoints/last.pt"
    )
    train.add_argument(
        "--init-from",
        metavar="SOURCE",
        help="fine-tune: start from the weights and tokenizer of "
        "this checkpoint (.pt) or MarianMT folder; the model's keys come from it",
    )


def cmd_train(args: argparse.Namespace) -> int:
    from .training.distributed import shutdown_distributed
    from .training.init_from import run_config
    from .training.stop import NonFiniteLossError, TrainingInterrupted
    from .training.trainer import train

    if (
        not args.config
    ):  # --resume of a run folder: its own config.yaml, whatever command started it
        if not (args.resume and args.run_dir):
            raise ConfigError(
                "train: give --config RECIPE, or --resume --run-dir RUN to continue a run as it was started"
            )
        args.config = str(Path(args.run_dir) / "config.yaml")
        if not Path(args.config).is_file():
            raise ConfigError(
                f"--resume --run-dir {args.run_dir}: no config.yaml there (not a training run)"
            )
    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    config, source = run_config(args.config, args.set, run_dir, args.init_from, args.resume)
    finished = False
    try:
        state = train(config, run_dir, resume=args.resume, init=source)
        finished = True
    except TrainingInterrupted as stop:
        print(f"\n{stop}", file=sys.stderr)
        return 130
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed(finished)
    if args.is_main_process:
        print(
            f"done: {state.step} steps, best validation BLEU {state.best_bleu:.2f}; "
            f"checkpoints in {run_dir / 'checkpoints'}"
        )
    return 0


def _prepare_flags(prepare: argparse.ArgumentParser) -> None:
    """`transformer prepare`'s flags, read by `cmd_prepare` below."""
    prepare.add_argument("--config", required=True, help="YAML recipe, the same as for train")
    prepare.add_argument(
        "--run-dir", help="run folder for the tokenizer (default: runs/<config name>)"
    )
    prepare.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="as for train"
    )


def cmd_prepare(args: argparse.Namespace) -> int:
    from .training.data import prepare_data
    from .training.init_from import with_absolute_data_path

    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    _, train, valid = prepare_data(
        with_absolute_data_path(load_config(args.config, args.set)), run_dir
    )
    models = ", ".join(str(p) for p in sorted(run_dir.glob("spm*.model")))
    n_train = sum(map(len, train))  # a token cache per corpus
    print(
        f"prepared {run_dir}: tokenizer {models}, {n_train} training pairs in the token cache, "
        f"{len(valid.references)} validation pairs; `transformer train` with the same --config, --run-dir and "
        "--set finds both"
    )
    return 0


def _average_flags(average: argparse.ArgumentParser) -> None:
    """`transformer average`'s flags, read by `cmd_average` below."""
    inputs = average.add_mutually_exclusive_group(required=True)
    inputs.add_argument(
        "--checkpoints", nargs="+", metavar="CKPT", help="the checkpoints to average"
    )
    inputs.add_argument(
        "--run-dir",
        help="average the --last N step checkpoints (checkpoints/step_N.pt) of this run",
    )
    average.add_argument(
        "--last", type=int, default=5, help="with --run-dir: how many (default 5, the paper's)"
    )
    average.add_argument(
        "--output", required=True, help="the averaged checkpoint (.pt; replaces an earlier average)"
    )


def cmd_average(args: argparse.Namespace) -> int:
    from .training.average import average_to_file, last_checkpoints

    paths = args.checkpoints or last_checkpoints(args.run_dir, args.last)
    averaged = average_to_file(paths, args.output)
    print(
        f"wrote {args.output}: the average of {len(paths)} checkpoint{'s' if len(paths) != 1 else ''} "
        f"({', '.join(str(p) for p in paths)}); step {averaged['train_state'].get('step', '?')}"
    )
    return 0


def _note_compile(args: argparse.Namespace) -> None:
    """With --compile, say on stderr why the first batch takes long (nothing is printed while Inductor compiles)."""
    if args.compile:
        print(
            "--compile: compiling the decoding step at the first batch (about 20-60 s, once per process for "
            "greedy and once for beam search)",
            file=sys.stderr,
            flush=True,
        )


def _translate_flags(translate: argparse.ArgumentParser) -> None:
    """`transformer translate`'s flags, read by `cmd_translate` below."""
    translate.add_argument(
        "--checkpoint",
        required=True,
        action="append",
        help="a .pt checkpoint (e.g. "
        "RUN/checkpoints/best.pt), a folder written by `transformer export` (decoded with "
        "CTranslate2) or a MarianMT folder; repeated (--checkpoint A --checkpoint B): an ensemble",
    )
    translate.add_argument(
        "sentences", nargs="*", help="sentences to translate; none: read lines from --input/stdin"
    )
    translate.add_argument("--input", help="file with one sentence per line (default: stdin)")
    translate.add_argument("--output", help="write translations here (default: stdout)")
    translate.add_argument(
        "--alignment",
        action="store_true",
        help="after each translation a TAB and its word "
        "alignment: Pharaoh i-j pairs (source word i, target word j), from the last layer",
    )
    translate.add_argument(
        "--prefix-file",
        help="one target prefix per input line (empty: none); each translation "
        "starts with its prefix, then goes on freely",
    )
    translate.add_argument(
        "--buffer-size",
        type=int,
        default=1000,
        help="lines read, decoded (sorted by length) "
        "and written at a time (default 1000); typed input is translated line by line",
    )
    _add_decoding_flags(translate)
    _add_engine_flags(translate)


def cmd_translate(args: argparse.Namespace) -> int:
    """Translate chunk by chunk: each chunk is decoded in length-sorted batches, written back in input order and
    flushed before the next is read, so typed lines come back one by one and files of any size use bounded memory."""
    from .request import WrittenLanguageError, read_sentences, written_runs
    from .translate import Translator

    if args.buffer_size < 1:
        raise ConfigError(f"--buffer-size must be at least 1, got {args.buffer_size}")
    _check_translate_inputs(args)
    translator = Translator.from_checkpoint(
        args.checkpoint,
        device=args.device,
        quantization=args.quantization,
        workers=args.workers,
        compile=args.compile,
    )
    n_best = args.n_best or 1
    kwargs = {**_decoding_kwargs(args), "n_best": n_best}
    # Bad options fail before any input is read. With --tgt-lang the options are resolved once, here; without it
    # each run of lines that name the same language (>>fra<< at their start, or none) resolves its own below.
    chosen = kwargs.get("tgt_lang") is not None
    fixed = translator.resolve_options(**kwargs) if chosen else None
    translator.check_options(**{**kwargs, "tgt_lang": None})
    if args.alignment and translator.engine.attention_model is None:
        raise ConfigError(
            f"--alignment reads our model's attention; a {translator.engine.name} model has none"
        )
    _note_compile(args)
    if args.prefix_file and (args.sentences or args.input):  # a mismatch fails before any output
        n_input = len(args.sentences) if args.sentences else count_lines(args.input)
        if count_lines(args.prefix_file) != n_input:
            raise DataError(
                f"--prefix-file {args.prefix_file}: {count_lines(args.prefix_file)} lines, the input "
                f"{n_input}: give one prefix line (empty for none) per input line"
            )
    prefix_reader = LineReader(args.prefix_file) if args.prefix_file else None
    out, index, complete = TranslationOutput(args.output), 0, False
    try:
        show = bool(args.output) or not sys.stdout.isatty()
        growing = not args.output and is_streaming(sys.stdout)
        for lines in input_chunks(
            args.sentences, args.input, args.buffer_size, show, growing=growing
        ):
            prefixes = prefix_reader.read(len(lines)) if prefix_reader else None
            if prefixes is not None and len(prefixes) < len(lines):
                raise DataError(
                    f"--prefix-file {args.prefix_file}: {prefix_reader.lines_read} lines, the input at "
                    f"least {index + len(lines)}: give one prefix line (empty for none) per input line"
                )
            read = read_sentences(lines)  # each line's written >>fra<< read once
            runs = [(0, len(read))] if chosen else written_runs(read, translator.languages)
            for start, end in runs:
                run_lines = read[start:end]
                run_prefixes = prefixes[start:end] if prefixes is not None else None
                try:
                    run_options = fixed or translator.resolve_options(run_lines, **kwargs)
                    request = translator.request(run_lines, run_options, run_prefixes)
                # a line starting with another language's token than tgt_lang: name the line
                except WrittenLanguageError as err:
                    raise ConfigError(
                        str(err), err.key, f"input line {index + err.sentence + 1}: {err.detail}"
                    ) from None
                except (
                    ConfigError
                ) as err:  # a run of lines without a language of its own: name its line
                    if isinstance(err, OptionError):
                        raise
                    raise ConfigError(
                        f"input line {index + 1}: {err}",
                        err.key,
                        f"input line {index + 1}: {err.detail}",
                    ) from None
                result = translator.run(request, scores=bool(args.n_best))
                _warn_translation(translator, result, index)
                out.write(
                    "".join(_output_lines(translator, request, result, index, args)), len(run_lines)
                )
                index += len(run_lines)
        if prefix_reader and prefix_reader.read(1):
            raise DataError(
                f"--prefix-file {args.prefix_file}: {count_lines(args.prefix_file)} lines, the input "
                f"{index}: give one prefix line (empty for none) per input line"
            )
        complete = True
    finally:
        if prefix_reader:
            prefix_reader.close()
        out.close(complete)
    return 0


def _warn_translation(translator: Any, result: Any, index: int) -> None:
    """Log the lines (numbered from `index` + 1) whose translation is empty or whose start only was translated."""
    for i in result.empty:
        logger.warning(
            "line %d: the translation is empty (the model ended it at once)", index + i + 1
        )
    for i in result.truncated:
        logger.warning(
            "line %d has more than the model's max_positions=%d tokens: its first %d translated",
            index + i + 1,
            translator.engine.max_source_len,
            translator.engine.max_source_len - 1,
        )


def _output_lines(
    translator: Any, request: Any, result: Any, index: int, args: argparse.Namespace
) -> list[str]:
    """The output lines of one chunk of input lines (the first numbered `index`): the best translation of each, or
    with --n-best its K lines `index<TAB>score<TAB>text<TAB>end`; with --alignment each text followed by a TAB and
    its word alignment (Pharaoh format) with the source as translated."""
    lines = []
    for i, (hyps, ends) in enumerate(zip(result.n_best, result.finished)):
        texts = [text for text, _ in hyps]
        if args.alignment:
            pairs = translator.align(request.take([i] * len(texts)), texts)
            texts = [f"{t}\t{pharaoh(p)}" for t, p in zip(texts, pairs)]
        lines += (
            [
                f"{index + i}\t{score:.4f}\t{t}\t{'eos' if end else 'cut'}\n"
                for t, (_, score), end in zip(texts, hyps, ends)
            ]
            if args.n_best
            else [texts[0] + "\n"]
        )
    return lines


def _is_model_path(sentence: str) -> bool:
    """Whether a sentence argument names a checkpoint file or a model folder that exists (a sentence too long to be
    a file name, or with a NUL, is a sentence)."""
    try:
        return (
            bool(sentence.strip())
            and (sentence.endswith(".pt") or Path(sentence).is_dir())
            and Path(sentence).exists()
        )
    except (OSError, ValueError):  # a name longer than the system takes, or with a NUL byte
        return False


def _check_translate_inputs(args: argparse.Namespace) -> None:
    """Refuse inputs given twice or a checkpoint given as a sentence, and an --output that is the --input."""
    paths = [s for s in args.sentences[:8] if _is_model_path(s)]
    hint = (
        f"; for an ensemble, repeat the flag: --checkpoint {args.checkpoint[-1]} --checkpoint {paths[0]}"
        if paths
        else ""
    )
    if args.sentences and args.input:
        raise ConfigError(
            f"sentences given as arguments ({len(args.sentences)}) and --input {args.input}: give one "
            f"or the other{hint}"
        )
    if paths:
        raise ConfigError(f"the sentence argument {paths[0]} is a model, not a sentence{hint}")
    if (
        args.output
        and args.input
        and Path(args.output).exists()
        and Path(args.input).exists()
        and Path(args.output).samefile(args.input)
    ):
        raise ConfigError(
            f"--output {args.output} is the --input file: writing would empty it before it is read"
        )


def _evaluate_flags(evaluate: argparse.ArgumentParser) -> None:
    """`transformer evaluate`'s flags, read by `cmd_evaluate` below."""
    evaluate.add_argument("--checkpoint", action="append", help="as translate's")
    evaluate.add_argument(
        "--run-dir",
        help="instead of --checkpoint: score a whole run: best.pt and the average of its last step checkpoints, "
        "greedy and beam, each direction, into RUN_DIR/eval_test_*.json and RUN_DIR/scores.md (run_scores.py)",
    )
    evaluate.add_argument(
        "--average-last",
        type=int,
        default=5,
        metavar="N",
        help="with --run-dir: the step checkpoints averaged (default 5; 0: best.pt only)",
    )
    evaluate.add_argument(
        "--zero-shot",
        nargs="*",
        default=[],
        metavar="SRC-TGT",
        help="with --run-dir of a multilingual run: pairs it never trained, scored directly and through English",
    )
    evaluate.add_argument("--src", help="source file (plain or .gz), one sentence per line")
    evaluate.add_argument(
        "--ref",
        nargs="+",
        metavar="REF",
        help="reference file(s), aligned with --src; several are scored as sacrebleu scores them",
    )
    evaluate.add_argument(
        "--split",
        help="a split of the checkpoint's data section instead of --src/--ref: "
        "'test' and 'valid' name data.test_split and data.valid_split; any other name is used as is",
    )
    evaluate.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="data.KEY=VALUE",
        help="override the checkpoint's data section for --split, e.g. --set data.path=DIR",
    )
    evaluate.add_argument(
        "--direction",
        metavar="SRC-TGT",
        help="with --split: the direction whose split is scored (needed for a model of several)",
    )
    evaluate.add_argument(
        "--json", help="write the scores here as JSON, and the hypotheses beside it (.hyp.txt)"
    )
    evaluate.add_argument(
        "--tokenize", help="sacrebleu tokenizer (default: 13a, or zh/ja-mecab/ko-mecab by language)"
    )
    _add_decoding_flags(
        evaluate, exclude=("n_best",)
    )  # BLEU scores the 1-best; n-best lists come from translate
    _add_engine_flags(evaluate)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from .evaluate import (
        check_bleu_tokenizer,
        corpus_scores,
        evaluation_data,
        report,
        translate_test_set,
    )
    from .translate import Translator

    if args.run_dir:
        from .run_scores import evaluate_run

        if args.checkpoint or args.src or args.ref or args.split or args.direction or args.json:
            raise ConfigError(
                "evaluate: --run-dir scores the run's test split with its own checkpoints; leave out "
                "--checkpoint, --src, --ref, --split, --direction and --json"
            )
        if args.average_last < 0:
            raise ConfigError(f"--average-last must be >= 0, got {args.average_last}")
        evaluate_run(args.run_dir, args.average_last, tuple(args.zero_shot), tuple(args.set))
        return 0
    if not args.checkpoint:
        raise ConfigError("evaluate: give --checkpoint (a model) or --run-dir (a whole run)")
    if args.tokenize:
        check_bleu_tokenizer(args.tokenize)
    translator = Translator.from_checkpoint(
        args.checkpoint,
        device=args.device,
        quantization=args.quantization,
        workers=args.workers,
        compile=args.compile,
    )
    src, refs, tgt_lang, origin = evaluation_data(
        translator.config,
        args.split,
        args.src,
        args.ref,
        args.set,
        " ".join(args.checkpoint),
        args.direction,
        args.tgt_lang,
    )
    _note_compile(args)
    kwargs = {**_decoding_kwargs(args), **({"tgt_lang": tgt_lang} if args.direction else {})}
    options = translator.resolve_options(
        **kwargs, n_best=1
    )  # --tgt-lang fra: fr, as the model names it
    hyps = translate_test_set(translator, src, options)
    scores = corpus_scores(hyps, refs, options.target.code, tokenize=args.tokenize)
    report(
        scores,
        hyps,
        options.decoding,
        origin,
        args.json,
        checkpoint=" ".join(args.checkpoint),
        data=origin,
        direction=args.direction,
        tgt_lang=options.target.code,
        quantization=args.quantization,
        compile=args.compile,
        workers=args.workers,
    )
    return 0


def _chain_flags(chain: argparse.ArgumentParser) -> None:
    """`transformer chain`'s flags, read by `cmd_chain` below."""
    chain.add_argument(
        "--config", required=True, help="the recipe to make, e.g. configs/multi30k_fr_en_bt.yaml"
    )
    chain.add_argument(
        "--plan", action="store_true", help="print the steps and what is done, and stop"
    )
    chain.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value of every recipe the chain trains (repeatable), e.g. --set data.path=DIR",
    )
    chain.add_argument(
        "--average-last",
        type=int,
        default=5,
        metavar="N",
        help="step checkpoints each evaluation averages (default 5)",
    )


def cmd_chain(args: argparse.Namespace) -> int:
    """`transformer chain`: see `chain.py`."""
    from .chain import check_needs, describe, plan, run_chain

    steps = plan(args.config, tuple(args.set), args.average_last)
    print(f"chain of {args.config}:\n{describe(steps)}", flush=True)
    check_needs(steps)
    if args.plan:
        return 0
    return run_chain(steps)


def _synthesize_flags(synthesize: argparse.ArgumentParser) -> None:
    """`transformer synthesize`'s flags, read by `cmd_synthesize` below."""
    synthesize.add_argument(
        "--checkpoint",
        required=True,
        action="append",
        help="the model that translates, as translate's",
    )
    synthesize.add_argument(
        "--input",
        required=True,
        nargs="+",
        metavar="FILE",
        help="monolingual text files (plain or .gz)",
    )
    synthesize.add_argument(
        "--output",
        required=True,
        help="the corpus folder to write: train.LANG.gz of the input and of the output language, and "
        "origin.json; the same command again after an interruption goes on where it stopped",
    )
    synthesize.add_argument(
        "--input-lang",
        help="the language of the input files (default: the model's source language)",
    )
    synthesize.add_argument(
        "--exclude",
        nargs="+",
        default=[],
        metavar="FILE",
        help="files whose lines are not translated (e.g. the parallel training text in the inputs' language)",
    )
    synthesize.add_argument(
        "--chunk-lines",
        type=int,
        default=2000,
        help="lines translated between saves of the progress (2000)",
    )
    synthesize.add_argument(
        "--max-lines",
        type=int,
        default=0,
        metavar="N",
        help="translate only the first N unique lines (default 0: all), e.g. to try a chain at toy scale",
    )
    synthesize.add_argument(
        "--max-length-ratio",
        type=float,
        default=3.0,
        help="drop pairs where one side has more than this times the other's words (default 3)",
    )
    _add_decoding_flags(synthesize, exclude=("n_best",))
    _add_engine_flags(synthesize)


def cmd_synthesize(args: argparse.Namespace) -> int:
    """`transformer synthesize`: see `synthesize.py`. SIGTERM stops it as Ctrl-C does; both keep what was done."""
    from .config.languages import language_pairs
    from .synthesize import synthesize
    from .translate import Translator

    if args.chunk_lines < 1 or args.max_length_ratio < 1 or args.max_lines < 0:
        raise ConfigError(
            "--chunk-lines must be positive, --max-length-ratio at least 1 and --max-lines at least 0"
        )
    translator = Translator.from_checkpoint(
        args.checkpoint,
        device=args.device,
        quantization=args.quantization,
        workers=args.workers,
        compile=args.compile,
    )
    options = translator.resolve_options(n_best=1, **_decoding_kwargs(args))
    sources = list(dict.fromkeys(src for src, _ in language_pairs(translator.config.data)))
    if args.input_lang and args.input_lang not in sources:
        raise ConfigError(
            f"--input-lang {args.input_lang}: the model translates from {', '.join(sources)} only"
        )
    if not args.input_lang and len(sources) != 1:
        raise ConfigError(
            f"--input-lang: the model translates from {', '.join(sources)}: give the inputs' language"
        )
    _note_compile(args)
    try:
        out, counts = synthesize(
            translator,
            args.input,
            args.output,
            options,
            args.checkpoint,
            args.input_lang or sources[0],
            args.chunk_lines,
            args.max_length_ratio,
            progress=True,
            exclude=tuple(args.exclude),
            max_lines=args.max_lines,
        )
    except KeyboardInterrupt:
        print(
            f"synthesize: stopped; the same command goes on after the last complete chunk of {args.chunk_lines} "
            "lines",
            file=sys.stderr,
        )
        raise
    dropped = ", ".join(f"{n} {reason}" for reason, n in counts.dropped.items() if n) or "none"
    print(
        f"wrote {out}: {counts.kept} pairs of {counts.read} lines read ({counts.empty} empty, "
        f"{counts.duplicate} repeats, {counts.excluded} in --exclude; dropped: {dropped})"
        + (
            f"; {counts.truncated} longer than the model reads, translated from their start"
            if counts.truncated
            else ""
        )
    )
    return 0


def _export_flags(export: argparse.ArgumentParser) -> None:
    """`transformer export`'s flags, read by `cmd_export` below."""
    export.add_argument(
        "--checkpoint",
        required=True,
        help="a .pt checkpoint (e.g. RUN/checkpoints/best.pt) or a MarianMT folder",
    )
    export.add_argument(
        "--format",
        default="ctranslate2",
        choices=["ctranslate2", "huggingface"],
        help="ctranslate2 (default) or huggingface: a folder for transformers.MarianMTModel",
    )
    export.add_argument("--output", required=True, help="the model folder to write")
    export.add_argument(
        "--quantization", choices=QUANTIZATIONS, help="weight type (default float32)"
    )
    export.add_argument("--force", action="store_true", help="replace an existing output folder")


def cmd_export(args: argparse.Namespace) -> int:
    from .config.languages import language_tokens
    from .engines import load_model

    if args.format == "huggingface" and args.quantization:
        raise ExportError("--quantization applies to --format ctranslate2 only")
    config, model, tokenizer = load_model(args.checkpoint)
    tokens = language_tokens(
        config.data
    )  # a model told its target language by a token: a call names it
    if args.format == "huggingface":
        from .hf import export_huggingface

        out = export_huggingface(config, model, tokenizer, args.output, force=args.force)
        print(
            f"wrote {out} (Hugging Face MarianMT): load it with transformers' MarianMTModel and MarianTokenizer"
            + (
                f", each source starting with its target language's token ({tokens[0]})"
                if tokens
                else ""
            )
        )
        d = config.decoding
        print(
            f"note: transformers' generate has no cap per sentence (ours: {d.max_len_a:g} * source tokens + "
            f"{d.max_len_b}) and "
            + (f"no decoding.max_repeat={d.max_repeat}" if d.max_repeat else "no other limit")
            + f": an output that loops runs to max_length={config.model.max_positions} tokens; give generate "
            "max_new_tokens (docs/huggingface.md)"
        )
        return 0
    from .ct2 import export_ctranslate2

    out = export_ctranslate2(
        config,
        model,
        tokenizer,
        args.output,
        quantization=args.quantization,
        force=args.force,
        origin=str(args.checkpoint),
    )
    print(
        f"wrote {out} (CTranslate2, {args.quantization or 'float32'}): use it as `transformer translate --checkpoint "
        f"{out}{' --tgt-lang LANG' if tokens else ''}` or with ctranslate2.Translator"
    )
    return 0


def _attention_flags(attention: argparse.ArgumentParser) -> None:
    """`transformer attention`'s flags, read by `cmd_attention` below."""
    attention.add_argument(
        "--checkpoint", required=True, help="a .pt checkpoint or a MarianMT folder"
    )
    attention.add_argument("sentence", help="the source sentence")
    attention.add_argument(
        "--out", required=True, help="image file (.png, .svg, .pdf) or, with --format json, .json"
    )
    attention.add_argument(
        "--layer", type=int, default=-1, help="layer to show (default: the last)"
    )
    attention.add_argument(
        "--head", type=int, help="one head only (default: every head plus their mean)"
    )
    attention.add_argument(
        "--kind",
        default="all",
        choices=["all", "cross", "encoder_self", "decoder_self"],
        help="encoder-decoder (cross), either self-attention, or all three (default)",
    )
    attention.add_argument(
        "--format", choices=["image", "json"], help="default: by the --out suffix"
    )
    attention.add_argument(
        "--device", default="cpu", help="cpu (default), cuda, cuda:N, mps or auto"
    )
    _add_decoding_flags(attention, exclude=("n_best",))  # the translation shown (default: greedy)


def cmd_attention(args: argparse.Namespace) -> int:
    from .attention_plot import run

    out = run(
        args.checkpoint,
        args.sentence,
        args.out,
        layer=args.layer,
        head=args.head,
        kind=args.kind,
        fmt=args.format,
        options=_decoding_kwargs(args),
        device=args.device,
    )
    print(f"wrote {out}")
    return 0


def _plot_flags(plot: argparse.ArgumentParser) -> None:
    """`transformer plot`'s flags, read by `cmd_plot` below."""
    plot.add_argument(
        "--run-dir", action="append", required=True, help="a run directory; repeat to overlay runs"
    )
    plot.add_argument(
        "--out", help="image file, .png, .svg or .pdf (default: RUN_DIR/curves.png of the first)"
    )


def cmd_plot(args: argparse.Namespace) -> int:
    from .plot import plot_runs

    print(f"wrote {plot_runs(args.run_dir, args.out or Path(args.run_dir[0]) / 'curves.png')}")
    return 0


def _serve_flags(serve: argparse.ArgumentParser) -> None:
    """`transformer serve`'s flags, read by `cmd_serve` below."""
    serve.add_argument(
        "--checkpoint",
        required=True,
        action="append",
        help="a .pt checkpoint, a MarianMT folder or "
        "an exported CTranslate2 folder (no /attention for the latter); repeated: an ensemble",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default 127.0.0.1: this machine only)",
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    serve.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps or auto")
    serve.add_argument(
        "--quantization",
        choices=["int8"],
        help="int8: int8 dynamically quantized linear layers (CPU)",
    )
    serve.add_argument(
        "--compile",
        action="store_true",
        help="decode with the decoder step compiled by torch.compile, compiled before serving "
        "(20-60 s at start; CPU; needs a C++ compiler; see docs/serving.md)",
    )
    serve.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (default 0: one per core)"
    )
    serve.add_argument(
        "--max-sentences", type=int, default=128, help="sentences per request (default 128)"
    )
    serve.add_argument(
        "--max-chars", type=int, default=2000, help="characters per sentence (default 2000)"
    )
    serve.add_argument(
        "--max-beam-size", type=int, default=16, help="largest beam_size a request may ask (16)"
    )
    serve.add_argument(
        "--max-request-bytes", type=int, default=1_000_000, help="request body size (default 1 MB)"
    )
    serve.add_argument(
        "--max-batch-sentences",
        type=int,
        default=0,
        help="sentences of concurrent requests decoded together (default: decoding.batch_size)",
    )
    serve.add_argument(
        "--max-wait-ms",
        type=float,
        default=5.0,
        help="how long to collect concurrent requests into one batch (milliseconds, default 5)",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="seconds a request's headers, then its "
        "body, may take to arrive (default 30; 0: no limit)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C, seconds requests in flight may take to finish (default 30)",
    )
    serve.add_argument("--no-access-log", action="store_true", help="do not log a line per request")


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .serve import ServeLimits, ServeSettings, run_server
    except ImportError as err:
        print(
            f"error: serve needs FastAPI and uvicorn: pip install 'transformer-nmt[serve]' ({err})",
            file=sys.stderr,
        )
        return 2
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be between 1 and 65535, got {args.port}")
    for flag in ("max_sentences", "max_chars", "max_beam_size", "max_request_bytes"):
        if getattr(args, flag) < 1:
            raise ConfigError(
                f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}"
            )
    if (
        min(
            args.max_batch_sentences,
            args.max_wait_ms,
            args.threads,
            args.request_timeout,
            args.shutdown_timeout,
        )
        < 0
    ):
        raise ConfigError(
            "--max-batch-sentences, --max-wait-ms, --threads, --request-timeout and --shutdown-timeout "
            "must be >= 0"
        )
    limits = ServeLimits(
        max_sentences=args.max_sentences,
        max_chars=args.max_chars,
        max_beam_size=args.max_beam_size,
        max_request_bytes=args.max_request_bytes,
        request_timeout_s=args.request_timeout,
    )
    run_server(
        ServeSettings(
            tuple(args.checkpoint),
            host=args.host,
            port=args.port,
            device=args.device,
            threads=args.threads,
            quantization=args.quantization,
            compile=args.compile,
            limits=limits,
            max_batch_sentences=args.max_batch_sentences,
            max_wait_ms=args.max_wait_ms,
            access_log=not args.no_access_log,
            shutdown_timeout_s=args.shutdown_timeout,
        )
    )
    return 0


COMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {
    "train": ("train a model from a YAML config", _train_flags, cmd_train),
    "prepare": (
        "build the tokenizer and the training token cache ahead of training",
        _prepare_flags,
        cmd_prepare,
    ),
    "average": (
        "average the parameters of several checkpoints (§6.1)",
        _average_flags,
        cmd_average,
    ),
    "translate": (
        "translate sentences (arguments, --input FILE, or stdin)",
        _translate_flags,
        cmd_translate,
    ),
    "synthesize": (
        "translate monolingual text into a parallel corpus for training (back-translation): deduplicated, "
        "filtered, resumable",
        _synthesize_flags,
        cmd_synthesize,
    ),
    "chain": (
        "make a recipe's model and everything it needs (reverse models, teachers, synthetic corpora), then "
        "evaluate: plans, skips what is done, resumes what stopped",
        _chain_flags,
        cmd_chain,
    ),
    "evaluate": (
        "translate a test set and score BLEU and chrF with sacrebleu",
        _evaluate_flags,
        cmd_evaluate,
    ),
    "export": (
        "convert a checkpoint for deployment (CTranslate2) or Hugging Face (MarianMT)",
        _export_flags,
        cmd_export,
    ),
    "attention": (
        "translate a sentence and plot (or dump) its attention weights",
        _attention_flags,
        cmd_attention,
    ),
    "plot": (
        "draw a run's training curves (loss, BLEU, learning rate) from its metrics.jsonl",
        _plot_flags,
        cmd_plot,
    ),
    "serve": (
        "serve a model over HTTP: JSON API and an attention explorer page",
        _serve_flags,
        cmd_serve,
    ),
}
"""Each sub-command: its one-line help, the function that declares its flags (beside the code that reads them) and
the one that runs it."""


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    reuse_freed_memory()  # glibc keeps freed tensor memory mapped: no page faults on every step's large tensors
    # under torchrun, rank 0 speaks for all
    args.is_main_process = os.environ.get("RANK", "0") == "0"
    level = (
        logging.DEBUG
        if args.verbose
        else (
            logging.INFO
            if args.command in ("train", "prepare") and args.is_main_process
            else logging.WARNING
        )
    )
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    # SIGTERM (a service manager, `kill`) stops these as Ctrl-C does: what was done is kept and said (train and serve
    # handle it themselves)
    on_sigterm = (
        args.command in SIGTERM_AS_CTRL_C and threading.current_thread() is threading.main_thread()
    )
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_sigterm else None
    try:
        return COMMANDS[args.command][2](args)
    except USER_ERRORS as err:
        if args.verbose:
            raise
        print(f"error: {_as_typed(err, args.command)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`... | head -n 2`): stop quietly, as other Unix tools do
        silence_stdout()
        return 141
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM in translate, evaluate, ... (train saves last.pt and returns 130 itself)
        if args.verbose:
            raise
        print(f"\n{args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if on_sigterm:
            signal.signal(signal.SIGTERM, previous)


SIGTERM_AS_CTRL_C = (
    "translate",
    "evaluate",
    "synthesize",
    "average",
    "attention",
    "export",
    "prepare",
    "plot",
)
"""The commands that SIGTERM interrupts as Ctrl-C does (`main`)."""


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
