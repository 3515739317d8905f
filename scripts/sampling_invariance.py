"""How often seeded sampling gives a line other samples in another batch: the share of lines (and of samples) whose
draws differ from those of the reference setting, as one JSON line.

Usage:
    python scripts/sampling_invariance.py --checkpoint R/checkpoints/best.pt [--source FILE] [--lines 1000]
        [--n-best 1] [--seed 1] [--settings 64,1,7,64w2] [--top-p 1.0] [--temperature 1.0]

Each setting is a batch size, with `wN` for N workers (`64w2`: batch 64, 2 workers). The first setting is the
reference. Every sample draws from its own random stream (seed, source tokens, sample number: see
`transformer/decoding/sampling.py`), so the draws are the same in every setting except where the probabilities they
are compared with differ in their last bits: batches of other shapes round differently, and a draw that falls that
close to a boundary between two tokens picks the other one (docs/decoding.md, Sampling).
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from transformer.translate import Translator


def read_lines(path: Path, n: int) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f][:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--source", default="../shared/data/multi30k/test_2016_flickr.de.gz")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--n-best", type=int, default=1, help="samples per line")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--settings", default="64,1,7,64w2", help="batch sizes, `wN` for N workers; first: reference")
    args = parser.parse_args()
    lines = read_lines(Path(args.source), args.lines)
    options = dict(sampling=True, seed=args.seed, top_p=args.top_p, temperature=args.temperature)
    results, seconds = {}, {}
    for setting in args.settings.split(","):
        batch, _, workers = setting.partition("w")
        translator = Translator.from_checkpoint(args.checkpoint, workers=int(workers or 1))
        start = time.perf_counter()
        out = translator.translate_n_best(lines, n_best=args.n_best, scores=False, batch_size=int(batch), **options)
        seconds[setting] = round(time.perf_counter() - start, 1)
        results[setting] = [[text for text, _ in hyps] for hyps in out]
    reference, *others = args.settings.split(",")
    report = {"checkpoint": args.checkpoint, "lines": len(lines), "n_best": args.n_best, "seed": args.seed,
              "top_p": args.top_p, "temperature": args.temperature, "reference": reference, "seconds": seconds}
    for setting in others:
        lines_differ = sum(a != b for a, b in zip(results[reference], results[setting]))
        samples_differ = sum(x != y for a, b in zip(results[reference], results[setting]) for x, y in zip(a, b))
        report[setting] = {"lines_differ": lines_differ, "share_of_lines": round(lines_differ / len(lines), 4),
                           "samples_differ": samples_differ}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
