"""scripts/benchmark_decode.py's --bleu: the BLEU it prints beside each setting's speed is the BLEU of what the
model translates, so that a table of quality and speed from one run (docs/benchmarks.md) can be trusted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu

from transformer.data import load_split
from transformer.translate import Translator

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bleu_beside_speed_equals_the_bleu_of_the_translations(trained_run):
    best = trained_run / "checkpoints" / "best.pt"
    command = [sys.executable, "scripts/benchmark_decode.py", "--checkpoint", str(best), "--student", str(best),
               "--sentences", "40", "--modes", "greedy,beam2", "--batch-sizes", "16", "--threads", "1", "--bleu"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    results = {(r["engine"], r["mode"]): r["bleu"] for r in lines if "engine" in r and "bleu" in r}
    translator = Translator.from_checkpoint(best)
    corpus = load_split(translator.config.data, translator.config.data.test_split)
    sources, references = corpus.src[:40], corpus.tgt[:40]
    for mode, beam_size in (("greedy", 1), ("beam2", 2)):
        outputs = translator.translate(sources, beam_size=beam_size)
        expected = round(sacrebleu.corpus_bleu(outputs, [references]).score, 2)
        engines = {engine: score for (engine, m), score in results.items() if m == mode}
        assert len(engines) == 2 and set(engines.values()) == {expected}, (mode, engines, expected)
    assert 0 < min(results.values())  # the trained model translates something right
    summary = json.loads(done.stdout.splitlines()[-1])["summary"]
    assert len(summary["bleu"]) == 4
