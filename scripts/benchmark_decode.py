"""Decoding speed: greedy and beam search, with and without the key/value cache, at two batch sizes.

Usage:
    python scripts/benchmark_decode.py --checkpoint runs/multi30k_de_en/checkpoints/best.pt
        [--sentences 1000] [--threads 2] [--modes greedy,beam4] [--batch-sizes 1,64] [--no-uncached]

Reads the source side of the checkpoint's test split (Multi30k test_2016_flickr: 1,000 sentences), decodes
it in each setting and prints one JSON line per setting:
    {"mode": "beam4", "cache": true, "batch_size": 64, "sentences": 1000, "seconds": ..,
     "sentences_per_s": .., "tgt_tokens_per_s": .., "threads": 2}
tgt_tokens_per_s counts the output tokens (eos included) per second of decoding, tokenization excluded.
A last line {"summary": ...} gives the cache speed-up of each mode at each batch size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from transformer.data import load_split
from transformer.translate import Translator


def run(translator: Translator, src_ids: list, mode: str, use_cache: bool, batch_size: int) -> dict:
    beam_size = 1 if mode == "greedy" else int(mode.removeprefix("beam"))
    options = dataclasses.replace(translator.config.decoding, beam_size=beam_size, n_best=1, batch_size=batch_size)
    start = time.perf_counter()
    hyps = translator.decode_ids(src_ids, options, use_cache=use_cache)
    seconds = time.perf_counter() - start
    n_tokens = sum(len(h[0].tokens) + h[0].finished for h in hyps)
    return {"mode": mode, "cache": use_cache, "batch_size": batch_size, "sentences": len(src_ids),
            "seconds": round(seconds, 2), "sentences_per_s": round(len(src_ids) / seconds, 1),
            "tgt_tokens_per_s": round(n_tokens / seconds, 1), "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default="greedy,beam4")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--no-uncached", action="store_true", help="skip the (slow) uncached runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    translator = Translator.from_checkpoint(args.checkpoint, device="cpu")
    data = translator.config.data
    corpus = load_split(data, data.test_split)
    src_ids = translator.tokenizer.encode_src(corpus.src[:args.sentences])
    translator.decode_ids(src_ids[:16], translator.config.decoding)  # warm-up
    results = []
    for mode in args.modes.split(","):
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            for use_cache in ((True,) if args.no_uncached else (True, False)):
                result = run(translator, src_ids, mode, use_cache, batch_size)
                results.append(result)
                print(json.dumps(result), flush=True)
    speedups = {}
    for r in results:
        if not r["cache"]:
            cached = next(c for c in results if c["cache"] and c["mode"] == r["mode"]
                          and c["batch_size"] == r["batch_size"])
            speedups[f"{r['mode']}_batch{r['batch_size']}"] = round(r["seconds"] / cached["seconds"], 2)
    print(json.dumps({"summary": {"cache_speedup": speedups}}))


if __name__ == "__main__":
    main()
