"""Check and measure the toolkit on a GPU in one command: environment, the CUDA tests, training speed of Table 3's
models in bf16 and fp16, decoding speed, torchrun with nccl. One JSON line of figures at the end.

Usage (on a machine with a CUDA GPU; no network needed):
    python scripts/gpu_check.py [--shared ../shared] [--work /tmp/gpu_check] [--pairs 300000] [--steps 40]
                                [--budget-s SECONDS] [--skip tests,one-batch,decode,commands,torchrun,big,compiled]
    python scripts/gpu_check.py --device cpu --quick        # the same stages in seconds, on a tiny model (CI)

It runs from the repository as it is (the package need not be installed; `pip install --no-deps
--no-build-isolation -e .` installs it with the torch already there; with a setuptools older than 70.1 that also
needs the `wheel` package). Besides torch it needs sentencepiece, sacrebleu, pyyaml, tqdm and numpy, and pytest
for the tests stage (wheels brought along install with `pip install --no-index --find-links WHEELS pytest`).

Stages, in order; each one's failure is recorded under "errors" and the others still run; the exit status is 1
when any failed. After each stage the figures so far are written to WORK/figures.json and printed on stderr, so
that a run cut short keeps what it measured; every subprocess has a time limit (it is stopped with the processes it
started). With --budget-s, no stage starts after that many seconds, subprocesses are stopped at it, and the big
model and the compiled stage (which run in this process) start only with `IN_PROCESS_ALLOWANCE_S` left.
1. environment: GPU name, memory, torch and CUDA versions, and the measured rate of one large matrix product in
   fp32 and bf16 (`transformer.device.matmul_seconds`; 8192^3 on a GPU), the peak the MFU figures refer to.
2. tests: `pytest -m cuda` (the CUDA half of the device-parametrized tests); it fails when a test fails or none
   passed (all skipped: the GPU not visible to the tests). With --device cpu, one CPU device test instead, so
   that the stage itself is exercised.
3. data: a WMT14-sized synthetic corpus from `SHARED/scale/make_corpus.py` (`--pairs` pairs of two joined
   Multi30k sentences, about 26 words each), `transformer prepare` on it (tokenizer and token cache), then the
   token cache's start-up time: `prepare_data` again with the cache present.
4. training: Table 3's base from `configs/wmt14_en_de_base.yaml` on that data,
   `--warmup` then `--steps` timed updates of the real step (`training.trainer.train_step`, the recipe's
   accumulate_steps and batch size, batches in the recipe's order) in bf16 and in fp16 (with the GradScaler):
   target tokens/s (non-pad), MFU against the measured bf16 rate, peak GPU memory. Base in bf16 once more with
   the same tokens per update in one batch (`max_tokens_per_batch` × `accumulate_steps`, no accumulation): key
   `bf16_one_batch`, what the recipe's small batches cost in kernel launches.
5. decoding: the first `--sentences` training sources (2,000), with the base model trained in stage 4, greedy and
   beam 4 at batch 64 and 256: target tokens/s (the tokens of the outputs, eos included) and sentences/s.
6. train command: the README's one-GPU command, `transformer train --config configs/wmt14_en_de_base.yaml ...
   --set training.device=cuda`, for a few updates and one validation, then `transformer translate --device cuda`
   of 8 sentences with the best.pt it wrote.
7. torchrun: `torchrun --standalone --nproc_per_node 1 -m transformer train` (the README's multi-GPU command with
   one process) for a few updates (nccl on CUDA, gloo on the CPU) on the same data and tokenizer.
8. training of Table 3's big model (`configs/wmt14_en_de_big.yaml`) as in stage 4, unless --no-big or --quick:
   late, so that a --budget-s that runs out leaves it out first.
9. base in bf16 with `training.compile: true` (torch.compile; key `bf16_compiled`): the compilation happens in the
   untimed updates, so the warm-up must cover the first batch shapes (it recompiles once for dynamic shapes).

FLOPs per sentence pair (ls source, lt target tokens, eos/bos included; 2 FLOPs per multiply-add; training is
3 x forward) are `scripts/benchmark_train.py`'s:

    encoder, per layer:  ls·(4·d² + 2·d·d_ff) + 2·ls²·d
    decoder, per layer:  lt·(4·d² + 2·d² + 2·d·d_ff) + ls·2·d² + 2·lt²·d + 2·lt·ls·d
    output projection:   lt·d·V

MFU = achieved FLOP/s / the measured bf16 matmul FLOP/s (for fp16 runs as well: the two peaks are equal on
current NVIDIA GPUs; the fp16 rate is printed too).

Printed keys: device, gpu, gpu_memory_gb, torch, cuda, matmul_tflops_{fp32,bf16,fp16}, tests {passed, failed,
skipped, s}, pairs, prepare_s, cache_startup_s, train {model: {precision (and base's bf16_one_batch, bf16_compiled):
{tgt_tokens_per_s, s_per_step, tgt_tokens_per_step, tflops_per_s, mfu, peak_memory_gb, last_nll_per_token,
parameters}}}, decode [{search, batch_size, tgt_tokens_per_s, sentences_per_s, s}], train_command {steps, s,
translate_s}, torchrun {backend, steps, s}, skipped (the stages --skip left out), total_s, errors. A figure that
could not be measured is null (with --device cpu: fp32 and bf16 in place of bf16 and fp16, and fp32_one_batch,
fp32_compiled).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from benchmark_train import training_flops  # noqa: E402

from transformer.config import load_config  # noqa: E402
from transformer.device import matmul_seconds  # noqa: E402
from transformer.engines import PyTorchEngine  # noqa: E402
from transformer.model import Transformer  # noqa: E402
from transformer.tokenizer import Tokenizer  # noqa: E402
from transformer.training.data import epoch_batches, prepare_data, training_epochs  # noqa: E402
from transformer.training.loss import LossComputation  # noqa: E402
from transformer.training.optim import build_optimizer, learning_rate, set_lr  # noqa: E402
from transformer.training.trainer import train_step  # noqa: E402
from transformer.translate import Translator  # noqa: E402

IN_PROCESS_ALLOWANCE_S = {"big": 90, "compiled": 240}
"""With --budget-s, the time that must be left for these stages to start (per precision for big): they run in this
process, where the budget cannot stop them. Allowances, not measurements: the compiled stage compiles the model's
forward and backward twice (static, then dynamic shapes)."""

STAGE_TIMEOUT_S = {"tests": 240, "corpus": 300, "prepare": 600, "train command": 180, "translate command": 120,
                   "torchrun": 180}
"""Seconds each subprocess may take before it is stopped (with the processes it started) and its stage recorded as
failed; less when --budget-s leaves less."""

DEADLINE: Optional[float] = None
"""time.perf_counter() at which --budget-s runs out (None: no budget)."""

QUICK_MODEL = ["model.d_model=32", "model.n_heads=4", "model.d_ff=64", "model.n_encoder_layers=1",
               "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens_per_batch=1024",
               "training.accumulate_steps=2"]
"""--quick: a model and batches small enough for a CPU test; the stages are the same."""


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, their children, ...), read from /proc: also those that left its process
    group (torchrun starts each worker in a session of its own). Empty where /proc is missing."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (name) state"
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _run(command: list[str], stage: str, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run with output captured as text, in a process group of its own: on timeout (or when this script
    is interrupted) the group and every process below it are killed, torchrun's workers (each in a session of its
    own) as well as torchrun, and the exception raised."""
    timeout = STAGE_TIMEOUT_S[stage]
    if DEADLINE is not None:
        timeout = max(1.0, min(timeout, DEADLINE - time.perf_counter()))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:  # the time limit, or Ctrl-C / SIGTERM to this script: they would live on
        below = _descendants(process.pid)  # before the kill: orphans no longer point back to it
        for kill, target in [(os.killpg, process.pid), *((os.kill, pid) for pid in below)]:
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:  # a process that escaped both would hold the pipes open: do not wait for it
            process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _raise_on_sigterm(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so that `_run` stops the subprocesses it started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device, quick: bool) -> dict:
    size = 1024 if quick else 8192
    info = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2 ** 30, 1),
                    capability=f"{props.major}.{props.minor}")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if device.type == "cpu" and dtype == torch.float16:
            continue
        seconds = matmul_seconds(dtype, device, size=size, repeats=10, budget_s=1.0)
        info[f"matmul_tflops_{name}"] = round(2 * size ** 3 / seconds / 1e12, 3)
    return info


def device_tests(shared: Path, device: torch.device) -> dict:
    """`pytest -m cuda` on CUDA (one CPU device test on the CPU); counts of passed, failed, skipped and errors."""
    if importlib.util.find_spec("pytest") is None:
        raise RuntimeError("pytest is not installed: pip install --no-index --find-links WHEELS pytest")
    start = time.perf_counter()
    # cuBLAS reads CUBLAS_WORKSPACE_CONFIG at its first matrix product: set before the deterministic resume tests.
    env = {**os.environ, "MULTI30K_DIR": str(shared / "data" / "multi30k"), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    selection = (["-m", "cuda"] if device.type == "cuda"
                 else ["-m", "not cuda", "-k", "no_future_leak", "tests/test_devices.py"])
    # -o addopts= : the project's -q would make this -qq, which prints no summary line to count from.
    result = _run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", *selection],
                  "tests", cwd=ROOT, env=env)
    lines = result.stdout.strip().splitlines()
    summary = lines[-1] if lines else result.stderr[-500:]
    counts = {("errors" if k.startswith("error") else k): int(n)  # pytest says "1 error", "2 errors"
              for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary)}
    out = {**counts, "s": round(time.perf_counter() - start, 1), "summary": summary}
    if result.returncode != 0 or not counts.get("passed"):
        failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        raise RuntimeError(f"pytest {' '.join(selection)}: {summary}; " + "; ".join(failures[:10]))
    return out


def data_settings(corpus: Path, work: Path, quick: bool) -> list[str]:
    sets = [f"data.path={corpus}", "data.valid_split=val", "data.test_split=test_2016_flickr",
            f"data.cache_dir={work / 'cache'}", "data.valid_max_sentences=100"]
    if quick:
        return sets + QUICK_MODEL + ["data.spm_max_sentences=4000"]
    return sets + ["data.spm_max_sentences=200000"]


def make_data(args: argparse.Namespace, work: Path, sets: list[str]) -> dict:
    corpus = work / "corpus"
    result = _run([sys.executable, str(Path(args.shared) / "scale" / "make_corpus.py"), str(corpus), str(args.pairs)],
                  "corpus")
    if result.returncode != 0:
        raise RuntimeError(f"make_corpus.py: {result.stderr.strip().splitlines()[-3:]}")
    start = time.perf_counter()
    result = _run([sys.executable, "-m", "transformer", "prepare", "--config", args.config, "--run-dir",
                   str(work / "prepared"), *[f"--set={s}" for s in sets]], "prepare", cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"transformer prepare: {result.stderr.strip().splitlines()[-1:]}")
    prepare_s = time.perf_counter() - start
    start = time.perf_counter()
    prepare_data(load_config(args.config, sets), work / "prepared")
    return {"pairs": args.pairs, "prepare_s": round(prepare_s, 1),
            "cache_startup_s": round(time.perf_counter() - start, 2)}


def one_batch_settings(config_path: str, sets: list[str]) -> list[str]:
    """The recipe's tokens per update in one batch: max_tokens_per_batch × accumulate_steps, accumulate_steps 1
    (fewer, larger kernels per update; more activation memory)."""
    config = load_config(config_path, sets)
    tokens = config.data.max_tokens_per_batch * config.training.accumulate_steps
    return [f"data.max_tokens_per_batch={tokens}", "training.accumulate_steps=1"]


def measure_training(config_path: str, sets: list[str], precision: str, work: Path, device: torch.device,
                     args: argparse.Namespace, peak_tflops: Optional[float]) -> tuple[dict, Transformer, Tokenizer]:
    config = load_config(config_path, [*sets, f"training.precision={precision}", f"training.device={device.type}"])
    torch.manual_seed(config.training.seed)
    tokenizer, caches, _ = prepare_data(config, work / "prepared")
    train = training_epochs(config, work / "prepared", tokenizer, caches).epoch(0)  # as the first epoch trains
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # e.g. the model kept for decoding
    model = Transformer(config.model).to(device)
    optimizer = build_optimizer(model, config.training, device)
    module = LossComputation(model, config.training.label_smoothing).train()
    if config.training.compile:  # as the trainer does
        module = torch.compile(module)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    batches = epoch_batches(train, config, epoch=0)
    accumulate = config.training.accumulate_steps
    groups = [batches[step * accumulate:(step + 1) * accumulate] for step in range(args.warmup + args.steps)]
    group_flops = [sum(training_flops(config, int(train.src_lengths[i]), int(train.tgt_lengths[i]))
                       for g in group for i in g) for group in groups]  # counted before the clock runs
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    n_tgt, flops, start, last = 0, 0.0, time.perf_counter(), None
    for step, group in enumerate(groups):
        if step == args.warmup:
            _sync(device)
            n_tgt, flops, start = 0, 0.0, time.perf_counter()
        made = [train.batch(g).to(device) for g in group]  # as the trainer copies them
        set_lr(optimizer, learning_rate(step + 1, config.training, config.model.d_model))
        result = train_step(module, optimizer, made, config, scaler=scaler)
        if result is not None:  # None: an fp16 overflow, skipped
            last = (result[1], sum(b.n_tgt_tokens for b in made))
        n_tgt += sum(b.n_tgt_tokens for b in made)
        flops += group_flops[step]
    _sync(device)
    seconds = time.perf_counter() - start
    loss = round(float(last[0]) / max(1, last[1]), 3) if last is not None else None
    figures = {"tgt_tokens_per_s": round(n_tgt / seconds), "s_per_step": round(seconds / args.steps, 4),
               "tgt_tokens_per_step": round(n_tgt / args.steps), "tflops_per_s": round(flops / seconds / 1e12, 3),
               "mfu": float(f"{flops / seconds / 1e12 / peak_tflops:.3g}") if peak_tflops else None,
               "last_nll_per_token": loss, "parameters": model.num_parameters()}
    if device.type == "cuda":
        figures["peak_memory_gb"] = round((torch.cuda.max_memory_allocated(device) - held) / 2 ** 30, 2)
    optimizer.zero_grad(set_to_none=True)  # a model kept for decoding holds no gradients
    return figures, model, tokenizer


def measure_decoding(model: Transformer, tokenizer: Tokenizer, config_path: str, sets: list[str], corpus: Path,
                     device: torch.device, n_sentences: int) -> list[dict]:
    config = load_config(config_path, sets)
    with open(corpus / f"train.{config.data.src_lang}", encoding="utf-8") as f:
        sentences = [next(f).strip() for _ in range(n_sentences)]
    translator = Translator(PyTorchEngine(model, tokenizer, config, device=device))
    rows = []
    for beam_size in (1, 4):
        for batch_size in (64, 256):
            _sync(device)
            start = time.perf_counter()
            options = translator.resolve_options(beam_size=beam_size, batch_size=batch_size, n_best=1)
            result = translator.run(translator.request(sentences, options), scores=False)
            _sync(device)
            seconds = time.perf_counter() - start
            # eos counted for the outputs that ended with one (not those cut at the cap)
            tokens = result.n_output_tokens + len(sentences) - result.n_hit_max_len
            rows.append({"search": "greedy" if beam_size == 1 else f"beam {beam_size}", "batch_size": batch_size,
                         "tgt_tokens_per_s": round(tokens / seconds),
                         "sentences_per_s": round(len(sentences) / seconds), "s": round(seconds, 2)})
    return rows


def _train_briefly(launcher: list[str], stage: str, config_path: str, sets: list[str], work: Path,
                   device: torch.device, env: Optional[dict] = None) -> tuple[subprocess.CompletedProcess, dict]:
    """`transformer train` started by `launcher` for a few updates on the prepared data and tokenizer, one validation
    at the end (which writes best.pt); the run directory is WORK/STAGE (spaces as underscores)."""
    run_dir = work / stage.replace(" ", "_")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    for model in (work / "prepared").glob("spm*"):
        shutil.copy(model, run_dir / model.name)
    steps = 5
    command = [*launcher, "-m", "transformer", "train", "--config", config_path, "--run-dir", str(run_dir),
               *[f"--set={s}" for s in sets], f"--set=training.device={device.type}",
               f"--set=training.max_steps={steps}", "--set=training.log_every_steps=1",
               f"--set=training.eval_every_steps={steps}", "--set=data.valid_max_sentences=20"]
    start = time.perf_counter()
    result = _run(command, stage, cwd=ROOT, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{stage}: {result.stderr.strip().splitlines()[-3:]}")
    done = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["type"] == "train"]
    if not done or done[-1] != steps:
        raise RuntimeError(f"{stage}: trained steps {done}, expected up to {steps}")
    return result, {"steps": done[-1], "s": round(time.perf_counter() - start, 1)}


def command_check(config_path: str, sets: list[str], work: Path, device: torch.device) -> dict:
    """The README's one-GPU command (`transformer train ... --set training.device=cuda`) for a few updates, then
    `transformer translate --device cuda` with the best.pt it wrote."""
    _, figures = _train_briefly([sys.executable], "train command", config_path, sets, work, device)
    with open(work / "corpus" / f"val.{load_config(config_path, sets).data.src_lang}", encoding="utf-8") as f:
        sentences = [next(f).strip() for _ in range(8)]
    start = time.perf_counter()
    result = _run([sys.executable, "-m", "transformer", "translate", "--checkpoint",
                   str(work / "train_command" / "checkpoints" / "best.pt"), "--device", device.type,
                   "--beam-size", "4", *sentences], "translate command", cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"transformer translate: {result.stderr.strip().splitlines()[-3:]}")
    if len(result.stdout.splitlines()) != len(sentences):
        raise RuntimeError(f"transformer translate: {len(result.stdout.splitlines())} lines for {len(sentences)}")
    return {**figures, "translate_s": round(time.perf_counter() - start, 1)}


def torchrun_check(config_path: str, sets: list[str], work: Path, device: torch.device) -> dict:
    """`torchrun --standalone --nproc_per_node 1 -m transformer train ...` (the README's multi-GPU command with one
    process) for a few updates: nccl on CUDA, gloo on the CPU."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    result, figures = _train_briefly(launcher, "torchrun", config_path, sets, work, device,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
    backend = re.search(r"process group: rank 0 of 1, backend (\w+)", result.stderr)  # the training log's line
    return {"backend": backend.group(1) if backend else None, **figures}


SKIPPABLE = ("tests", "one-batch", "decode", "commands", "torchrun", "big", "compiled")
"""The stage groups --skip takes (environment, data and base training always run: the others build on them)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="a tiny model and corpus: the stages in seconds")
    parser.add_argument("--shared", default=str(ROOT.parent / "shared"),
                        help="folder with scale/make_corpus.py and data/multi30k (default ../shared)")
    parser.add_argument("--work", default="/tmp/gpu_check", help="scratch folder (emptied first)")
    parser.add_argument("--pairs", type=int, help="synthetic training pairs (default 300000; --quick 3000)")
    parser.add_argument("--steps", type=int, help="timed updates per model and precision (default 40; --quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed updates first (default 10; --quick 1)")
    parser.add_argument("--sentences", type=int, help="sentences decoded per setting (default 2000; --quick 20)")
    parser.add_argument("--no-big", action="store_true", help="train only the base model (as --skip big)")
    parser.add_argument("--skip", default="", help=f"comma-separated stage groups not to run, e.g. to repeat a "
                        f"failed one quickly: {', '.join(SKIPPABLE)} (listed under 'skipped' in the figures)")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="seconds for the whole check: later stages are not started once it is spent, and "
                             "subprocesses are stopped at it (default 0: no limit)")
    args = parser.parse_args(argv)
    args.skip = {group.strip() for group in args.skip.split(",") if group.strip()}
    if args.skip - set(SKIPPABLE):
        parser.error(f"--skip: unknown stage group {sorted(args.skip - set(SKIPPABLE))[0]!r}; expected some of "
                     f"{', '.join(SKIPPABLE)}")
    if args.no_big:
        args.skip.add("big")
    quick = args.quick
    args.pairs = args.pairs or (3000 if quick else 300_000)
    args.steps = args.steps or (3 if quick else 40)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 10)
    args.sentences = args.sentences or (20 if quick else 2000)
    args.config = str(ROOT / "configs" / "wmt14_en_de_base.yaml")
    args.shared = str(Path(args.shared).resolve())
    begin = time.perf_counter()
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    global DEADLINE
    DEADLINE = begin + args.budget_s if args.budget_s > 0 else None
    device = torch.device(args.device)
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    figures: dict = {}
    errors: dict[str, str] = {}

    def stage(name: str, run, keep, group: Optional[str] = None, needs_s: float = 0.0):
        """Run one stage; `keep` puts its result into the figures, which are then written to figures.json. It is
        skipped when its `group` (default: its name) is in --skip. With --budget-s, a stage that runs in this
        process (and cannot be stopped) starts only with `needs_s` left."""
        stage_start, result = time.perf_counter(), None
        if (group or name) in args.skip:
            figures.setdefault("skipped", []).append(name)
            keep(None)
            return None
        if DEADLINE is not None and stage_start >= DEADLINE:
            errors[name] = f"not started: --budget-s {args.budget_s:g} spent"
        elif DEADLINE is not None and DEADLINE - stage_start < needs_s:
            errors[name] = (f"not started: {DEADLINE - stage_start:.0f} s of --budget-s {args.budget_s:g} left, "
                            f"it needs about {needs_s:g} s")
        else:
            try:
                result = run()
            except Exception as error:  # noqa: BLE001 - recorded, and the next stage runs
                errors[name] = f"{type(error).__name__}: {error}"
                traceback.print_exc()
        keep(result)  # None for a failed stage: its figures are null
        print(f"gpu_check: {name}: {'failed' if name in errors else 'done'} in "
              f"{time.perf_counter() - stage_start:.1f} s", file=sys.stderr, flush=True)
        so_far = json.dumps({**figures, "errors": errors})
        (work / "figures.json").write_text(so_far + "\n")
        print(f"gpu_check: figures so far: {so_far}", file=sys.stderr, flush=True)  # kept in a log cut short
        return result

    def keep_as(key: str):
        return lambda result: figures.__setitem__(key, result)

    if device.type == "cuda" and not torch.cuda.is_available():
        errors["environment"] = "no CUDA device visible to torch"
        print(json.dumps({"device": "cuda", "torch": torch.__version__, "errors": errors}))
        return 1
    env = stage("environment", lambda: environment(device, quick), lambda result: figures.update(result or {})) or {}
    stage("tests", functools.partial(device_tests, Path(args.shared), device), keep_as("tests"))
    sets = data_settings(work / "corpus", work, quick)
    stage("data", lambda: make_data(args, work, sets), lambda result: figures.update(result or {}))
    peak = env.get("matmul_tflops_bf16") or env.get("matmul_tflops_fp32")
    precisions = ("bf16", "fp16") if device.type == "cuda" else ("fp32", "bf16")
    figures["train"] = {}

    def train_model(name: str, config_path: str, group: str, needs_s: float = 0.0
                    ) -> Optional[tuple[Transformer, Tokenizer]]:
        """Its training in each precision; the model and tokenizer of the first run that trained."""
        runs, trained = figures["train"].setdefault(name, {}), None
        for precision in precisions:
            out = stage(f"train {name} {precision}", functools.partial(
                measure_training, config_path, sets, precision, work, device, args, peak),
                functools.partial(lambda key, result: runs.__setitem__(key, result and result[0]), precision),
                group, needs_s)
            trained = trained or (out and out[1:])
            del out
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return trained

    def train_base_variant(variant: str, changes: list[str], group: str, needs_s: float = 0.0) -> None:
        """Base in the first precision once more, with `changes`: figures under "{precision}_{variant}"."""
        run = functools.partial(measure_training, args.config, sets + changes, precisions[0], work, device, args, peak)
        stage(f"train base {precisions[0]} {variant.replace('_', ' ')}", lambda: run()[0],
              functools.partial(figures["train"]["base"].__setitem__, f"{precisions[0]}_{variant}"), group, needs_s)

    trained = train_model("base", args.config, "base")
    # The same tokens per update in one batch: what the recipe's accumulation costs.
    train_base_variant("one_batch", one_batch_settings(args.config, sets), "one-batch")
    if trained is not None:
        stage("decode", functools.partial(measure_decoding, *trained, args.config, sets, work / "corpus", device,
                                          args.sentences), keep_as("decode"))
    elif "decode" not in args.skip:
        errors["decode"] = "no trained base model"
    del trained
    if device.type == "cuda":
        torch.cuda.empty_cache()
    stage("train command", lambda: command_check(args.config, sets, work, device), keep_as("train_command"),
          "commands")
    stage("torchrun", lambda: torchrun_check(args.config, sets, work, device), keep_as("torchrun"))
    if not quick:  # late: a --budget-s that runs out leaves it out first
        train_model("big", str(ROOT / "configs" / "wmt14_en_de_big.yaml"), "big", IN_PROCESS_ALLOWANCE_S["big"])
    # Last: training.compile (its compilation is in the stage's time, not in the timed updates).
    train_base_variant("compiled", ["training.compile=true"], "compiled", IN_PROCESS_ALLOWANCE_S["compiled"])
    figures["total_s"] = round(time.perf_counter() - begin, 1)
    figures["errors"] = errors
    (work / "figures.json").write_text(json.dumps(figures) + "\n")
    print(json.dumps(figures))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
