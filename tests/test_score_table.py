"""scripts/score_table.py: the table `make evaluate` writes from a run's eval_test_*.json files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from scripts.score_table import table, zero_shot_table

ROOT = Path(__file__).resolve().parents[1]


def _run(folder: Path, data: dict, scores: dict[str, tuple[float, float, str | None]]) -> Path:
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({"data": data}))
    for name, (bleu, chrf, direction) in scores.items():
        (folder / f"eval_test_{name}.json").write_text(json.dumps({"bleu": bleu, "chrf": chrf,
                                                                    "direction": direction, "hypotheses": []}))
    (folder / "eval_test_best_greedy.hyp.txt").write_text("not a score\n")
    return folder


def test_a_multilingual_run_gets_a_row_per_direction_in_config_order_and_their_mean(tmp_path):
    run = _run(tmp_path / "run", {"directions": ["fr-en", "en-fr"]}, {
        "best_fr-en_greedy": (30.0, 50.0, "fr-en"), "best_fr-en_beam": (31.0, 51.0, "fr-en"),
        "best_en-fr_greedy": (20.0, 40.0, "en-fr"), "best_en-fr_beam": (21.5, 41.0, "en-fr"),
        "avg_last5_en-fr_beam": (22.0, 42.0, "en-fr")})
    assert table(run).splitlines() == [
        "| direction | best greedy | best beam | avg_last5 greedy | avg_last5 beam |",
        "|---|---|---|---|---|",
        "| fr-en | 30.00 / 50.00 | 31.00 / 51.00 |  |  |",
        "| en-fr | 20.00 / 40.00 | 21.50 / 41.00 |  | 22.00 / 42.00 |",
        "| mean | 25.00 / 45.00 | 26.25 / 46.00 |  |  |"]


def test_a_bilingual_run_gets_one_row_and_the_script_writes_scores_md(tmp_path):
    run = _run(tmp_path / "run", {"src_lang": "de", "tgt_lang": "en"}, {
        "best_greedy": (41.97, 60.98, None), "best_beam": (42.82, 61.68, None),
        "avg_last5_greedy": (41.53, 60.67, None), "avg_last5_beam": (42.81, 61.64, None)})
    out = subprocess.run([sys.executable, "scripts/score_table.py", str(run)], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.endswith("| de-en | 41.97 / 60.98 | 42.82 / 61.68 | 41.53 / 60.67 | 42.81 / 61.64 |\n")
    assert (run / "scores.md").read_text() == out and not (run / "scores.md.partial").exists()
    assert "mean" not in out


def test_zero_shot_and_pivot_scores_get_their_own_table_with_the_target_language_share(tmp_path):
    run = _run(tmp_path / "run", {"directions": ["de-en", "en-fr"]}, {"best_de-en_beam": (30.0, 50.0, "de-en")})
    folder = run / "zero_shot"
    folder.mkdir()
    for name, bleu, data in (("zero_best_de-fr_beam", 3.1, "test.de.gz"),
                             ("pivot_best_de-fr_beam", 29.35, "zero_shot/pivot_best_de-en_beam.txt"),
                             ("pivot_best_de-fr_greedy", 27.4, "zero_shot/pivot_best_de-en_greedy.txt")):
        (folder / f"{name}.json").write_text(json.dumps({"bleu": bleu, "chrf": 50.0, "data": f"{data} + test.fr.gz"}))
    (folder / "languages_best.jsonl").write_text(
        json.dumps({"hyp": str(folder / "zero_best_de-fr_beam.hyp.txt"), "share": {"fr": 0.628, "en": 0.34}}) + "\n")
    (folder / "pivot_best_de-en_beam.txt").write_text("a pivot leg, not a score\n")
    assert zero_shot_table(run).splitlines() == [
        "| direction (never trained) | best greedy | best beam |", "|---|---|---|",
        "| de-fr via en | 27.40 / 50.00 | 29.35 / 50.00 |",
        "| de-fr zero-shot |  | 3.10 / 50.00 (63% fr) |"]
    assert zero_shot_table(_run(tmp_path / "other", {"directions": ["de-en"]}, {})) == ""


def test_the_zero_shot_script_skips_what_it_cannot_score_and_says_why(tmp_path):
    run = _run(tmp_path / "run", {"directions": ["de-en", "en-fr"], "test_split": "test", "path": str(tmp_path)}, {})
    bilingual = _run(tmp_path / "bilingual", {"src_lang": "de", "tgt_lang": "en"}, {})
    env = {**os.environ, "BIN": str(Path(sys.executable).parent)}
    script = ["bash", "scripts/multilingual_zero_shot.sh"]
    said = subprocess.run([*script, str(run), "best", "de-en fr-de de-fr"], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True).stdout.splitlines()
    assert said == [f"zero-shot: de-en is a trained direction of {run}: skipped",
                    f"zero-shot: fr-de: {run} does not train fr-en and en-de: skipped",
                    f"zero-shot: de-fr: no {tmp_path}/test.de.gz or {tmp_path}/test.fr.gz: skipped"]
    said = subprocess.run([*script, str(bilingual)], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert "not a multilingual run" in said.stdout and not (bilingual / "zero_shot").exists()
    assert not (run / "zero_shot").exists()


def test_output_languages_without_training_text_says_what_it_needs_in_one_line(tmp_path):
    (tmp_path / "out.txt").write_text("A dog runs.\n")
    (tmp_path / "train.en.gz").write_bytes(__import__("gzip").compress(b"A dog runs.\nA dog.\n"))
    done = subprocess.run([sys.executable, "scripts/output_languages.py", "--data", str(tmp_path), "--langs", "en",
                           "de", "--hyp", str(tmp_path / "out.txt")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"output_languages: no train.de.gz or train.de in {tmp_path}: the words of each language's training text "
        "tell the languages apart (--data, --split)"]
