"""The test scores of a run as one table: a row per direction, a column per checkpoint and search, each cell
"BLEU / chrF", from the `eval_test_*.json` files that `make evaluate` writes (`transformer evaluate --json`).

Usage:
    python scripts/score_table.py RUN_DIR          # prints the table and writes RUN_DIR/scores.md

A multilingual run's zero-shot and pivot scores (`scripts/multilingual_zero_shot.sh`, RUN_DIR/zero_shot/) follow
in a second table: a row per direction never trained ("zero-shot") and through the pivot language ("via en"),
each cell with the share of output lines written in the target language where the script measured it.

The files are `eval_test_CKPT_{greedy,beam}.json` (a bilingual run: its one direction, data.src_lang-tgt_lang of
RUN_DIR/config.yaml) or `eval_test_CKPT_DIRECTION_{greedy,beam}.json` (a multilingual run, DIRECTION as in
data.directions); the direction is read from the file (its "direction" field). Rows follow data.directions; a
multilingual run gets a last row with the mean over its directions. A cell with no file is empty.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import yaml

SEARCHES = ("greedy", "beam")


def read_scores(run_dir: Path) -> tuple[list[str], list[str], dict[tuple[str, str, str], tuple[float, float]]]:
    """(directions, checkpoints, {(direction, checkpoint, search): (bleu, chrf)}) of the run's eval_test files.

    Raises:
        SystemExit: RUN_DIR has no config.yaml.
    """
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise SystemExit(f"score_table: {config_path} not found (RUN_DIR must be a run directory)")
    data = yaml.safe_load(config_path.read_text())["data"]
    directions = list(data.get("directions") or []) or [f"{data.get('src_lang')}-{data.get('tgt_lang')}"]
    scores, checkpoints = {}, []
    for path in sorted(run_dir.glob("eval_test_*.json")):
        stem = path.stem.removeprefix("eval_test_")
        name, _, search = stem.rpartition("_")
        if search not in SEARCHES:
            continue
        record = json.loads(path.read_text())
        direction = record.get("direction") or directions[0]
        checkpoint = name.removesuffix(f"_{direction}") if record.get("direction") else name
        if checkpoint not in checkpoints:
            checkpoints.append(checkpoint)
        scores[direction, checkpoint, search] = (record["bleu"], record["chrf"])
    return directions, _in_order(checkpoints), scores


def _in_order(checkpoints: list[str]) -> list[str]:
    """best.pt's name first, then the others by name."""
    return sorted(checkpoints, key=lambda c: (c != "best", c))


def table(run_dir: Path) -> str:
    """The Markdown table of `read_scores`."""
    directions, checkpoints, scores = read_scores(run_dir)
    columns = [(c, s) for c in checkpoints for s in SEARCHES]
    lines = ["| direction | " + " | ".join(f"{c} {s}" for c, s in columns) + " |",
             "|---|" + "---|" * len(columns)]
    cell = lambda value: "" if value is None else f"{value[0]:.2f} / {value[1]:.2f}"  # noqa: E731
    for direction in directions:
        lines.append(f"| {direction} | " + " | ".join(cell(scores.get((direction, c, s))) for c, s in columns) + " |")
    if len(directions) > 1:
        means = []
        for c, s in columns:
            values = [scores.get((d, c, s)) for d in directions]
            means.append(None if None in values else tuple(sum(v[i] for v in values) / len(values) for i in (0, 1)))
        lines.append("| mean | " + " | ".join(cell(m) for m in means) + " |")
    return "\n".join(lines) + "\n"


def zero_shot_table(run_dir: Path) -> str:
    """The Markdown table of RUN_DIR/zero_shot/{zero,pivot}_CKPT_SRC-TGT_{greedy,beam}.json; "" if there are none."""
    folder, rows, scores, checkpoints = run_dir / "zero_shot", [], {}, []
    shares = {}  # hypotheses file name -> {language: share of lines}
    for path in sorted(folder.glob("languages_*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            shares[Path(record["hyp"]).name] = record["share"]
    for path in sorted(folder.glob("*.json")):
        rest, _, search = path.stem.rpartition("_")
        rest, _, pair = rest.rpartition("_")
        kind, _, checkpoint = rest.partition("_")
        if search not in SEARCHES or kind not in ("zero", "pivot") or "-" not in pair:
            continue
        record = json.loads(path.read_text())
        tgt = pair.split("-")[1]
        share = shares.get(path.with_suffix(".hyp.txt").name, {}).get(tgt)
        pivot = re.search(r"pivot_.*_[^_-]+-([^_-]+)_(?:greedy|beam)\.txt", record.get("data", ""))
        label = f"{pair} zero-shot" if kind == "zero" else f"{pair} via {pivot.group(1) if pivot else 'the pivot'}"
        if label not in rows:
            rows.append(label)
        if checkpoint not in checkpoints:
            checkpoints.append(checkpoint)
        scores[label, checkpoint, search] = (record["bleu"], record["chrf"], share, tgt)
    if not rows:
        return ""
    columns = [(c, s) for c in _in_order(checkpoints) for s in SEARCHES]
    lines = ["| direction (never trained) | " + " | ".join(f"{c} {s}" for c, s in columns) + " |",
             "|---|" + "---|" * len(columns)]

    def cell(value):
        if value is None:
            return ""
        bleu, chrf, share, tgt = value
        return f"{bleu:.2f} / {chrf:.2f}" + ("" if share is None else f" ({share:.0%} {tgt})")

    for label in sorted(rows):
        lines.append(f"| {label} | " + " | ".join(cell(scores.get((label, c, s))) for c, s in columns) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    text = (f"test split BLEU / chrF (sacreBLEU) of {args.run_dir}, from its eval_test_*.json files\n\n"
            + table(args.run_dir))
    zero_shot = zero_shot_table(args.run_dir)
    if zero_shot:
        text += ("\ndirections never trained, directly and through the pivot language (zero_shot/*.json; in "
                 "brackets the output lines in the target language)\n\n" + zero_shot)
    partial = args.run_dir / "scores.md.partial"
    partial.write_text(text)
    os.replace(partial, args.run_dir / "scores.md")
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
