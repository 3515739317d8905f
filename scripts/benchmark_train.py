"""Training speed on real data: tokens/s, time per step, achieved FLOP/s, MFU and peak memory, as one JSON line.

Usage:
    python scripts/benchmark_train.py --config configs/multi30k_de_en.yaml [--steps 30] [--warmup 5]
        [--threads 2] [--set model.n_heads=8 --set training.precision=fp32 ...] [--profile 25] [--system-malloc]

It prepares the data exactly as `transformer train` does (tokenizer trained in a temporary folder unless
--run-dir holds one), runs `--warmup` updates, then times `--steps` updates of the real training step
(`training.trainer.train_step`, batches in the recipe's order) and prints:

    {"precision", "threads", "steps", "tgt_tokens_per_s", "src_tgt_tokens_per_s", "s_per_step",
     "tgt_tokens_per_step", "gflops_per_s", "mflop_per_tgt_token", "matmul_gflops_fp32", "matmul_gflops_bf16",
     "mfu_fp32", "mfu_bf16", "page_faults_per_step", "kernel_s_per_step", "reuse_freed_memory", "peak_rss_mb",
     "parameters", "overrides"}

`precision` is what the recipe's `training.precision` resolves to here (`auto`: see `transformer/device.py`).
Like `transformer train`, it first calls `transformer.device.reuse_freed_memory` (glibc keeps freed memory for
reuse); `--system-malloc` skips that, to measure what it changes. `page_faults_per_step` (minor faults) and
`kernel_s_per_step` (CPU seconds in the kernel) are per timed update.

FLOPs are counted from the model's shapes, per sentence with its real lengths (ls source, lt target tokens,
eos/bos included), as 2 FLOPs per multiply-add, and training = 3 x forward (backward is twice forward):

    encoder, per layer:  ls·(4·d² + 2·d·d_ff) + 2·ls²·d
    decoder, per layer:  lt·(4·d² + 2·d² + 2·d·d_ff) + ls·2·d² + 2·lt²·d + 2·lt·ls·d
                         (self-attention Q,K,V,O; cross-attention Q,O on the target, K,V on the source;
                          feed-forward; attention scores and weighted sums)
    output projection:   lt·d·V

MFU is the achieved rate over the rate of a large (4096³) matrix multiplication measured in the same run, in
fp32 and in bf16 (the peak this CPU reaches in each precision).

With --profile N, the timed updates run under torch.profiler (CPU activities; the figures above then include
its overhead) and the N operators with the most self CPU time are printed after the JSON line: where the time goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from transformer.config import Config, load_config
from transformer.device import resolve_precision, reuse_freed_memory
from transformer.fast.dropout import use_fast_cpu_dropout
from transformer.model import Transformer
from transformer.training.data import epoch_batches, prepare_data, training_epochs
from transformer.training.loss import LossComputation
from transformer.training.optim import build_optimizer, learning_rate, set_lr
from transformer.training.trainer import train_step


def matmul_gflops(dtype: torch.dtype, size: int = 4096, repeats: int = 5) -> float:
    """Measured GFLOP/s of a size x size x size matrix multiplication.

    The size grows from 256 by doubling up to `size` while one product takes under 0.25 s, so that a dtype this
    CPU computes slowly (bf16 without AVX-512 BF16 or AMX: a few GFLOP/s) is measured in seconds, not minutes.
    """
    n = 256
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        start = time.perf_counter()
        a @ b
        if n >= size or time.perf_counter() - start > 0.25:
            break
        n *= 2
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e9


def training_flops(config: Config, src_len: int, tgt_len: int) -> float:
    """Forward + backward FLOPs of one sentence pair (formula in the module docstring)."""
    m = config.model
    d, d_ff = m.d_model, m.d_ff
    ls, lt = src_len, tgt_len
    encoder = m.n_encoder_layers * (ls * (4 * d * d + 2 * d * d_ff) + 2 * ls * ls * d)
    decoder = m.n_decoder_layers * (lt * (6 * d * d + 2 * d * d_ff) + ls * 2 * d * d + 2 * lt * lt * d
                                    + 2 * lt * ls * d)
    output = lt * d * m.tgt_vocab_size
    return 3 * 2 * (encoder + decoder + output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/multi30k_de_en.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--run-dir", help="reuse the sentencepiece model of this run directory")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the timed updates and list the N most expensive operators")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's allocator settings as they are (see reuse_freed_memory)")
    args = parser.parse_args()
    reused = False if args.system_malloc else reuse_freed_memory()
    torch.set_num_threads(args.threads)
    config = load_config(args.config, args.set)
    precision, _ = resolve_precision(config.training.precision, torch.device("cpu"))
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, precision=precision))
    torch.manual_seed(config.training.seed)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="bench_train_"))
    tokenizer, train, _ = prepare_data(config, run_dir)
    train = training_epochs(config, run_dir, tokenizer, train).epoch(0)  # the corpora as epoch 0 of training has them
    model = Transformer(config.model)
    use_fast_cpu_dropout(model)  # as `transformer train` on the CPU (training/trainer.py)
    optimizer = build_optimizer(model, config.training, torch.device("cpu"))
    batches = epoch_batches(train, config, epoch=0)
    module = LossComputation(model, config.training.label_smoothing).train()
    if config.training.compile:
        module = torch.compile(module)
    profiler = profile(activities=[ProfilerActivity.CPU]) if args.profile else None
    n_tgt = n_src = 0
    flops = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if profiler is not None:
                profiler.start()
            start = time.perf_counter()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            n_tgt = n_src = 0
            flops = 0.0
        group = batches[step * config.training.accumulate_steps:(step + 1) * config.training.accumulate_steps]
        made = [train.batch(g) for g in group]
        set_lr(optimizer, learning_rate(step + 1, config.training, config.model.d_model))
        train_step(module, optimizer, made, config)
        n_tgt += sum(b.n_tgt_tokens for b in made)
        n_src += sum(b.n_src_tokens for b in made)
        flops += sum(training_flops(config, int(train.src_lengths[i]), int(train.tgt_lengths[i]))
                     for g in group for i in g)
    seconds = time.perf_counter() - start
    end_usage = resource.getrusage(resource.RUSAGE_SELF)
    if profiler is not None:
        profiler.stop()
    fp32, bf16 = matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16)
    achieved = flops / seconds / 1e9
    print(json.dumps({
        "precision": config.training.precision, "threads": args.threads, "steps": args.steps,
        "tgt_tokens_per_s": round(n_tgt / seconds, 1), "src_tgt_tokens_per_s": round((n_tgt + n_src) / seconds, 1),
        "s_per_step": round(seconds / args.steps, 3), "tgt_tokens_per_step": round(n_tgt / args.steps),
        "gflops_per_s": round(achieved, 1), "mflop_per_tgt_token": round(flops / n_tgt / 1e6, 1),
        "matmul_gflops_fp32": round(fp32, 1), "matmul_gflops_bf16": round(bf16, 1),
        "mfu_fp32": round(achieved / fp32, 3), "mfu_bf16": round(achieved / bf16, 3),
        "page_faults_per_step": round((end_usage.ru_minflt - usage.ru_minflt) / args.steps),
        "kernel_s_per_step": round((end_usage.ru_stime - usage.ru_stime) / args.steps, 3),
        "reuse_freed_memory": reused,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "parameters": model.num_parameters(), "overrides": args.set}))
    if profiler is not None:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile))


if __name__ == "__main__":
    main()
