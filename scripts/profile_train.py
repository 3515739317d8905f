"""Where a training step's time goes: torch.profiler over a few real updates, as a table of the top operators.

Usage:
    python scripts/profile_train.py --config configs/multi30k_de_en.yaml [--run-dir runs/multi30k_de_en]
        [--steps 15] [--warmup 5] [--threads 2] [--rows 25] [--set training.precision=fp32 ...]

Prepares the data as `transformer train` does (the tokenizer is reused from --run-dir when it holds one, else
trained in a temporary folder), runs --warmup updates of `training.trainer.train_step` unprofiled, then profiles
--steps updates (CPU activities) and prints seconds per update and the operators sorted by self CPU time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from transformer.config import load_config
from transformer.data import make_batch
from transformer.model import Transformer
from transformer.training.optim import build_optimizer, learning_rate, set_lr
from transformer.training.trainer import LossComputation, epoch_batches, prepare_data, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/multi30k_de_en.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--run-dir", help="reuse the sentencepiece model of this run directory")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=25, help="operators to list")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    config = load_config(args.config, args.set)
    torch.manual_seed(config.training.seed)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="profile_train_"))
    _, train, _ = prepare_data(config, run_dir)
    model = Transformer(config.model)
    optimizer = build_optimizer(model, config.training, torch.device("cpu"))
    module = LossComputation(model, config.training.label_smoothing).train()
    batches = epoch_batches(train, config, epoch=0)[:args.warmup + args.steps]
    made = [make_batch([train.src[i] for i in g], [train.tgt[i] for i in g], g) for g in batches]
    for step, batch in enumerate(made[:args.warmup]):
        set_lr(optimizer, learning_rate(step + 1, config.training, config.model.d_model))
        train_step(module, optimizer, [batch], config)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for batch in made[args.warmup:]:
            train_step(module, optimizer, [batch], config)
        seconds = time.perf_counter() - start
    print(f"{config.training.precision}: {seconds / args.steps:.3f} s per update (profiled, {args.steps} updates)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
