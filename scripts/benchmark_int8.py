"""int8 against float32 on test_2016_flickr: BLEU, decoding time, and the lines that loop on one piece, as JSON lines.

Usage:
    python scripts/benchmark_int8.py --checkpoint runs/multi30k_de_en/checkpoints/best.pt \\
        [--ct2-int8 R/ct2_int8] [--data ../shared/data/multi30k]

For float32 and `--quantization int8` (and, with `--ct2-int8`, a CTranslate2 int8 export: `transformer export
--quantization int8`), greedy and beam 4, with decoding.max_repeat at its default (3) and at 0 (no limit), it
prints: BLEU (sacrebleu), seconds to translate the 1,000 lines (2 threads, one process, model loaded), the number of
outputs with one piece 5 or more times in a row, how many of those float32 (same search, same max_repeat) does
not have, and how many outputs differ from float32's.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
import time
from pathlib import Path

import sacrebleu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer import Translator  # noqa: E402


def longest_run(tokens: list[int]) -> int:
    return max((len(list(run)) for _, run in itertools.groupby(tokens)), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--ct2-int8", help="a CTranslate2 folder exported with --quantization int8")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    args = parser.parse_args()
    read = lambda lang: gzip.open(Path(args.data) / f"test_2016_flickr.{lang}.gz", "rt",  # noqa: E731
                                  encoding="utf-8").read().rstrip("\n").split("\n")
    src, ref = read("de"), read("en")
    engines = {"float32": Translator.from_checkpoint(args.checkpoint),
               "int8": Translator.from_checkpoint(args.checkpoint, quantization="int8")}
    if args.ct2_int8:
        engines["ctranslate2 int8"] = Translator.from_checkpoint(args.ct2_int8)  # a CTranslate2 folder
    tokenizer = engines["float32"].tokenizer
    looping: dict[tuple[int, int], set[int]] = {}
    reference: dict[tuple[int, int], list[str]] = {}  # float32's outputs
    for name, engine in engines.items():
        for beam_size, max_repeat in itertools.product((1, 4), (3, 0)):
            start = time.perf_counter()
            out = engine.translate(src, beam_size=beam_size, max_repeat=max_repeat)
            seconds = time.perf_counter() - start
            loops = {i for i, text in enumerate(out) if longest_run(tokenizer.encode_tgt([text])[0]) >= 5}
            looping.setdefault((beam_size, max_repeat), loops)  # float32 comes first
            same = reference.setdefault((beam_size, max_repeat), out)
            print(json.dumps({"engine": name, "beam_size": beam_size, "max_repeat": max_repeat,
                              "bleu": round(sacrebleu.corpus_bleu(out, [ref]).score, 2), "seconds": round(seconds, 2),
                              "lines_looping": len(loops),
                              "looping_not_in_float32": len(loops - looping[beam_size, max_repeat]),
                              "lines_changed_from_float32": sum(a != b for a, b in zip(out, same))}), flush=True)


if __name__ == "__main__":
    main()
