"""Which language a system's output lines are written in: the share of lines assigned to each candidate language,
as one JSON line. Used to measure off-target output of zero-shot directions (a model asked for French that writes
English), which BLEU alone does not show.

Usage:
    python scripts/output_languages.py --hyp H.txt [--hyp H2.txt ...] [--data ../shared/data/multi30k]
        [--langs de en fr cs] [--split train]

A line is assigned to the language whose training split knows the largest share of its words (lowercased,
punctuation stripped; ties and lines without a known word: "unknown"). On Multi30k's captions the four
languages share few words, so the rule is exact on their own references: run it on test_2016_flickr.{de,en,fr,cs}.gz
to check (each file is assigned to its own language on >= 99% of lines).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from transformer.data.text import read_lines

WORD = re.compile(r"\w+", re.UNICODE)


def words(line: str) -> list[str]:
    return WORD.findall(line.lower())


def vocabularies(data: Path, langs: list[str], split: str) -> dict[str, set[str]]:
    """Per language, the words of its `split` seen at least twice (once-seen words are mostly names and typos,
    which the languages share)."""
    out = {}
    for lang in langs:
        path = next((p for p in (data / f"{split}.{lang}.gz", data / f"{split}.{lang}") if p.is_file()), None)
        if path is None:
            raise SystemExit(f"output_languages: no {split}.{lang}.gz or {split}.{lang} in {data}: the words of each "
                             "language's training text tell the languages apart (--data, --split)")
        counts = Counter(w for line in read_lines(path) for w in words(line))
        out[lang] = {w for w, n in counts.items() if n >= 2}
    return out


def language_of(line: str, vocab: dict[str, set[str]]) -> str:
    tokens = words(line)
    if not tokens:
        return "unknown"
    share = {lang: sum(t in known for t in tokens) / len(tokens) for lang, known in vocab.items()}
    best = max(share.values())
    winners = [lang for lang, value in share.items() if value == best]
    return winners[0] if best > 0 and len(winners) == 1 else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hyp", action="append", required=True, help="a file of output lines (plain or .gz)")
    parser.add_argument("--data", default="../shared/data/multi30k", help="folder of {split}.{lang}.gz files")
    parser.add_argument("--langs", nargs="+", default=["de", "en", "fr", "cs"])
    parser.add_argument("--split", default="train")
    args = parser.parse_args()
    vocab = vocabularies(Path(args.data), args.langs, args.split)
    for hyp in args.hyp:
        lines = read_lines(hyp)
        counts = Counter(language_of(line, vocab) for line in lines)
        print(json.dumps({"hyp": hyp, "n_lines": len(lines),
                          "share": {lang: round(counts[lang] / len(lines), 4)
                                    for lang in [*args.langs, "unknown"] if counts[lang]}}))


if __name__ == "__main__":
    main()
