"""TensorBoard logs: the run's figures, samples and attention image; each step once after a crash and --resume."""

import gzip
import json

import pytest

from tests.conftest import write_small_config
from tests.training.test_resume import TINY, with_training
from transformer.config import ConfigError, load_config
from transformer.training import tensorboard, trainer
from transformer.training.trainer import train

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


@pytest.fixture
def tiny_config(tmp_path, multi30k_subset):
    path = write_small_config(tmp_path, multi30k_subset, **TINY)
    return load_config(path, ["data.valid_max_sentences=20", "training.tensorboard=true"])


def _events(run_dir):
    events = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0,
                                                                                            "images": 0,
                                                                                            "tensors": 0})
    events.Reload()
    return events


def _metrics(run_dir, kind, key):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in records if r["type"] == kind]


def test_a_crashed_and_resumed_run_logs_each_step_once(tmp_path, tiny_config, monkeypatch):
    # last.pt is written at step 5 (save_every_steps); the crash at update 8 comes after steps 6 and 7 were logged.
    config = with_training(tiny_config, log_every_steps=1, save_every_steps=5, keep_last_checkpoints=1)
    real_step, calls = trainer.train_step, {"n": 0}

    def crash_at_8(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 8:
            raise RuntimeError("killed")
        return real_step(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "train_step", crash_at_8)
        with pytest.raises(RuntimeError, match="killed"):
            train(config, tmp_path / "run")
    assert [s for s, _ in _metrics(tmp_path / "run", "train", "loss")] == list(range(1, 8))
    train(config, tmp_path / "run", resume=True)

    events = _events(tmp_path / "run")
    losses = [(e.step, round(e.value, 4)) for e in events.Scalars("train/loss")]
    assert [s for s, _ in losses] == list(range(1, 21))  # steps 6 and 7 of the crashed run are not shown twice
    assert losses == [(s, pytest.approx(v, abs=1e-4)) for s, v in _metrics(tmp_path / "run", "train", "loss")]
    for tag in ("train/lr", "train/grad_norm", "train/ppl", "train/tgt_tokens_per_s"):
        assert [e.step for e in events.Scalars(tag)] == list(range(1, 21)), tag
    bleu = [(e.step, e.value) for e in events.Scalars("valid/bleu")]
    assert bleu == [(s, pytest.approx(v)) for s, v in _metrics(tmp_path / "run", "valid", "bleu")]
    assert [s for s, _ in bleu] == [15, 20]
    assert [e.step for e in events.Scalars("valid/chrf")] == [15, 20]
    images = events.Images("valid/cross_attention")
    assert [e.step for e in images] == [15, 20] and images[0].width > 0 and images[0].height > 0
    assert {"valid/samples/text_summary", "valid/cross_attention_labels/text_summary"} <= set(events.Tags()["tensors"])


def test_samples_show_the_validation_translations(tmp_path, tiny_config, multi30k_subset):
    train(with_training(tiny_config, max_steps=15), tmp_path / "run")
    (sample,) = _events(tmp_path / "run").Tensors("valid/samples/text_summary")
    table = sample.tensor_proto.string_val[0].decode()
    rows = table.splitlines()
    assert len(rows) == 2 + tensorboard.SAMPLES  # header, rule, one row per sample
    references = gzip.open(multi30k_subset / "val.en.gz", "rt", encoding="utf-8").read().splitlines()
    for row, reference in zip(rows[2:], references):
        assert reference.replace("|", "\\|") in row


def test_tensorboard_off_writes_nothing_and_true_without_the_package_is_an_error(tmp_path, tiny_config,
                                                                                monkeypatch):
    train(with_training(tiny_config, max_steps=5, eval_every_steps=5, tensorboard=False), tmp_path / "off")
    assert not (tmp_path / "off" / "tensorboard").exists()
    monkeypatch.setattr(tensorboard, "tensorboard_available", lambda: False)
    with pytest.raises(ConfigError, match="training.tensorboard: true needs the tensorboard package"):
        train(with_training(tiny_config, max_steps=5), tmp_path / "missing")
    train(with_training(tiny_config, max_steps=5, eval_every_steps=5, tensorboard=None), tmp_path / "default")
    assert not (tmp_path / "default" / "tensorboard").exists()  # null: only when the package is installed


def test_without_pillow_the_run_goes_on_without_the_attention_image(tmp_path, tiny_config, monkeypatch, caplog):
    monkeypatch.setattr(tensorboard, "pillow_available", lambda: False)
    train(with_training(tiny_config, max_steps=5, eval_every_steps=5), tmp_path / "run")
    events = _events(tmp_path / "run")
    assert "valid/cross_attention" not in events.Tags()["images"]
    assert "valid/cross_attention_labels/text_summary" in events.Tags()["tensors"]
    assert [e.step for e in events.Scalars("valid/bleu")] == [5]
    assert "Pillow is not installed" in caplog.text
