"""Which language a system's output lines are written in: the share of lines assigned to each candidate language,
as one JSON line per file. Used to measure off-target output of zero-shot directions (a model asked for French that
writes English), which BLEU alone does not show (`transformer evaluate --run-dir R --zero-shot` measures its own).

Usage:
    python scripts/output_languages.py --hyp H.txt [--hyp H2.txt ...] [--data ../shared/data/multi30k]
        [--langs de en fr cs] [--split train]

A line is assigned to the language whose training split knows the largest share of its words
(`transformer/run_scores.py: language_of`). On Multi30k's captions the four languages share few words, so the rule
is exact on their own references: run it on test_2016_flickr.{de,en,fr,cs}.gz to check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformer.data import DataError
from transformer.run_scores import output_languages, vocabularies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hyp", action="append", required=True, help="a file of output lines (plain or .gz)")
    parser.add_argument("--data", default="../shared/data/multi30k", help="folder of {split}.{lang}.gz files")
    parser.add_argument("--langs", nargs="+", default=["de", "en", "fr", "cs"])
    parser.add_argument("--split", default="train")
    args = parser.parse_args()
    try:
        vocab = vocabularies(Path(args.data), args.langs, args.split)
    except DataError as err:
        print(f"output_languages: {err}", file=sys.stderr)
        return 1
    for hyp in args.hyp:
        print(json.dumps(output_languages(hyp, vocab)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
