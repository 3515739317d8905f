"""The data path at scale: token-cache build time, start-up time with the cache present, peak memory, as one JSON line.

Usage:
    python ../shared/scale/make_corpus.py /tmp/c45m 4500000            # a WMT14-sized corpus (1.2 GB of text)
    python scripts/benchmark_data.py --corpus /tmp/c45m [--config configs/multi30k_de_en.yaml] [--nproc 2]
        [--set data.subword_sampling=true [--wait-sample]]
    python scripts/benchmark_data.py --corpus ../shared/data/multi30k --wait-sample  # any {split}.{lang}.gz folder

What it runs, each as a separate process as a user would (`--work` holds everything; it is emptied first):
1. `transformer prepare` on the corpus: trains the tokenizer on a sample (data.spm_max_sentences), then builds the
   token cache. Times: tokenizer (until "saved sentencepiece model" is logged), cache build (from the cache's
   meta.json), whole command; peak RSS of the process.
2. `transformer train` in a new run directory holding that tokenizer (so it finds the cache), `--nproc` processes
   (torchrun when > 1), logging every update; stopped with SIGINT after `--steps` updates. Times from the
   start of the command to its first and `--steps`-th update (the moment the metrics line appears); peak RSS
   (VmHWM) of every training process, and the largest anonymous (heap) and file-backed (mapped cache and
   libraries) parts of its resident memory, sampled every 0.1 s.

With `--set data.subword_sampling=true --wait-sample`, training goes on after `--steps` updates until the
background process has written epoch 1's sample (`data/subword_sampling.py`); its build time, CPU seconds and
peak memory are printed too (`sample_build_s`, `sample_cpu_s`, `sample_peak_rss_mb`, `sample_pairs`).

Printed keys: pairs, cache_mb, tokenizer_s, cache_build_s, prepare_s, prepare_peak_rss_mb, first_update_s,
last_update_s, train_peak_rss_mb (one per process), train_rss_anon_mb, train_rss_file_mb, fill (real target and
source tokens per batch over data.max_tokens_per_batch, for the recipes' batch-size arithmetic), and the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _memory(pid: int) -> dict[str, int]:
    """VmHWM, RssAnon, RssFile in kB (empty if the process is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return {}
    fields = {line.split(":")[0]: line.split()[1] for line in lines if line.startswith(("VmHWM", "RssAnon", "RssFile"))}
    if b"transformer" not in cmdline or b"torch.distributed.run" in cmdline:  # the launcher is not a trainer
        return {}
    return {k: int(v) for k, v in fields.items()}


class MemoryMonitor(threading.Thread):
    """Samples the memory of a process tree every 0.1 s; keeps each process's maxima."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peaks, self.running = pid, {}, True

    def run(self) -> None:
        while self.running:
            for p in _descendants(self.pid):
                for key, value in _memory(p).items():
                    self.peaks.setdefault(p, {})
                    self.peaks[p][key] = max(self.peaks[p].get(key, 0), value)
            time.sleep(0.1)


def _run_logged(cmd: list[str], env: dict[str, str], marker: str) -> tuple[float, float, int, str]:
    """Run cmd; returns (seconds until `marker` appears on stderr, total seconds, peak RSS kB, stderr)."""
    start = time.perf_counter()
    process = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    marker_s, lines = -1.0, []
    for line in process.stderr:
        lines.append(line)
        if marker_s < 0 and marker in line:
            marker_s = time.perf_counter() - start
    _, status, usage = os.wait4(process.pid, 0)
    total = time.perf_counter() - start
    if status != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{''.join(lines[-30:])}")
    return marker_s, total, usage.ru_maxrss, "".join(lines)


def config_with(args: argparse.Namespace, sets: list[str]):
    sys.path.insert(0, str(ROOT))
    from transformer.config import load_config

    return load_config(ROOT / args.config, sets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="folder from make_corpus.py")
    parser.add_argument("--config", default="configs/multi30k_de_en.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--work", help="work folder (default: /tmp/benchmark_data_<corpus name>); emptied first")
    parser.add_argument("--wait-sample", action="store_true",
                        help="with data.subword_sampling: wait for epoch 1's sample and print its cost")
    parser.add_argument("--nproc", type=int, default=1, help="training processes (torchrun when > 1)")
    parser.add_argument("--steps", type=int, default=3, help="updates to wait for before stopping training")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per training process")
    args = parser.parse_args()
    corpus = Path(args.corpus).resolve()
    work = Path(args.work or f"/tmp/benchmark_data_{corpus.name}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "TRANSFORMER_NMT_CACHE": str(work / "cache"), "OMP_NUM_THREADS": str(args.threads)}
    sets = [f"data.path={corpus}", *args.set]
    set_flags = [flag for s in sets for flag in ("--set", s)]
    exe = [sys.executable, "-m", "transformer"]

    # 1. prepare: tokenizer, then the token cache
    tokenizer_s, prepare_s, prepare_rss, _ = _run_logged(
        [*exe, "prepare", "--config", args.config, "--run-dir", str(work / "prepared"), *set_flags], env,
        "saved sentencepiece model")
    (cache,) = [p for p in (work / "cache").iterdir() if p.is_dir()]
    meta = json.loads((cache / "meta.json").read_text())

    # 2. train from a new run directory that holds the tokenizer: finds the cache
    run_dir = work / "train"
    run_dir.mkdir()
    for model in (work / "prepared").glob("spm*.model"):
        shutil.copy(model, run_dir / model.name)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
                "-m", "transformer"] if args.nproc > 1 else exe
    train_sets = [*set_flags, "--set", "training.log_every_steps=1", "--set", "training.eval_every_steps=1000000",
                  "--set", f"training.threads={args.threads}", "--set", "training.max_steps=100000"]
    start = time.perf_counter()
    process = subprocess.Popen([*launcher, "train", "--config", args.config, "--run-dir", str(run_dir), *train_sets],
                               stdout=subprocess.DEVNULL, stderr=open(work / "train.log", "w"), env=env, cwd=ROOT)
    monitor = MemoryMonitor(process.pid)
    monitor.start()
    metrics = run_dir / "metrics.jsonl"
    first_s = last_s = -1.0
    while process.poll() is None and last_s < 0:
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
        if steps and first_s < 0:
            first_s = time.perf_counter() - start
        if steps and steps[-1] >= args.steps:
            last_s = time.perf_counter() - start
        time.sleep(0.05)
    sample = {}
    if args.wait_sample:
        done = run_dir / "subword_samples" / "epoch_1" / "meta.json"
        while process.poll() is None and not done.exists():
            time.sleep(0.5)
        if not done.exists():
            sys.exit(f"training stopped before epoch 1's subword sample was written; see {work / 'train.log'}")
        meta_1 = json.loads(done.read_text())
        builder = json.loads((done.parent / "builder.json").read_text())
        sample = {"sample_build_s": meta_1["build_seconds"], "sample_cpu_s": builder["cpu_s"],
                  "sample_peak_rss_mb": builder["peak_rss_mb"], "sample_pairs": meta_1["n_pairs"],
                  "sample_tgt_tokens": meta_1["tgt_tokens"], "cache_tgt_tokens": meta["tgt_tokens"]}
    time.sleep(0.3)
    monitor.running = False
    monitor.join()
    process.send_signal(signal.SIGINT)
    process.wait(timeout=300)
    if last_s < 0:
        sys.exit(f"training stopped before update {args.steps}; see {work / 'train.log'}")

    # Batch fill at the recipe's budget: real tokens per batch over max_tokens_per_batch.
    from transformer.data.token_cache import open_token_cache
    from transformer.training.data import epoch_batches

    config = config_with(args, sets)
    pairs = open_token_cache(cache)
    batches = epoch_batches(pairs, config, epoch=0)
    budget = config.data.max_tokens_per_batch * len(batches)
    fill = {"tgt": round(float(pairs.tgt_lengths.sum()) / budget, 3),
            "src": round(float(pairs.src_lengths.sum()) / budget, 3)}
    peaks = list(monitor.peaks.values())
    print(json.dumps({
        "corpus": str(corpus), "pairs": meta["n_pairs"], "pairs_read": meta["n_read"],
        "cache_mb": round(meta["bytes"] / 1e6, 1), "tokenizer_s": round(tokenizer_s, 1),
        "cache_build_s": meta["build_seconds"], "prepare_s": round(prepare_s, 1),
        "prepare_peak_rss_mb": round(prepare_rss / 1024), "nproc": args.nproc,
        "first_update_s": round(first_s, 1), "last_update_s": round(last_s, 1), "steps": args.steps,
        "train_peak_rss_mb": [round(p.get("VmHWM", 0) / 1024) for p in peaks],
        "train_rss_anon_mb": [round(p.get("RssAnon", 0) / 1024) for p in peaks],
        "train_rss_file_mb": [round(p.get("RssFile", 0) / 1024) for p in peaks],
        **sample, "fill": fill, "max_tokens_per_batch": config.data.max_tokens_per_batch, "config": args.config,
        "overrides": args.set}))


if __name__ == "__main__":
    main()
