"""Chains (`transformer chain`, transformer/chain.py): the plan of each chain recipe, the one rule of "done" per kind
of step on a temporary tree, and a toy back-translation chain run end to end through recipes written as the
committed ones are (delta recipes with `made_by`), killed and run again."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import MULTI30K, SMALL_CONFIG
from transformer.chain import FINISHED, MISSING, STOPPED, check_needs, describe, plan, run_dir_of
from transformer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def _steps(steps):
    return [(s.kind, str(s.output)) for s in steps]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run folders (runs/...) are relative to the working directory: a temporary one."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _fake_run(run_dir: Path, recipe: Path, step: int) -> None:
    """A run folder whose last.pt has made `step` updates of `recipe` (what the train rule reads)."""
    config = load_config(recipe)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    torch.save({"model": {}, "config": config.to_dict(), "train_state": {"step": step}},
               run_dir / "checkpoints" / "last.pt")


def test_back_translation_plans_its_reverse_model_the_corpus_then_the_model(in_tmp):
    steps = plan(CONFIGS / "multi30k_fr_en_bt.yaml")
    assert _steps(steps) == [
        ("train", "runs/multi30k_en_fr_reverse"), ("evaluate", "runs/multi30k_en_fr_reverse/scores.md"),
        ("synthesize", "runs/synthetic/task2_en_fr"),
        ("train", "runs/multi30k_fr_en_bt"), ("evaluate", "runs/multi30k_fr_en_bt/scores.md")]
    synthesize = steps[2]
    assert synthesize.command[:3] == ("synthesize", "--checkpoint", "runs/multi30k_en_fr_reverse/checkpoints/best.pt")
    assert "runs/multi30k_en_fr_reverse/checkpoints/best.pt" in map(str, synthesize.needs)
    assert synthesize.command[synthesize.command.index("--exclude") + 1].endswith("multi30k/train.en.gz")
    assert steps[3].needs == (Path("runs/synthetic/task2_en_fr"),)
    assert all(s.state() == MISSING for s in steps)


def test_back_translation_with_a_given_reverse_model_trains_none(in_tmp):
    given = in_tmp / "reverse.pt"
    recipe = in_tmp / "bt.yaml"
    recipe.write_text(yaml.safe_dump({"base": str(CONFIGS / "multi30k_de_en_bt.yaml"), "data": {"synthetic": [
        {"path": "corpus", "tag": "<bt>", "made_by": {"model": [str(given)], "input": ["mono.en"]}}]}}))
    steps = plan(recipe)
    assert _steps(steps) == [("synthesize", "corpus"), ("train", "runs/bt"), ("evaluate", "runs/bt/scores.md")]
    with pytest.raises(ConfigError, match=r"needs .*reverse.pt, which does not exist"):
        check_needs(steps)  # before anything runs
    given.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"needs mono.en"):
        check_needs(steps)
    Path("mono.en").write_text("a\n")
    check_needs(steps)


def test_distillation_plans_the_teachers_chain_and_an_ensemble_of_teachers(in_tmp):
    steps = plan(CONFIGS / "multi30k_de_en_student.yaml")
    assert _steps(steps) == [
        ("train", "runs/multi30k_en_de_reverse"), ("evaluate", "runs/multi30k_en_de_reverse/scores.md"),
        ("synthesize", "runs/synthetic/task2_en_de"),
        ("train", "runs/multi30k_de_en_bt"), ("evaluate", "runs/multi30k_de_en_bt/scores.md"),
        ("synthesize", "runs/distilled/train_de_en"), ("synthesize", "runs/distilled/task2_de_en"),
        ("train", "runs/multi30k_de_en_student"), ("evaluate", "runs/multi30k_de_en_student/scores.md")]
    assert steps[5].command[steps[5].command.index("--beam-size") + 1] == "4"
    recipe = in_tmp / "student.yaml"
    recipe.write_text(yaml.safe_dump({"base": str(CONFIGS / "multi30k_de_en_student.yaml"), "data": {"synthetic": [
        {"path": "kd", "tag": "", "made_by": {"model": ["a.pt", str(CONFIGS / "multi30k_de_en.yaml")],
                                              "input": ["train.de"]}}]}}))
    steps = plan(recipe)
    assert _steps(steps) == [
        ("train", "runs/multi30k_de_en"), ("evaluate", "runs/multi30k_de_en/scores.md"), ("synthesize", "kd"),
        ("train", "runs/student"), ("evaluate", "runs/student/scores.md")]
    command = steps[2].command
    assert [command[i + 1] for i, a in enumerate(command) if a == "--checkpoint"] == [
        "a.pt", "runs/multi30k_de_en/checkpoints/best.pt"]  # an ensemble


def test_the_two_stage_multilingual_student_plans_both_teachers_then_its_stages(in_tmp):
    steps = plan(CONFIGS / "multi30k_multilingual_student_task2.yaml")
    kinds = _steps(steps)
    trained = [output for kind, output in kinds if kind == "train"]
    assert trained == ["runs/multi30k_en_de_reverse", "runs/multi30k_de_en_bt", "runs/multi30k_de_en_reverse",
                       "runs/multi30k_en_de_bt", "runs/multi30k_multilingual_student",
                       "runs/multi30k_multilingual_student_task2"]
    assert sorted(o for k, o in kinds if k == "synthesize") == [
        "runs/distilled/task2_de_en", "runs/distilled/task2_en_de", "runs/distilled/train_de_en",
        "runs/distilled/train_en_de", "runs/synthetic/task2_de_en", "runs/synthetic/task2_en_de"]
    second = steps[-2]
    assert Path("runs/multi30k_multilingual_student/checkpoints/best.pt") in second.needs  # training.init_from
    assert len(kinds) == len(set(kinds))  # a corpus both stages name is made once


def test_a_path_made_two_ways_and_a_chain_that_needs_itself_are_refused(in_tmp):
    a, b = in_tmp / "a.yaml", in_tmp / "b.yaml"
    bt = str(CONFIGS / "multi30k_de_en_bt.yaml")
    a.write_text(yaml.safe_dump({"base": bt, "data": {"synthetic": [
        {"path": "c1", "tag": "", "made_by": {"model": ["b.yaml"], "input": ["x"]}}]}}))
    b.write_text(yaml.safe_dump({"base": bt, "data": {"synthetic": [
        {"path": "c2", "tag": "", "made_by": {"model": ["a.yaml"], "input": ["x"]}}]}}))
    with pytest.raises(ConfigError, match=r"a chain of recipes that needs itself: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        plan(a)
    b.write_text(yaml.safe_dump({"base": bt, "data": {"synthetic": [
        {"path": "c1", "tag": "", "made_by": {"model": ["m.pt"], "input": ["x"]}},
        {"path": "c1", "name": "again", "tag": "", "made_by": {"model": ["m.pt"], "input": ["y"]}}]}}))
    with pytest.raises(ConfigError, match="c1 is also made by .*another way"):
        plan(b)


def test_each_kind_of_step_is_missing_stopped_or_finished_by_its_output(in_tmp):
    steps = {s.output: s for s in plan(CONFIGS / "multi30k_fr_en_bt.yaml")}
    reverse = steps[Path("runs/multi30k_en_fr_reverse")]
    corpus = steps[Path("runs/synthetic/task2_en_fr")]
    scores = steps[Path("runs/multi30k_en_fr_reverse/scores.md")]
    assert (reverse.state(), corpus.state(), scores.state()) == (MISSING, MISSING, MISSING)
    _fake_run(Path("runs/multi30k_en_fr_reverse"), CONFIGS / "multi30k_en_fr_reverse.yaml", 250)
    Path("runs/synthetic/.task2_en_fr.work").mkdir(parents=True)
    Path("runs/synthetic/.task2_en_fr.work/progress.json").write_text("{}")
    Path("runs/multi30k_en_fr_reverse/eval_test_best_greedy.json").write_text("{}")
    assert (reverse.state(), corpus.state(), scores.state()) == (STOPPED, STOPPED, STOPPED)
    assert "[stopped: goes on from update 250 of 3000] train runs/multi30k_en_fr_reverse" in describe(
        list(steps.values()))
    _fake_run(Path("runs/multi30k_en_fr_reverse"), CONFIGS / "multi30k_en_fr_reverse.yaml", 3000)
    Path("runs/synthetic/task2_en_fr").mkdir()
    Path("runs/synthetic/task2_en_fr/origin.json").write_text('{"model": [{"path": "/elsewhere/best.pt"}]}')
    Path("runs/multi30k_en_fr_reverse/scores.md").write_text("")
    assert (reverse.state(), corpus.state(), scores.state()) == (FINISHED, FINISHED, FINISHED)
    again = {s.output: s for s in plan(CONFIGS / "multi30k_fr_en_bt.yaml")}
    assert "made by /elsewhere/best.pt, not " in again[Path("runs/synthetic/task2_en_fr")].note  # which model made it
    best = Path("runs/multi30k_en_fr_reverse/checkpoints/best.pt")
    best.write_bytes(b"the reverse model trained again")
    made = {"model": [{"path": str(best.resolve()), "sha256": hashlib.sha256(b"an earlier model").hexdigest()}]}
    Path("runs/synthetic/task2_en_fr/origin.json").write_text(json.dumps(made))
    again = {s.output: s for s in plan(CONFIGS / "multi30k_fr_en_bt.yaml")}
    assert f"made by an earlier {best.resolve()} (its SHA-256 has changed" in again[corpus.output].note
    made["model"][0]["sha256"] = hashlib.sha256(best.read_bytes()).hexdigest()  # the same model: nothing to say
    Path("runs/synthetic/task2_en_fr/origin.json").write_text(json.dumps(made))
    again = {s.output: s for s in plan(CONFIGS / "multi30k_fr_en_bt.yaml")}
    assert again[corpus.output].note == ""


def test_run_folders_are_named_after_their_recipe():
    assert run_dir_of("configs/multi30k_en_fr_reverse.yaml") == Path("runs/multi30k_en_fr_reverse")


# ---- the toy chain, end to end ---------------------------------------------------------------------------------


def _toy_tree(folder: Path, multi30k_subset: Path) -> Path:
    """Three recipes as the committed back-translation ones are written: a base, its reverse direction (a delta)
    and the back-translation recipe (a delta whose corpus is made by the reverse recipe's model)."""
    data = folder / "data"  # the subset's training pairs, 20 validation and test pairs
    data.mkdir(parents=True)
    for split, n in (("train", None), ("val", 20), ("test_2016_flickr", 20)):
        for lang in ("de", "en"):
            lines = gzip.decompress((multi30k_subset / f"{split}.{lang}.gz").read_bytes()).splitlines()[:n]
            (data / f"{split}.{lang}.gz").write_bytes(gzip.compress(b"\n".join(lines) + b"\n", mtime=0))
    base = yaml.safe_load(yaml.safe_dump(SMALL_CONFIG))
    base["data"].update(path="data", vocab_size=300, max_tokens_per_batch=1024)
    base["training"].update(max_steps=20, warmup_steps=10, eval_every_steps=10, save_every_steps=5,
                            keep_last_checkpoints=2, log_every_steps=5)
    base["decoding"].update(beam_size=2, max_len_a=1.5, max_len_b=5)
    (folder / "configs").mkdir()
    (folder / "configs" / "toy_de_en.yaml").write_text(yaml.safe_dump(base))
    (folder / "configs" / "toy_en_de.yaml").write_text(
        "base: toy_de_en.yaml\ndata: {src_lang: en, tgt_lang: de}\n"
        "training: {max_steps: 80, warmup_steps: 30, eval_every_steps: 40}\n")
    english = gzip.decompress((MULTI30K / "train.en.gz").read_bytes()).decode().split("\n")
    (folder / "mono.en").write_text("\n".join(english[3990:4290]) + "\n")  # 10 lines of the parallel text
    (folder / "configs" / "toy_de_en_bt.yaml").write_text(yaml.safe_dump({
        "base": "toy_de_en.yaml",
        "data": {"synthetic": [{"path": "runs/synthetic/mono_en_de", "tag": "<bt>", "made_by": {
            "model": ["toy_en_de.yaml"], "input": ["mono.en"],
            "exclude": ["data/train.en.gz"]}}], "parallel_weight": 2.0}}))
    return folder


def _chain(folder: Path, *args: str, wait: bool = True):
    command = [sys.executable, "-m", "transformer", "chain", "--config", "configs/toy_de_en_bt.yaml", *args]
    if not wait:
        return subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=600)


def _running(run_dir: str) -> bool:
    """Whether a process training into `run_dir` runs (Linux: read from /proc)."""
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train" in command and run_dir.encode() in command:
            return True
    return False


def _outputs(folder: Path) -> dict[str, bytes]:
    """The chain's results that must not depend on interruptions: each model's weights, the corpus, the scores."""
    out = {}
    for run in ("toy_en_de", "toy_de_en_bt"):
        model = torch.load(folder / "runs" / run / "checkpoints" / "last.pt", weights_only=False)["model"]
        out[run] = b"".join(t.numpy().tobytes() for t in model.values())
        out[f"{run} scores"] = (folder / "runs" / run / "scores.md").read_bytes()
    for side in ("de", "en"):
        out[side] = gzip.decompress((folder / "runs/synthetic/mono_en_de" / f"train.{side}.gz").read_bytes())
    return out


@pytest.mark.slow
def test_a_toy_chain_runs_end_to_end_and_a_killed_one_goes_on_to_the_same_outputs(tmp_path, multi30k_subset):
    whole = _toy_tree(tmp_path / "whole", multi30k_subset)
    done = _chain(whole)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "chain: every step is done" in done.stdout
    origin = yaml.safe_load((whole / "runs/synthetic/mono_en_de/origin.json").read_text())
    assert origin["model"][0]["path"] == str(whole / "runs/toy_en_de/checkpoints/best.pt")
    assert origin["counts"]["read"] == 300 and origin["counts"]["excluded"] >= 10
    scores = (whole / "runs/toy_de_en_bt/scores.md").read_text()
    assert "| de-en |" in scores and "avg_last2 beam" in scores
    assert (whole / "runs/toy_de_en_bt/config.yaml").read_text().count("made_by") == 1  # the whole config saved
    again = _chain(whole)  # finished: nothing runs again
    assert again.returncode == 0 and "chain: train" not in again.stdout and "chain: synth" not in again.stdout
    assert again.stdout.count("[done]") == 5

    killed = _toy_tree(tmp_path / "killed", multi30k_subset)
    chain = _chain(killed, wait=False)
    last = killed / "runs/toy_en_de/checkpoints/last.pt"
    deadline = time.time() + 300
    while not last.exists() and chain.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(chain.pid, signal.SIGKILL)  # the chain dies at once; its training child is stopped with it
    chain.wait()
    while _running("runs/toy_en_de") and time.time() < deadline:
        time.sleep(0.2)  # the child saves its last.pt and stops
    again = _chain(killed)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "[stopped: goes on from update " in again.stdout.split("train runs/toy_en_de")[0]
    assert "--resume" in again.stdout.split("chain: train runs/toy_en_de")[1].splitlines()[0]
    assert _outputs(killed) == _outputs(whole)


def test_the_toy_chain_plans_every_kind_of_step_at_toy_scale(in_tmp):
    steps = plan(CONFIGS / "toy" / "toy_de_en_student.yaml")
    assert [s.kind for s in steps] == ["train", "evaluate", "synthesize", "train", "evaluate", "synthesize", "train",
                                       "evaluate"]
    for step in (steps[2], steps[5]):
        assert step.command[step.command.index("--max-lines") + 1] == "3000"
    assert load_config(CONFIGS / "toy" / "toy_de_en_student.yaml").model.d_model == 128
