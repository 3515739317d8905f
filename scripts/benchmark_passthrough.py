"""Characters the vocabulary lacks: how much of the translation around them survives, with and without copying them
through (`decoding.copy_unknown`), as one JSON line.

Usage:
    python scripts/benchmark_passthrough.py --checkpoint runs/multi30k_de_en/checkpoints/best.pt \\
        [--data ../shared/data/multi30k] [--n 48] [--beam-size 4]

`--checkpoint` may also be a CTranslate2 folder (`transformer export --format ctranslate2`).

The set: the first `--n` lines of test_2016_flickr.de, each with one or two spans the Multi30k vocabulary lacks
(😆, 🚲, a ZWJ family, 🇩🇪, a CJK character, 👍🏽, England's tag flag, keycap 1), placed in turn at the start, after
the second word, written onto the last word, and written onto the first word plus a second one at the end.

For each setting it prints: chrF (sacrebleu, corpus level) of the outputs with the spans removed against the
translations of the same lines without the spans; the share of spans that come back exactly once; the number of
sentences whose span-free output differs from the clean translation.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import sacrebleu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer.translate import Translator  # noqa: E402

SPANS = ["\U0001F606", "\U0001F6B2", "\U0001F468\u200d\U0001F469\u200d\U0001F467", "\U0001F1E9\U0001F1EA", "\u732b",
         "\U0001F44D\U0001F3FD", "\U0001F3F4\U000E0067\U000E0062\U000E0065\U000E006E\U000E0067\U000E007F",
         "1\ufe0f\u20e3"]
"""😆, 🚲, a ZWJ family, the German flag, a CJK character, a thumb with a skin tone, England's tag flag, keycap 1."""


def build_set(lines: list[str]) -> list[tuple[str, str, list[str]]]:
    """(sentence with spans, sentence without, spans) per line."""
    out = []
    for i, line in enumerate(lines):
        words, span = line.split(), SPANS[i % len(SPANS)]
        where = i % 4
        if where == 0:
            out.append((f"{span} {line}", line, [span]))
        elif where == 1:
            out.append((" ".join(words[:2] + [span] + words[2:]), line, [span]))
        elif where == 2:
            out.append((" ".join(words[:-1] + [words[-1] + span]), line, [span]))
        else:
            other = SPANS[(i + 3) % len(SPANS)]
            out.append((" ".join([words[0] + span] + words[1:] + [other]), line, [span, other]))
    return out


def without_spans(text: str, spans: list[str]) -> str:
    """`text` with the spans removed and its whitespace normalised."""
    for span in spans:
        text = text.replace(span, " ")
    return " ".join(text.split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--beam-size", type=int, default=4)
    args = parser.parse_args()
    lines = gzip.open(Path(args.data) / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().split("\n")
    cases = build_set([line for line in lines if line.strip()][:args.n])
    translator = Translator.from_checkpoint(args.checkpoint)  # a checkpoint or a CTranslate2 folder
    clean = [" ".join(t.split()) for t in translator.translate([c for _, c, _ in cases], beam_size=args.beam_size)]
    result = {"checkpoint": args.checkpoint, "sentences": len(cases), "spans": sum(len(s) for _, _, s in cases),
              "beam_size": args.beam_size}
    for name, copy in (("copy_unknown", True), ("no_copy_unknown", False)):
        outputs = translator.translate([s for s, _, _ in cases], beam_size=args.beam_size, copy_unknown=copy)
        around = [without_spans(o, spans) for o, (_, _, spans) in zip(outputs, cases)]
        once = sum(o.count(span) == spans.count(span) for o, (_, _, spans) in zip(outputs, cases) for span in spans)
        result[name] = {"chrf_around": round(sacrebleu.corpus_chrf(around, [clean]).score, 1),
                        "spans_once_pct": round(100 * once / result["spans"], 1),
                        "sentences_changed": sum(a != c for a, c in zip(around, clean))}
    print(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    main()
