"""The test scores of a run as one table: a row per direction, a column per checkpoint and search, each cell
"BLEU / chrF", from the `eval_test_*.json` files that `make evaluate` writes (`transformer evaluate --json`).

Usage:
    python scripts/score_table.py RUN_DIR          # prints the table and writes RUN_DIR/scores.md

The files are `eval_test_CKPT_{greedy,beam}.json` (a bilingual run: its one direction, data.src_lang-tgt_lang of
RUN_DIR/config.yaml) or `eval_test_CKPT_DIRECTION_{greedy,beam}.json` (a multilingual run, DIRECTION as in
data.directions); the direction is read from the file (its "direction" field). Rows follow data.directions; a
multilingual run gets a last row with the mean over its directions. A cell with no file is empty.
"""

from __future__ import annotations

import argparse
import json
import os
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
    order = {"best": 0}  # best.pt first, then the others by name
    return directions, sorted(checkpoints, key=lambda c: (order.get(c, 1), c)), scores


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    text = (f"test split BLEU / chrF (sacreBLEU) of {args.run_dir}, from its eval_test_*.json files\n\n"
            + table(args.run_dir))
    partial = args.run_dir / "scores.md.partial"
    partial.write_text(text)
    os.replace(partial, args.run_dir / "scores.md")
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
