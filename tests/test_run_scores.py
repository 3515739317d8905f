"""transformer/run_scores.py: the tables of a run's scores (scores.md), the zero-shot pairs it skips and why, and which
language output lines are written in."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import yaml

from transformer.config import load_config
from transformer.run_scores import (
    language_of,
    score_zero_shot,
    scores_table,
    vocabularies,
    zero_shot_table,
)

ROOT = Path(__file__).resolve().parents[1]


def _run(folder: Path, data: dict, scores: dict[str, tuple[float, float, str | None]]) -> Path:
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({"data": {"path": str(folder), **data}}))
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
    assert scores_table(run).splitlines() == [
        "| direction | best greedy | best beam | avg_last5 greedy | avg_last5 beam |",
        "|---|---|---|---|---|",
        "| fr-en | 30.00 / 50.00 | 31.00 / 51.00 |  |  |",
        "| en-fr | 20.00 / 40.00 | 21.50 / 41.00 |  | 22.00 / 42.00 |",
        "| mean | 25.00 / 45.00 | 26.25 / 46.00 |  |  |"]


def test_a_bilingual_run_gets_one_row_and_its_mean_is_that_row(tmp_path):
    run = _run(tmp_path / "run", {"src_lang": "de", "tgt_lang": "en"}, {
        "best_greedy": (41.97, 60.98, None), "best_beam": (42.82, 61.68, None),
        "avg_last5_greedy": (41.53, 60.67, None), "avg_last5_beam": (42.81, 61.64, None)})
    table = scores_table(run)
    assert table.endswith("| de-en | 41.97 / 60.98 | 42.82 / 61.68 | 41.53 / 60.67 | 42.81 / 61.64 |\n"
                          "| mean | 41.97 / 60.98 | 42.82 / 61.68 | 41.53 / 60.67 | 42.81 / 61.64 |\n")


def test_a_run_with_synthetic_corpora_is_scored_in_its_one_direction(tmp_path):
    config = load_config(ROOT / "configs" / "multi30k_de_en_student.yaml")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    (run / "eval_test_best_beam.json").write_text(json.dumps({"bleu": 1.0, "chrf": 2.0, "direction": None}))
    assert scores_table(run).splitlines()[2] == "| de-en |  | 1.00 / 2.00 |"


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


def test_zero_shot_skips_what_it_cannot_score_and_says_why(tmp_path):
    from transformer.run_scores import run_config

    run = _run(tmp_path / "run", {"directions": ["de-en", "en-fr"], "test_split": "test"}, {})
    said = []
    score_zero_shot(run, run_config(run), ("de-en", "fr-de", "de-fr"), out=said.append)
    assert said == [f"zero-shot: de-en is a trained direction of {run}: skipped",
                    f"zero-shot: fr-de: {run} does not train fr-en and en-de: skipped",
                    f"zero-shot: de-fr: no {run}/test.de.gz or {run}/test.fr.gz: skipped"]
    bilingual = _run(tmp_path / "bilingual", {"src_lang": "de", "tgt_lang": "en"}, {})
    said.clear()
    score_zero_shot(bilingual, run_config(bilingual), ("de-fr",), out=said.append)
    assert "not a multilingual run" in said[0] and not (bilingual / "zero_shot").exists()
    assert not (run / "zero_shot").exists()


def test_each_line_is_assigned_the_language_whose_training_words_it_uses(tmp_path):
    (tmp_path / "train.en.gz").write_bytes(gzip.compress(b"a dog runs\na dog runs\n"))
    (tmp_path / "train.de.gz").write_bytes(gzip.compress(b"ein hund rennt\nein hund rennt\n"))
    vocab = vocabularies(tmp_path, ["en", "de"], "train")
    assert [language_of(line, vocab) for line in ("A dog!", "Ein Hund.", "xyz", "")] == ["en", "de", "unknown",
                                                                                           "unknown"]


def test_output_languages_without_training_text_says_what_it_needs_in_one_line(tmp_path):
    (tmp_path / "out.txt").write_text("A dog runs.\n")
    (tmp_path / "train.en.gz").write_bytes(gzip.compress(b"A dog runs.\nA dog.\n"))
    done = subprocess.run([sys.executable, "scripts/output_languages.py", "--data", str(tmp_path), "--langs", "en",
                           "de", "--hyp", str(tmp_path / "out.txt")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"output_languages: no train.de.gz or train.de in {tmp_path}: the words of each language's training text "
        "tell the languages apart"]
