"""Interrupted training resumes exactly; SIGINT saves and says how to resume; non-finite updates are skipped."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import write_small_config
from transformer.config import load_config
from transformer.training import trainer
from transformer.training.checkpoint import load_checkpoint
from transformer.training.trainer import NonFiniteLossError, TrainingInterrupted, train

TINY = {"model": {"d_model": 32, "n_heads": 4, "d_ff": 64, "n_encoder_layers": 1, "n_decoder_layers": 1},
        "data": {"vocab_size": 300, "max_tokens_per_batch": 8192},
        "training": {"max_steps": 20, "warmup_steps": 10, "eval_every_steps": 15, "log_every_steps": 5,
                     "keep_last_checkpoints": 0}}


@pytest.fixture
def tiny_config(tmp_path, multi30k_subset):
    path = write_small_config(tmp_path, multi30k_subset, **TINY)
    return load_config(path, ["data.valid_max_sentences=20"])


def _train_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if json.loads(line)["type"] == "train"]


def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, tiny_config):
    # About 15 batches per epoch: the 20 steps cross an epoch boundary after the interruption at step 7.
    full = train(tiny_config, tmp_path / "full")
    with pytest.raises(TrainingInterrupted, match="stopped at step 7"):
        train(tiny_config, tmp_path / "resumed", stop_at_step=7)
    resumed = train(tiny_config, tmp_path / "resumed", resume=True)
    assert full.epoch == resumed.epoch >= 1 and resumed.step == 20
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, atol=1e-6, rtol=0, msg=name)
    assert _train_losses(tmp_path / "full") == _train_losses(tmp_path / "resumed")
    for key in ("step", "epoch", "batch_in_epoch", "best_bleu"):
        assert a["train_state"][key] == b["train_state"][key]


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, tiny_config):
    with pytest.raises(Exception, match="no checkpoint .*last.pt to resume from"):
        train(tiny_config, tmp_path / "empty", resume=True)


def test_sigint_saves_and_says_how_to_resume(tmp_path, multi30k_subset):
    config = write_small_config(tmp_path, multi30k_subset, **{**TINY, "training": {**TINY["training"],
                                                                                  "max_steps": 100000}})
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "transformer", "train", "--config", str(config), "--run-dir",
                                str(run_dir)], stderr=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parents[2])
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "SIGINT: stopped at step" in stderr and "--resume" in stderr
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert state["train_state"]["step"] >= 5


def test_non_finite_updates_are_skipped_then_stop(tmp_path, tiny_config, monkeypatch):
    real_loss = trainer.batch_loss
    calls = {"n": 0}

    def sometimes_nan(module, batch):
        calls["n"] += 1
        loss, nll = real_loss(module, batch)
        return (loss * float("nan"), nll) if calls["n"] in (3, 4) or calls["n"] >= 12 else (loss, nll)

    monkeypatch.setattr(trainer, "batch_loss", sometimes_nan)
    config = tiny_config.__class__(**{**tiny_config.__dict__, "training": tiny_config.training.__class__(
        **{**tiny_config.training.__dict__, "max_nonfinite_steps": 3, "eval_every_steps": 5})})
    with pytest.raises(NonFiniteLossError, match="3 updates in a row"):
        train(config, tmp_path / "nan")
    records = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["type"] == "train"]
    assert train_records[0]["skipped_updates"] == 2  # steps 3 and 4 skipped, training went on
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train_records)
    last = load_checkpoint(tmp_path / "nan" / "checkpoints" / "last.pt")
    assert all(torch.isfinite(t).all() for t in last["model"].values())  # the last good weights


def test_step_checkpoints_between_validations_for_averaging(tmp_path, tiny_config):
    import dataclasses

    config = dataclasses.replace(tiny_config, training=dataclasses.replace(
        tiny_config.training, save_every_steps=4, keep_last_checkpoints=3))
    train(config, tmp_path / "run")
    folder = tmp_path / "run" / "checkpoints"
    # Saves at 4, 8, 12, 16, validations at 15 and 20; the last 3 kept.
    assert sorted(p.name for p in folder.glob("step_*.pt")) == ["step_15.pt", "step_16.pt", "step_20.pt"]
    assert load_checkpoint(folder / "step_16.pt")["train_state"]["step"] == 16
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "valid"] == [15, 20]  # saving is not validating
