"""Fine-tuning (`transformer train --init-from`): the run starts at the source's loss, keeps its tokenizer, writes
its own best.pt at its first validation, refuses model keys that differ, resumes exactly, and takes Marian folders."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import write_small_config
from tests.hf_models import sentences, write_marian
from tests.training.test_resume import _train_losses, interrupt_after
from transformer.checkpoint import load_checkpoint
from transformer.cli import main
from transformer.config import read_raw_config
from transformer.engines import load_model
from transformer.training.init_from import (
    content_sha256,
    fine_tuning_config,
    load_source,
    run_config,
)
from transformer.training.trainer import TrainingInterrupted, train

FINE_TUNE = {"training": {"max_steps": 10, "warmup_steps": 5, "lr_scale": 0.05, "log_every_steps": 5,
                          "eval_every_steps": 10, "keep_last_checkpoints": 0, "seed": 3},
             "data": {"valid_max_sentences": 20}}


def _fine_tune_config(folder: Path, data: Path, **sections) -> Path:
    """A recipe without the keys the source fixes (the small config's model sizes and vocabulary)."""
    path = write_small_config(folder, data, **FINE_TUNE)
    raw = yaml.safe_load(path.read_text())
    raw["model"] = {"dropout": 0.1}
    for key in ("vocab_size",):
        raw["data"].pop(key)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(raw))
    return path


def test_fine_tuning_starts_at_the_source_loss_and_writes_its_own_best(trained_run, multi30k_subset, tmp_path):
    source = trained_run / "checkpoints" / "best.pt"
    config = _fine_tune_config(tmp_path, multi30k_subset)
    run_dir = tmp_path / "fine"
    assert main(["train", "--config", str(config), "--run-dir", str(run_dir), "--init-from", str(source)]) == 0
    fresh_dir = tmp_path / "fresh"
    (tmp_path / "f").mkdir()
    fresh_config = write_small_config(tmp_path / "f", multi30k_subset, **FINE_TUNE)
    assert main(["train", "--config", str(fresh_config), "--run-dir", str(fresh_dir)]) == 0
    source_level = _train_losses(trained_run)[-1]  # the source's last logged training loss
    first, fresh_first = _train_losses(run_dir)[0], _train_losses(fresh_dir)[0]
    assert abs(first - source_level) < 0.15 * source_level < fresh_first - first
    assert (run_dir / "spm.model").read_bytes() == (trained_run / "spm.model").read_bytes()  # no new tokenizer
    best = load_checkpoint(run_dir / "checkpoints" / "best.pt")
    valid = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["type"] == "valid"]
    assert best["train_state"]["step"] == 10 == valid[0]["step"]  # its own best, at its first validation
    assert best["train_state"]["best_bleu"] == pytest.approx(valid[0]["bleu"])
    assert best["config"]["training"]["init_from"] == str(source)
    assert best["config"]["training"]["init_from_sha256"] == content_sha256(source)
    assert best["config"]["model"]["d_model"] == 64  # from the source: the recipe does not say


@pytest.mark.parametrize("override, message", [
    ("model.d_model=128", "model.d_model=128 (the source has 64)"),
    ("model.activation=gelu", "model.activation='gelu' (the source has 'relu')"),
    ("data.vocab_size=500", "data.vocab_size=500 (the source has 1000)"),
    ("model.max_positions=50", "data.max_len: 64 tokens is more than model.max_positions=50"),  # free, but checked
])
def test_a_key_the_source_fixes_is_refused_with_both_values(trained_run, multi30k_subset, tmp_path, capsys,
                                                            override, message):
    config = _fine_tune_config(tmp_path, multi30k_subset)
    code = main(["train", "--config", str(config), "--run-dir", str(tmp_path / "r"), "--set", override,
                 "--init-from", str(trained_run / "checkpoints" / "best.pt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r").exists()


def test_every_refusal_of_a_source_comes_in_one_message(trained_run, multi30k_subset, tmp_path, capsys):
    """Three mistakes, one try: a key the source fixes, a free key out of range beside it, and a tag the source's
    vocabulary lacks are named together on one line."""
    config = _fine_tune_config(tmp_path, multi30k_subset)
    synthetic = "data.synthetic=[{name: bt, path: " + str(multi30k_subset) + ", tag: '<bt>'}]"
    code = main(["train", "--config", str(config), "--run-dir", str(tmp_path / "r"), "--set", "model.d_model=128",
                 "--set", "model.max_positions=50", "--set", synthetic, "--set", "data.joint_vocab=true",
                 "--init-from", str(trained_run / "checkpoints" / "best.pt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    for part in ("model.d_model=128 (the source has 64)", "more than model.max_positions=50", "no piece <bt>"):
        assert part in err[0], err
    assert not (tmp_path / "r").exists()


def test_fine_tuning_run_resumes_exactly(trained_run, multi30k_subset, tmp_path, monkeypatch):
    config_path = _fine_tune_config(tmp_path, multi30k_subset, training={"max_steps": 12, "eval_every_steps": 8})
    source = load_source(trained_run / "checkpoints" / "best.pt")
    config = fine_tuning_config(read_raw_config(config_path), source, str(config_path))
    train(config, tmp_path / "full", init=source)
    with monkeypatch.context() as patch:
        interrupt_after(patch, 5)
        with pytest.raises(TrainingInterrupted):
            train(config, tmp_path / "resumed", init=source)
    # as `transformer train --config C --resume` (no --init-from: the run's last.pt says where it started)
    resumed_config, again = run_config(config_path, [], tmp_path / "resumed", None, resume=True)
    assert again is None and resumed_config == config
    train(resumed_config, tmp_path / "resumed", resume=True)
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, atol=1e-6, rtol=0, msg=name)
    assert _train_losses(tmp_path / "full") == _train_losses(tmp_path / "resumed")


def _write_copy_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 600, 20), ("val", 30, 21), ("test_2016_flickr", 30, 22)):
        lines = sentences(n, seed)
        for lang in ("de", "en"):  # a copy task
            (folder / f"{split}.{lang}.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return folder


def test_fine_tuning_a_marian_model(tmp_path, capsys):
    pytest.importorskip("transformers")
    marian = write_marian(tmp_path / "opus-mt-tiny", weight_std=0, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64)
    data = _write_copy_corpus(tmp_path / "data")
    config = tmp_path / "copy.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"src_lang": "de", "tgt_lang": "en", "path": str(data), "max_len": 40, "max_tokens_per_batch": 512},
        "training": {"max_steps": 150, "warmup_steps": 20, "lr_scale": 1.0, "log_every_steps": 5,
                     "eval_every_steps": 75, "keep_last_checkpoints": 0, "threads": 2},
        "decoding": {"beam_size": 2, "batch_size": 16}}))
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(config), "--run-dir", str(run_dir), "--init-from", str(marian)]) == 0
    losses = _train_losses(run_dir)
    # the imported model's own loss on the training pairs: where the run must start
    _, model, tokenizer = load_model(marian)
    lines = sentences(600, 20)[:64]
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in tokenizer.encode_src(lines)], batch_first=True)
    tgt = [torch.tensor([2] + t + [3]) for t in tokenizer.encode_tgt(lines)]
    tgt = torch.nn.utils.rnn.pad_sequence(tgt, batch_first=True)
    with torch.no_grad():
        logits = model(src, tgt[:, :-1])
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=0).item()
    assert abs(losses[0] - nll) < 0.25 * nll  # label smoothing and dropout aside, the imported model's level
    assert losses[-1] < 0.9 * losses[0]  # learning (a copy task, slowly at this size)
    assert (run_dir / "vocab.json").is_file()  # the Marian vocabulary, not a new sentencepiece model
    capsys.readouterr()
    assert main(["translate", "--checkpoint", str(run_dir / "checkpoints" / "best.pt"), lines[0], lines[1]]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_fine_tuning_on_text_the_vocabulary_cannot_spell_names_the_characters(trained_run, multi30k_subset, tmp_path,
                                                                              caplog, capsys):
    """2,000-odd pairs of which 200 hold Łódź, Ørsted, Škoda, Đorđe, Þórshöfn: the run says so at its start, with the
    characters and their counts, and data.unknown_characters=refuse stops it in one line."""
    import gzip
    import logging

    data = tmp_path / "data"
    data.mkdir()
    for name in multi30k_subset.iterdir():
        (data / name.name).write_bytes(name.read_bytes())
    names = ["Łódź", "Ørsted", "Škoda", "Đorđe", "Þórshöfn"]
    for lang, template in (("de", "Ein Mann aus {} fährt Fahrrad."), ("en", "A man from {} rides a bike.")):
        path = data / f"train.{lang}.gz"
        lines = gzip.open(path, "rt", encoding="utf-8").read().rstrip("\n").split("\n")
        lines += [template.format(names[i % 5]) for i in range(200)]
        path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    config = _fine_tune_config(tmp_path, data, training={"max_steps": 1, "eval_every_steps": 1})
    source = str(trained_run / "checkpoints" / "best.pt")
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--config", str(config), "--run-dir", str(tmp_path / "r"), "--init-from", source]) == 0
    report = next(r.getMessage() for r in caplog.records if "maps to unk" in r.getMessage())
    assert report.startswith("200 of ") and "'Ł' (40)" in report and "'Þ' (40)" in report, report
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--run-dir", str(tmp_path / "r2"), "--init-from", source,
                 "--set", "data.unknown_characters=refuse"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "200 of " in err[0] and "unknown_characters=refuse" in err[0], err
