"""Interrupted training resumes exactly; SIGINT saves and says how to resume; non-finite updates are skipped."""

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import write_small_config
from transformer.checkpoint import load_checkpoint, save_checkpoint
from transformer.config import ConfigError, load_config, override_config
from transformer.training import trainer
from transformer.training.checkpoint import RESUME_MAY_CHANGE, TrainState, check_resume_config
from transformer.training.optim import learning_rate
from transformer.training.stop import (
    MAX_SCALE_SEARCH,
    MIN_LOSS_SCALE,
    NonFiniteLossError,
    count_skipped_update,
)
from transformer.training.trainer import TrainingInterrupted, train

TINY = {"model": {"d_model": 32, "n_heads": 4, "d_ff": 64, "n_encoder_layers": 1, "n_decoder_layers": 1},
        "data": {"vocab_size": 300, "max_tokens_per_batch": 8192},
        "training": {"max_steps": 20, "warmup_steps": 10, "eval_every_steps": 15, "log_every_steps": 5,
                     "keep_last_checkpoints": 0}}


@pytest.fixture
def tiny_config(tmp_path, multi30k_subset):
    path = write_small_config(tmp_path, multi30k_subset, **TINY)
    return load_config(path, ["data.valid_max_sentences=20"])


def interrupt_after(monkeypatch, n_updates: int) -> None:
    """Send this process SIGINT during update `n_updates`, as a user's Ctrl-C would: the run finishes that update,
    saves last.pt and raises TrainingInterrupted."""
    real_step, calls = trainer.train_step, {"n": 0}

    def step_then_interrupt(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n_updates:
            signal.raise_signal(signal.SIGINT)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", step_then_interrupt)


def with_training(config, **changes):
    return dataclasses.replace(config, training=dataclasses.replace(config.training, **changes))


def _train_losses(run_dir: Path, key: str = "loss") -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)[key] for line in lines if json.loads(line)["type"] == "train"]


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp16", marks=pytest.mark.cuda)])
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, tiny_config, monkeypatch, device, precision):
    # About 15 batches per epoch: the 20 steps cross an epoch boundary after the interruption at step 7.
    # On CUDA, training.deterministic makes the kernels reproducible (CPU kernels are). fp16 (CUDA only) also
    # resumes its loss scaler's state.
    if precision == "fp16" and device.type != "cuda":
        pytest.skip("fp16 trains on CUDA only")
    tiny_config = with_training(tiny_config, device=device.type, deterministic=device.type == "cuda",
                                precision=precision)
    full = train(tiny_config, tmp_path / "full")
    with monkeypatch.context() as patch:
        interrupt_after(patch, 7)
        # An fp16 overflow in the first updates would be skipped, not counted as a step.
        stopped = r"SIGINT: stopped at step " + ("7" if precision == "fp32" else r"\d+")
        with pytest.raises(TrainingInterrupted, match=stopped):
            train(tiny_config, tmp_path / "resumed")
    resumed = train(tiny_config, tmp_path / "resumed", resume=True)
    assert full.epoch == resumed.epoch >= 1 and resumed.step == 20
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, atol=1e-6, rtol=0, msg=name)
    assert _train_losses(tmp_path / "full") == _train_losses(tmp_path / "resumed")
    grad_norms = _train_losses(tmp_path / "full", "grad_norm")  # each log line's mean norm before clipping
    assert len(grad_norms) == 4 and all(0 < g < 1e3 for g in grad_norms)
    assert grad_norms == _train_losses(tmp_path / "resumed", "grad_norm")
    for key in ("step", "epoch", "batch_in_epoch", "best_bleu"):
        assert a["train_state"][key] == b["train_state"][key]


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, tiny_config):
    with pytest.raises(Exception, match="no checkpoint .*last.pt to resume from"):
        train(tiny_config, tmp_path / "empty", resume=True)


def test_a_new_run_into_a_folder_with_an_earlier_run_is_refused(tmp_path, tiny_config):
    run_dir = tmp_path / "run"
    train(with_training(tiny_config, max_steps=5, eval_every_steps=5), run_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"already holds a training run \(checkpoints/best.pt.*--resume"):
        train(tiny_config, run_dir)
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # nothing overwritten
    (run_dir / "checkpoints").rename(tmp_path / "moved")
    with pytest.raises(ConfigError, match=r"already holds a training run \(metrics.jsonl\)"):
        train(tiny_config, run_dir)


def test_a_folder_with_only_a_tokenizer_and_config_trains(tmp_path, tiny_config):
    run_dir = tmp_path / "run"
    train(with_training(tiny_config, max_steps=5, eval_every_steps=5), run_dir)
    for path in [*(run_dir / "checkpoints").iterdir(), run_dir / "metrics.jsonl"]:
        path.unlink()  # what `transformer prepare` leaves: spm.model and config.yaml
    state = train(with_training(tiny_config, max_steps=5, eval_every_steps=5), run_dir)
    assert state.step == 5


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
    # stderr is a pipe, not a terminal: plain log lines with the figures, no progress bar's carriage returns.
    assert re.search(r"step 5/100000: loss \d+\.\d{3}, ppl [\d.]+, lr [\d.e+-]+, grad_norm [\d.]+, \d+ tgt tokens/s",
                     stderr), stderr[-2000:]
    assert "\r" not in stderr


def test_non_finite_updates_are_skipped_then_stop(tmp_path, tiny_config, monkeypatch, device):
    tiny_config = with_training(tiny_config, device=device.type)
    real_loss = trainer.batch_loss
    calls = {"n": 0}

    def sometimes_nan(module, batch):
        calls["n"] += 1
        loss, nll = real_loss(module, batch)
        return (loss * float("nan"), nll) if calls["n"] in (3, 4) or calls["n"] >= 12 else (loss, nll)

    monkeypatch.setattr(trainer, "batch_loss", sometimes_nan)
    config = with_training(tiny_config, max_nonfinite_steps=3, eval_every_steps=5)
    with pytest.raises(NonFiniteLossError, match="3 updates in a row"):
        train(config, tmp_path / "nan")
    records = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["type"] == "train"]
    assert train_records[0]["skipped_updates"] == 2  # steps 3 and 4 skipped, training went on
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train_records)
    last = load_checkpoint(tmp_path / "nan" / "checkpoints" / "last.pt")
    assert all(torch.isfinite(t).all() for t in last["model"].values())  # the last good weights


def _count_updates(monkeypatch) -> dict:
    """Count train_step's calls ("calls") and the updates it applied ("applied")."""
    real_step, counts = trainer.train_step, {"calls": 0, "applied": 0}

    def counting_step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        counts["calls"] += 1
        counts["applied"] += result is not None
        return result

    monkeypatch.setattr(trainer, "train_step", counting_step)
    return counts


def test_a_skipped_update_is_not_a_step(tmp_path, tiny_config, monkeypatch):
    """max_steps, the learning-rate schedule and the log/validation intervals count applied updates."""
    real_loss, calls = trainer.batch_loss, {"n": 0}

    def nan_three_times(module, batch):  # the updates after steps 2 and 3, and the one after step 15
        calls["n"] += 1
        loss, nll = real_loss(module, batch)
        return (loss * float("nan"), nll) if calls["n"] in (3, 4, 18) else (loss, nll)

    monkeypatch.setattr(trainer, "batch_loss", nan_three_times)
    counts = _count_updates(monkeypatch)
    state = train(tiny_config, tmp_path / "run")
    assert (state.step, state.n_skipped_updates, counts["calls"], counts["applied"]) == (20, 3, 23, 20)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [5, 10, 15, 20]
    assert [r["step"] for r in records if r["type"] == "valid"] == [15, 20]  # not again after the skip at 15
    training, d_model = tiny_config.training, tiny_config.model.d_model
    assert [r["lr"] for r in records if r["type"] == "train"] == [
        learning_rate(step, training, d_model) for step in (5, 10, 15, 20)]


def _overflowed(scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
    """`scaler` after an update that found an inf gradient (as train_step leaves it): its scale halved."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    scaler.scale(parameter.sum()).backward()
    parameter.grad.fill_(float("inf"))
    scaler.unscale_(optimizer)
    scaler.update()
    return scaler


def test_fp16_overflows_count_toward_the_limit_only_below_a_loss_scale_of_one(tmp_path):
    state, last = TrainState(step=7), tmp_path / "checkpoints" / "last.pt"
    scaler = torch.amp.GradScaler("cpu", init_scale=8 * MIN_LOSS_SCALE)
    for expected_scale in (4, 2, 1):  # halved, still searching for a scale that fits fp16
        count_skipped_update(state, 3, _overflowed(scaler), last)
        assert scaler.get_scale() == expected_scale * MIN_LOSS_SCALE
    assert (state.n_skipped_updates, state.nonfinite_in_a_row) == (3, 0)
    count_skipped_update(state, 3, _overflowed(scaler), last)  # below 1: the gradients overflow unscaled
    count_skipped_update(state, 3, _overflowed(scaler), last)
    with pytest.raises(NonFiniteLossError, match=f"3 updates in a row .*max_nonfinite_steps=3.*{last}"):
        count_skipped_update(state, 3, _overflowed(scaler), last)
    assert (state.step, state.n_skipped_updates, state.skipped_in_a_row) == (7, 6, 6)
    with pytest.raises(NonFiniteLossError):  # without a scaler (fp32, bf16) every skip counts
        count_skipped_update(TrainState(), 1, None, last)
    # A scale that stays high (the scaler saw no inf, yet the norm was not finite): counted after MAX_SCALE_SEARCH.
    state, unchanged = TrainState(), torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    for _ in range(MAX_SCALE_SEARCH):
        count_skipped_update(state, 3, unchanged, last)
    assert state.nonfinite_in_a_row == 0
    with pytest.raises(NonFiniteLossError):
        for _ in range(3):
            count_skipped_update(state, 3, unchanged, last)


@pytest.mark.cuda
def test_fp16_overflows_lower_the_loss_scale_and_are_not_steps(tmp_path, tiny_config, monkeypatch, device):
    if device.type != "cuda":
        pytest.skip("fp16 trains on CUDA only")
    real_loss, calls = trainer.batch_loss, {"n": 0}

    def overflow_first(module, batch):  # the first 12 updates overflow: the scale halves from 2^16 to 2^4
        calls["n"] += 1
        loss, nll = real_loss(module, batch)
        return (loss * float("inf"), nll) if calls["n"] <= 12 else (loss, nll)

    monkeypatch.setattr(trainer, "batch_loss", overflow_first)
    counts = _count_updates(monkeypatch)
    config = with_training(tiny_config, device="cuda", precision="fp16", max_nonfinite_steps=3)
    state = train(config, tmp_path / "run")
    assert (state.step, state.n_skipped_updates, counts["applied"]) == (20, 12, 20)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss_scale"] for r in records if r["type"] == "train"] == [2.0 ** 4] * 4


def test_step_checkpoints_between_validations_for_averaging(tmp_path, tiny_config):
    config = with_training(tiny_config, save_every_steps=4, keep_last_checkpoints=3)
    train(config, tmp_path / "run")
    folder = tmp_path / "run" / "checkpoints"
    # Saves at 4, 8, 12, 16, validations at 15 and 20; the last 3 kept.
    assert sorted(p.name for p in folder.glob("step_*.pt")) == ["step_15.pt", "step_16.pt", "step_20.pt"]
    assert load_checkpoint(folder / "step_16.pt")["train_state"]["step"] == 16
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "valid"] == [15, 20]  # saving is not validating


def test_precision_auto_is_resolved_once_and_kept_on_resume(tmp_path, tiny_config, monkeypatch):
    from transformer import device as device_module
    config = with_training(tiny_config, precision="auto")
    fast_bf16 = {torch.float32: 2.0, torch.bfloat16: 1.0}
    monkeypatch.setattr(device_module, "matmul_seconds", lambda dtype, device, **k: fast_bf16[dtype])
    with monkeypatch.context() as patch:
        interrupt_after(patch, 5)
        with pytest.raises(TrainingInterrupted):
            train(config, tmp_path / "run")
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert saved["train_state"]["precision"] == "bf16"
    assert saved["config"]["training"]["precision"] == "bf16"  # what the run computed with
    # the machine now measures bf16 as slow: the resumed run still computes in bf16, as it started
    monkeypatch.setattr(device_module, "matmul_seconds", lambda dtype, device, **k: 1.0 / fast_bf16[dtype])
    used = []
    real_step = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda *a, **k: used.append(a[3].training.precision) or
                        real_step(*a, **k))
    train(config, tmp_path / "run", resume=True)
    assert set(used) == {"bf16"}
    fresh = train(config, tmp_path / "fresh")
    assert fresh.precision == "fp32"


# --------------------------------------------------------------------------------------------------
# The resume contract (training/checkpoint.py): what may change on --resume, and what happens then
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def stopped_run(tmp_path, tiny_config, monkeypatch):
    """A run of the tiny config (linear schedule, 20 steps) interrupted after update 8."""
    config = with_training(tiny_config, lr_schedule="linear", keep_last_checkpoints=5, save_every_steps=4)
    with monkeypatch.context() as patch:
        interrupt_after(patch, 8)
        with pytest.raises(TrainingInterrupted):
            train(config, tmp_path / "run")
    return config, tmp_path / "run"


@pytest.mark.parametrize("key, value", [("model.d_model", 64), ("training.lr_scale", 3.0),
                                        ("training.seed", 99), ("data.max_tokens_per_batch", 4096),
                                        ("training.accumulate_steps", 2), ("data.vocab_size", 400),
                                        ("data.subword_sampling", True), ("data.subword_alpha", 0.2)])
def test_resume_refuses_a_change_that_would_alter_the_run(stopped_run, key, value, caplog):
    config, run_dir = stopped_run
    section, name = key.split(".")
    old = getattr(getattr(config, section), name)
    changed = override_config(config, [f"{key}={value}", "training.max_steps=30"])  # with an allowed change
    new = changed.to_dict()[section][name]
    with caplog.at_level(logging.INFO), \
            pytest.raises(ConfigError, match=re.escape(f"{key} (checkpoint: {old!r}, now: {new!r})")):
        train(changed, run_dir, resume=True)
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["train_state"]["step"] == 8  # nothing touched
    assert "max_steps changed" not in caplog.text  # a refused resume does not log as if it went on


def test_every_key_in_the_contract_is_accepted(stopped_run):
    config, run_dir = stopped_run
    saved = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    flat = {f"{s}.{k}": v for s, values in config.to_dict().items() for k, v in values.items()}
    allowed = [k for k in flat if k in RESUME_MAY_CHANGE or f"{k.split('.')[0]}.*" in RESUME_MAY_CHANGE]
    assert "training.max_steps" in allowed and "model.d_model" not in allowed
    checked = []
    for key in allowed:
        value = flat[key]
        new = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v + 0.05,
               str: lambda v: {"cpu": "auto", "auto": "cpu", "fp32": "bf16", "bf16": "fp32"}.get(v, v)}
        changed_value = new.get(type(value), lambda v: v)(value) if key != "decoding.top_p" else 0.9  # at most 1
        if value is None or changed_value == value:
            continue
        together = ["decoding.beam_size=1", "decoding.n_best=1"] if key == "decoding.sampling" else []  # needs both
        changed = override_config(config, [f"{key}={json.dumps(changed_value)}", *together])
        check_resume_config(saved, changed, run_dir)  # accepted (logs what happens)
        checked.append(key)
    assert len(checked) >= 10, checked


def test_resume_with_more_steps_follows_the_new_schedule(stopped_run, caplog):
    config, run_dir = stopped_run
    longer = with_training(config, max_steps=30)
    with caplog.at_level(logging.INFO):
        state = train(longer, run_dir, resume=True)
    assert state.step == 30
    assert "training.max_steps changed from 20 to 30" in caplog.text
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
           if r["type"] == "train"}
    d_model = config.model.d_model
    assert lrs[5] == pytest.approx(learning_rate(5, config.training, d_model))  # before: the old schedule
    for step in (10, 15, 25, 30):
        assert lrs[step] == pytest.approx(learning_rate(step, longer.training, d_model))


def test_resume_with_new_intervals_and_fewer_kept_checkpoints(stopped_run):
    config, run_dir = stopped_run
    folder = run_dir / "checkpoints"
    assert sorted(p.name for p in folder.glob("step_*.pt")) == ["step_4.pt", "step_8.pt"]
    changed = with_training(config, eval_every_steps=6, save_every_steps=5, keep_last_checkpoints=2,
                            log_every_steps=3)
    train(changed, run_dir, resume=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "valid"] == [12, 18, 20]
    assert [r["step"] for r in records if r["type"] == "train"] == [5, 9, 12, 15, 18]
    # step checkpoints at validations (12, 18, 20) and every 5 updates (10, 15), pruned to the last 2
    assert sorted(p.name for p in folder.glob("step_*.pt")) == ["step_18.pt", "step_20.pt"]


def test_resume_with_patience_counts_the_saved_validations(stopped_run, monkeypatch):
    config, run_dir = stopped_run
    saved = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    saved["train_state"]["evals_without_improvement"] = 2
    saved["train_state"]["best_bleu"] = 101.0  # no validation can improve on it
    save_checkpoint(saved, run_dir / "checkpoints" / "last.pt")
    state = train(with_training(config, patience=3, eval_every_steps=5), run_dir, resume=True)
    assert state.step == 10 and state.evals_without_improvement == 3  # stopped at the first validation


def test_a_checkpoint_trained_on_the_device_translates_the_same_in_a_cpu_only_process(tmp_path, tiny_config, device):
    """Tensors saved from a GPU run load in a process that sees no GPU (CUDA_VISIBLE_DEVICES empty) and beam search
    there gives what it gives on the training device: the same best translation with the same score, or, where
    the device's two best texts tie within rounding, the other one of them."""
    from transformer.translate import Translator

    train(with_training(tiny_config, device=device.type, max_steps=15), tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    sentences = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau singt."]
    on_device = Translator.from_checkpoint(checkpoint, device=device.type).translate_n_best(sentences, n_best=2,
                                                                                            beam_size=4)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "transformer", "translate", "--checkpoint", str(checkpoint),
                             "--beam-size", "4", "--n-best", "1", *sentences], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    on_cpu = [line.split("\t")[:3] for line in result.stdout.splitlines()]  # index, score, text (then eos/cut)
    assert [int(index) for index, _, _ in on_cpu] == [0, 1, 2] and any(text for _, _, text in on_cpu)
    tolerance = 2e-3 if device.type == "cuda" else 1e-9  # printed with 4 decimals; CPU runs compute the same
    for (_, score, text), ((best, best_score), *runner_up) in zip(on_cpu, on_device):
        assert abs(float(score) - best_score) <= tolerance + 5e-5, (text, best)
        if text != best:  # only a tie that rounding broke the other way
            assert runner_up and runner_up[0][0] == text and abs(runner_up[0][1] - best_score) <= tolerance


def test_resume_with_subword_sampling_sees_the_same_pieces(tmp_path, tiny_config, monkeypatch):
    # data.subword_sampling: epoch 0 trains on the token cache, epoch 1 (from step 18 of 20) on a sample built in the
    # background. Interrupted in epoch 1 (its sample complete: the run waited for it at the epoch's first update),
    # with the sample deleted, the resumed run encodes it again to the same ids and ends with the same weights as the
    # uninterrupted run.
    from transformer.data.subword_sampling import SampledEpochs

    config = dataclasses.replace(tiny_config, data=dataclasses.replace(tiny_config.data, subword_sampling=True))
    asked, prefetch = [], SampledEpochs.prefetch
    with monkeypatch.context() as patch:
        patch.setattr(SampledEpochs, "prefetch", lambda self, epoch: asked.append(epoch) or prefetch(self, epoch))
        full = train(config, tmp_path / "full")
    first_in_epoch_1 = full.step - full.batch_in_epoch + 1  # the update that waited for epoch 1's sample
    assert full.epoch == 1 and first_in_epoch_1 < full.step
    assert asked == [1]  # built ahead while epoch 0 trained; not epoch 2, which the run (ending in epoch 1) never sees
    with monkeypatch.context() as patch:
        interrupt_after(patch, first_in_epoch_1 + 1)
        with pytest.raises(TrainingInterrupted, match=f"stopped at step {first_in_epoch_1 + 1}"):
            train(config, tmp_path / "resumed")
    samples = tmp_path / "resumed" / "subword_samples"
    assert (samples / "epoch_1" / "meta.json").exists()
    shutil.rmtree(samples)
    resumed = train(config, tmp_path / "resumed", resume=True)
    assert resumed.step == full.step == 20 and resumed.epoch == full.epoch
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, atol=1e-6, rtol=0, msg=name)
    assert _train_losses(tmp_path / "full") == _train_losses(tmp_path / "resumed")
    # The same config without sampling trains on other pieces in epoch 1: the losses part ways there.
    plain = train(tiny_config, tmp_path / "plain")
    assert _train_losses(tmp_path / "plain")[:3] == _train_losses(tmp_path / "full")[:3]  # epoch 0: the cache
    assert _train_losses(tmp_path / "plain")[3:] != _train_losses(tmp_path / "full")[3:]
    assert plain.step == 20


@pytest.mark.parametrize("accumulate, world_size, n_batches, updates", [(2, 1, 11, 6), (1, 2, 5, 2), (2, 2, 9, 2),
                                                                        (2, 2, 10, 3), (1, 1, 4, 4)])
def test_the_next_sample_is_asked_for_only_when_the_run_goes_past_the_epoch(accumulate, world_size, n_batches,
                                                                             updates):
    """`_goes_past` counts the updates left in the epoch as `_next_update` takes them (world_size x accumulate
    batches each; a shorter tail only if every process gets a batch): the run ends in this epoch exactly when
    max_steps is at most step + that count, or max_epochs ends it."""
    from types import SimpleNamespace

    from transformer.training.checkpoint import TrainState

    state = TrainState(step=40, epoch=2, batch_in_epoch=0)
    for max_steps, expected in ((40 + updates, False), (40 + updates + 1, True)):
        training = SimpleNamespace(accumulate_steps=accumulate, max_steps=max_steps, max_epochs=0)
        run = SimpleNamespace(config=SimpleNamespace(training=training), dist=SimpleNamespace(world_size=world_size))
        assert trainer._goes_past(run, state, n_batches) is expected, (max_steps, expected)
    run.config.training.max_epochs = 3  # epoch 2 is the last
    assert trainer._goes_past(run, state, n_batches) is False


def test_tokens_per_second_after_a_resume_counts_only_the_tokens_timed(monkeypatch):
    """A run resumed in the middle of a log window carries that window's tokens (for the exact loss); the first
    tokens/s after the resume must not divide them by the time since the resume (it read about twice the rate)."""
    from types import SimpleNamespace

    from transformer.training.distributed import Distributed

    records = []
    run = SimpleNamespace(dist=Distributed(), device=torch.device("cpu"), metrics=SimpleNamespace(write=records.append),
                          optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]), scaler=None, tensorboard=None)
    state = TrainState()
    state.window_loss, state.window_nll, state.window_tokens, state.window_src_tokens = 200.0, 180.0, 100, 120
    state.window_updates = 4
    bar = SimpleNamespace(disable=False, set_postfix=lambda **kwargs: None)
    trainer._log_window(run, 2.0, state, bar, carried=(60, 70))  # 40 target + 50 source tokens in the 2 s timed
    assert records[-1]["tgt_tokens_per_s"] == 20.0 and records[-1]["src_tgt_tokens_per_s"] == 45.0
    assert records[-1]["loss"] == 2.0  # the loss still counts every token of the window


def test_resume_of_a_run_folder_needs_neither_its_config_nor_its_settings(tmp_path, multi30k_subset, caplog):
    """`transformer train --resume --run-dir R` reads R/config.yaml, as the first command resolved it (--set
    included); a run folder without one is refused in one line."""
    from tests.conftest import write_small_config
    from transformer.cli import main

    config = write_small_config(tmp_path, multi30k_subset)
    run = tmp_path / "run"
    sets = ["--set", "training.max_steps=4", "--set", "training.eval_every_steps=2", "--set", "training.warmup_steps=2"]
    assert main(["train", "--config", str(config), "--run-dir", str(run), *sets]) == 0
    caplog.clear()
    caplog.set_level("INFO")
    assert main(["train", "--resume", "--run-dir", str(run)]) == 0
    assert any("the run has finished (4 of training.max_steps=4 updates)" in r.getMessage() for r in caplog.records)
    assert main(["train", "--resume", "--run-dir", str(tmp_path)]) == 2
    assert main(["train", "--run-dir", str(run)]) == 2  # without --resume a recipe is needed
