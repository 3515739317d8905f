"""Distilled students (`make distill`): a teacher translates the parallel training sources (`transformer
synthesize`), a student with a deep encoder and a one-layer decoder trains on those translations only
(`data.parallel_weight: 0`, the references validating), and the student is a model like any other: it exports to
CTranslate2, translating alike, and serves (MarianMT takes post-norm models only; the students are pre-norm)."""

from __future__ import annotations

import asyncio
import gzip
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import write_small_config
from tests.test_synthesize import TINY
from transformer.cli import main
from transformer.config import ConfigError, load_config
from transformer.training.data import prepare_data, training_epochs
from transformer.translate import Translator

ROOT = Path(__file__).resolve().parents[1]


def test_the_student_recipes_train_on_the_teachers_translations_only():
    for pair in ("de_en", "en_de"):
        student = load_config(ROOT / f"configs/multi30k_{pair}_student.yaml")
        teacher = load_config(ROOT / f"configs/multi30k_{pair}.yaml")
        assert student.model.n_decoder_layers == 1 < teacher.model.n_decoder_layers  # decoding cost: the decoder
        assert student.model.n_encoder_layers > teacher.model.n_encoder_layers
        assert student.model.norm_first and not teacher.model.norm_first  # a deep encoder learns pre-norm
        real, *distilled = student.data.corpora
        assert real.weight == 0
        assert all(c.weight == 1 and not c.tag and c.held_out is False for c in distilled)
        assert [c.path for c in distilled] == [f"runs/distilled/train_{pair}", f"runs/distilled/task2_{pair}"]
        teachers = [entry.made_by.model for entry in student.data.synthetic]
        assert teachers == [[str(ROOT / f"configs/multi30k_{pair}_bt.yaml")]] * 2  # the back-translation model
        assert [entry.made_by.beam_size for entry in student.data.synthetic] == [4, 4]


def test_the_multilingual_students_corpora_are_bound_to_their_directions_and_untagged():
    first = load_config(ROOT / "configs/multi30k_multilingual_student.yaml")
    second = load_config(ROOT / "configs/multi30k_multilingual_student_task2.yaml")
    assert [c.direction for c in first.data.corpora if c.held_out] == [
        "de-en", "en-de", "fr-en", "en-fr", "cs-en", "en-cs", "de-fr", "fr-de"]
    distilled = [c for c in second.data.corpora if not c.held_out]
    assert [(c.direction, c.path, c.tag) for c in distilled] == [
        ("de-en", "runs/distilled/train_de_en", None), ("en-de", "runs/distilled/train_en_de", None),
        ("de-en", "runs/distilled/task2_de_en", None), ("en-de", "runs/distilled/task2_en_de", None)]
    assert second.data.synthetic[:2] == first.data.synthetic  # the first stage's corpora, the same way made
    assert second.training.init_from == str(ROOT / "configs/multi30k_multilingual_student.yaml")
    assert second.model == first.model  # what init_from fixes, stated as it is


@pytest.mark.parametrize("resume", [False, True])
def test_make_train_passes_init_from_to_a_new_run_only(resume):
    """`make train INIT_FROM=C` starts the run from C (train --init-from); with RESUME=1 the run's last.pt says where
    it started, and --init-from is left out (train refuses the two together)."""
    args = ["make", "-n", "--no-print-directory", "train", "INIT_FROM=a/best.pt", "RUN_DIR=runs/x"]
    printed = subprocess.run(args + (["RESUME=1"] if resume else []), cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    train = next(line for line in printed.splitlines() if "transformer train" in line)
    train += printed.split(train, 1)[1].splitlines()[1]  # the command's continuation line
    assert ("--resume" in train) is resume
    assert ("--init-from a/best.pt" in train) is not resume
    assert ("--config" in train) is not resume  # a run resumes with its own config.yaml


def test_a_parallel_weight_of_0_needs_a_synthetic_corpus(tmp_path, multi30k_subset):
    with pytest.raises(ConfigError, match="data.parallel_weight: must be positive, or 0 beside data.synthetic"):
        load_config(write_small_config(tmp_path, multi30k_subset, data={"parallel_weight": 0.0}))


@pytest.mark.slow
def test_the_toy_chain_teacher_then_its_translations_then_a_student(trained_run, multi30k_subset, tmp_path,
                                                                   capsys):
    """As `make distill` runs it: the teacher (trained_run, de->en) translates training sources with beam search,
    a pre-norm 2+1-layer student (as the recipes) trains on its outputs only, then exports to CTranslate2 and
    serves; MarianMT, which is post-norm only, refuses it with the reason and exit status 2."""
    sources = gzip.decompress((multi30k_subset / "train.de.gz").read_bytes()).decode().split("\n")[:800]
    (tmp_path / "train.de").write_text("\n".join(sources) + "\n")
    distilled = tmp_path / "distilled"
    done = subprocess.run([sys.executable, "-m", "transformer", "synthesize", "--checkpoint",
                           str(trained_run / "checkpoints" / "best.pt"), "--input", str(tmp_path / "train.de"),
                           "--output", str(distilled), "--beam-size", "2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    teacher = Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt")
    kept = gzip.decompress((distilled / "train.de.gz").read_bytes()).decode().splitlines()
    outputs = gzip.decompress((distilled / "train.en.gz").read_bytes()).decode().splitlines()
    assert len(kept) == len(outputs) > 600
    assert outputs[:20] == teacher.translate(kept[:20], beam_size=2)  # the targets are the teacher's translations
    model = {**TINY["model"], "n_encoder_layers": 2, "n_decoder_layers": 1, "norm_first": True}
    data = {**TINY["data"], "synthetic": [{"path": str(distilled), "name": "kd", "tag": ""}], "parallel_weight": 0.0,
            "subword_sampling": True}
    config_path = write_small_config(tmp_path, multi30k_subset, **{**TINY, "model": model, "data": data})
    config = load_config(config_path)
    tokenizer, caches, _ = prepare_data(config, tmp_path / "probe")
    epoch = training_epochs(config, tmp_path / "probe", tokenizer, caches).epoch(0)
    assert list(np.bincount(epoch.direction, minlength=2)) == [0, len(caches[1])]  # references: none; each
    assert sorted(epoch.index[epoch.direction == 1].tolist()) == list(range(len(caches[1])))  # translation once
    later = training_epochs(config, tmp_path / "probe", tokenizer, caches)
    parts = later.epoch(1).parts
    assert parts[0] is caches[0] and parts[1] is not caches[1]  # the references, not trained on, are not sampled
    assert sorted(p.name for p in (tmp_path / "probe" / "subword_samples").iterdir()) == ["kd"]
    run = tmp_path / "student"
    assert main(["train", "--config", str(config_path), "--run-dir", str(run)]) == 0
    best = run / "checkpoints" / "best.pt"
    student = Translator.from_checkpoint(best)
    assert student.config.model.n_decoder_layers == 1
    lines = ["Ein Hund läuft.", "Zwei Männer spielen Fußball.", "Eine Frau liest ein Buch."]
    greedy = student.translate(lines, beam_size=1)
    out = tmp_path / "ctranslate2"
    assert main(["export", "--format", "ctranslate2", "--checkpoint", str(best), "--output", str(out)]) == 0
    assert Translator.from_checkpoint(out).translate(lines, beam_size=1) == greedy
    assert main(["export", "--format", "huggingface", "--checkpoint", str(best), "--output", str(tmp_path / "hf")]) == 2
    assert "model.norm_first is true: MarianMTModel is post-norm" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    from transformer.serve.service import TranslationService

    service = TranslationService(student)

    async def serve():
        service.start()
        try:
            return await service.translate(lines, {"beam_size": 1})
        finally:
            await service.stop()
    assert asyncio.run(serve())["translations"] == greedy
