"""Synthetic corpora: `transformer synthesize` (monolingual text translated into a filtered, deduplicated,
resumable parallel corpus) and `data.synthetic` (such corpora in a run, each with its tag and weight)."""

from __future__ import annotations

import gzip
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import write_small_config
from tests.test_serve_service import EchoEngine
from transformer.checkpoint import load_checkpoint
from transformer.cli import main
from transformer.config import ConfigError, DataConfig, load_config
from transformer.data.mixing import direction_shares
from transformer.decoding import Hypothesis
from transformer.synthesize import SynthesisCounts, filter_pairs, synthesize, unique_lines
from transformer.tokenizer import train_tokenizer
from transformer.training.data import prepare_data, training_epochs
from transformer.training.trainer import TrainingInterrupted, train
from transformer.translate import Translator

ROOT = Path(__file__).resolve().parents[1]


def test_the_filter_drops_each_kind_of_bad_pair_and_counts_it():
    sources = ["a b c", "a b c", "Ein Hund", "x", "eins zwei drei vier", "ok ok"]
    translations = ["", "A  b C", "A dog", "one two three four five", "one two three", "fine"]
    finished = [True, True, False, True, True, True]
    kept, dropped = filter_pairs(sources, translations, finished, max_length_ratio=3.0)
    assert kept == [4, 5]
    assert dropped == {"empty": 1, "copy": 1, "length_ratio": 1, "length_cap": 1}


def test_repeated_and_empty_lines_are_read_once(tmp_path):
    (tmp_path / "a.txt").write_text("A dog.\n\n  A dog.  \nA cat.\n")
    (tmp_path / "b.gz").write_bytes(gzip.compress(b"A cat.\nA bird.\n   \n"))
    counts = SynthesisCounts()
    assert unique_lines([str(tmp_path / "a.txt"), str(tmp_path / "b.gz")], counts) == ["A dog.", "A cat.", "A bird."]
    assert (counts.read, counts.empty, counts.duplicate, counts.excluded) == (7, 2, 2, 0)
    counts = SynthesisCounts()  # the lines the parallel corpus has already are left out, each counted once
    assert unique_lines([str(tmp_path / "a.txt"), str(tmp_path / "b.gz")], counts, {"A cat."}) == ["A dog.", "A bird."]
    assert (counts.read, counts.empty, counts.duplicate, counts.excluded) == (7, 2, 2, 1)


class ReverseEngine(EchoEngine):
    """Translates a sentence into its pieces in reverse order (never a copy, unless a palindrome); a sentence whose
    first piece is "▁Stop" is cut at the length cap."""

    def search(self, batches, options, scores):
        self.calls.append(batches)
        stop = self.tokenizer.piece_ids(["▁Stop"], "src")[0]
        return [[[Hypothesis(list(reversed(ids[:-1])), -1.0, ids[0] != stop) for _ in range(options.n_best)]
                 for ids in batch.src_ids] for batch in batches]


SENTENCES = ["Ein Hund läuft.", "Zwei Katzen schlafen im Gras.", "Stop Mann fährt Fahrrad.", "Kinder spielen.",
             "Ein Mann fährt Fahrrad auf der Straße.", "Eine Frau liest ein Buch.", "Zwei Hunde spielen im Schnee."]


@pytest.fixture(scope="module")
def reverse_translator():
    words = " ".join(SENTENCES).replace(".", " .").split()
    tokenizer = train_tokenizer(SENTENCES * 30 + words * 5, [], DataConfig(path="x", vocab_size=160))
    return Translator(ReverseEngine(tokenizer))


def _lines(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = " ".join(SENTENCES).replace(".", "").split()
    return [" ".join(rng.choice(words, size=int(rng.integers(2, 7)))) + "." for _ in range(n)]


def test_an_interrupted_job_goes_on_where_it_stopped_and_ends_as_an_uninterrupted_one(reverse_translator, tmp_path,
                                                                                      monkeypatch):
    lines = _lines(95) + ["", "Stop Kinder spielen.", _lines(1)[0]]  # an empty line, one cut, one repeat
    (tmp_path / "mono.de").write_text("\n".join(lines) + "\n")
    options = reverse_translator.resolve_options(beam_size=1, n_best=1)

    def job(out):
        return synthesize(reverse_translator, [str(tmp_path / "mono.de")], tmp_path / out, options, [__file__],
                          "de", chunk_lines=10, progress=False)
    whole, counts = job("whole")
    real, calls = Translator.run, []

    def interrupted(self, request, **kwargs):
        calls.append(len(request))
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self, request, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Translator, "run", interrupted)
        with pytest.raises(KeyboardInterrupt):
            job("resumed")
    work = tmp_path / ".resumed.work"
    assert json.loads((work / "progress.json").read_text())["done"] == 30 and not (tmp_path / "resumed").exists()
    with monkeypatch.context() as patch:
        patch.setattr(Translator, "run", lambda self, request, **kw: calls.append(len(request)) or real(
            self, request, **kw))
        job("resumed")
    assert calls[4:] == [10] * 6 + [6]  # lines 30 to 95 only: nothing translated twice
    for name in ("train.de.gz", "train.en.gz"):
        assert gzip.decompress((tmp_path / "whole" / name).read_bytes()) == gzip.decompress(
            (tmp_path / "resumed" / name).read_bytes())
    assert not work.exists()
    assert (counts.read, counts.empty, counts.duplicate, counts.translated) == (98, 1, 1, 96)
    assert counts.dropped["length_cap"] >= 1 and counts.kept == 96 - sum(counts.dropped.values()) > 0
    origin = json.loads((tmp_path / "whole" / "origin.json").read_text())
    assert origin["search"]["beam_size"] == 1 and origin["model"][0]["sha256"] and origin["date"]
    assert origin["counts"]["kept"] == counts.kept
    with pytest.raises(Exception, match="another job|other inputs"):  # a work folder of another job is refused
        (tmp_path / ".other.work").mkdir()
        (tmp_path / ".other.work" / "progress.json").write_text(json.dumps({"job": {}, "done": 3}))
        job("other")


# --------------------------------------------------------------------------------------------------
# Synthetic corpora in a run
# --------------------------------------------------------------------------------------------------


def _synthetic_corpus(folder: Path, multi30k_subset: Path, n: int = 600) -> Path:
    """A stand-in for a back-translated corpus: the subset's training pairs n.. n+n, sources word-reversed."""
    folder.mkdir(parents=True, exist_ok=True)
    read = lambda lang: gzip.decompress((multi30k_subset / f"train.{lang}.gz").read_bytes()).decode().split(  # noqa
        "\n")[1000:1000 + n]
    de = [" ".join(reversed(line.split())) for line in read("de")]
    for lang, lines in (("de", de), ("en", read("en"))):
        (folder / f"train.{lang}.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return folder


TINY = {"model": {"d_model": 32, "n_heads": 4, "d_ff": 64, "n_encoder_layers": 1, "n_decoder_layers": 1},
        "data": {"vocab_size": 300, "max_tokens_per_batch": 8192, "valid_max_sentences": 20},
        "training": {"max_steps": 20, "warmup_steps": 10, "eval_every_steps": 15, "log_every_steps": 5,
                     "keep_last_checkpoints": 0}}


@pytest.fixture
def synthetic_config(tmp_path, multi30k_subset):
    corpus = _synthetic_corpus(tmp_path / "bt", multi30k_subset)
    data = {**TINY["data"], "synthetic": [{"path": str(corpus), "tag": "<bt>", "weight": 2.0}],
            "parallel_weight": 0.5}
    return load_config(write_small_config(tmp_path, multi30k_subset, **{**TINY, "data": data}))


def test_a_tag_is_a_reserved_piece_that_starts_each_synthetic_source_only(synthetic_config, tmp_path):
    tokenizer, (real, synthetic), valid = prepare_data(synthetic_config, tmp_path / "run")
    tag = tokenizer.token_id("<bt>")
    assert tokenizer.src_pieces("<bt> a").count("<bt>") == 0  # written in a text, it is text: never the tag's id
    assert tag not in tokenizer.src_ids(["a <bt> b"])[0] and tokenizer.id_to_piece(tag, "src") == "<bt>"
    assert all(synthetic.src(i)[0] == tag for i in range(len(synthetic)))
    assert not any(tag in real.src(i) for i in range(len(real)))
    assert 500 < len(synthetic) <= 600 and synthetic.spec["src_prefix"] == [tag]  # pairs over max_len dropped
    assert valid.references and all(tag not in valid.pairs.src(i) for i in range(len(valid.references)))
    assert [corpus.held_out for corpus, _, _ in valid.corpora] == [True]  # the synthetic corpus has no valid split


def test_each_epoch_holds_the_corpora_in_their_weighted_shares_the_same_every_time(synthetic_config, tmp_path):
    tokenizer, caches, _ = prepare_data(synthetic_config, tmp_path / "run")
    sizes = [len(c) for c in caches]
    epochs = training_epochs(synthetic_config, tmp_path / "run", tokenizer, caches)
    expected = direction_shares(sizes, 1.0, [0.5, 2.0])
    assert expected.sum() == sum(sizes)
    assert expected[1] == round(sum(sizes) * 2 * sizes[1] / (0.5 * sizes[0] + 2 * sizes[1]))  # w n / sum w n
    for epoch in (0, 1):
        mixed = epochs.epoch(epoch)
        assert list(np.bincount(mixed.direction, minlength=2)) == list(expected)
        again = training_epochs(synthetic_config, tmp_path / "run", tokenizer, caches).epoch(epoch)
        assert np.array_equal(again.index, mixed.index) and np.array_equal(again.direction, mixed.direction)
    assert not np.array_equal(epochs.epoch(0).index, epochs.epoch(1).index)  # a fresh draw each epoch


def test_a_synthetic_corpus_of_one_direction_carries_that_directions_language_token(tmp_path, multi30k_subset):
    """A multilingual run with a corpus bound to en-de (a multilingual student's distilled pairs): its sources start
    with >>deu<< as the en-de references' do (untagged: the very ids of the same English lines there), never with
    >>eng<<, and it gets its weighted share of each epoch."""
    corpus = _synthetic_corpus(tmp_path / "kd", multi30k_subset)
    data = {**TINY["data"], "directions": ["de-en", "en-de"], "joint_vocab": True,
            "synthetic": [{"path": str(corpus), "name": "kd_en-de", "direction": "en-de", "tag": "",
                           "weight": 2.0}]}
    config = load_config(write_small_config(tmp_path, multi30k_subset, **{**TINY, "data": data}))
    tokenizer, (de_en, en_de, kd), valid = prepare_data(config, tmp_path / "run")
    deu, eng = tokenizer.token_id(">>deu<<"), tokenizer.token_id(">>eng<<")
    assert {int(kd.src(i)[0]) for i in range(len(kd))} == {deu} == {int(en_de.src(i)[0]) for i in range(len(en_de))}
    assert {int(de_en.src(i)[0]) for i in range(len(de_en))} == {eng}
    sources = lambda pairs: {tuple(pairs.src(i).tolist()) for i in range(len(pairs))}  # noqa: E731
    assert 500 < len(sources(kd)) and sources(kd) <= sources(en_de)  # lines 1000-1600 of the subset's English
    assert [corpus.name for corpus, _, _ in valid.corpora] == ["de-en", "en-de"]  # no validation split of its own
    epochs = training_epochs(config, tmp_path / "run", tokenizer, (de_en, en_de, kd))
    shares = np.bincount(epochs.epoch(0).direction, minlength=3)
    assert list(shares) == list(direction_shares([len(de_en), len(en_de), len(kd)], 1.0, [1.0, 1.0, 2.0]))


def test_a_run_with_a_synthetic_corpus_resumes_exactly_across_an_epoch_boundary(synthetic_config, tmp_path,
                                                                               monkeypatch):
    from tests.training.test_resume import interrupt_after

    full = train(synthetic_config, tmp_path / "full")
    with monkeypatch.context() as patch:
        interrupt_after(patch, 7)
        with pytest.raises(TrainingInterrupted):
            train(synthetic_config, tmp_path / "resumed")
    resumed = train(synthetic_config, tmp_path / "resumed", resume=True)
    assert full.epoch == resumed.epoch >= 1 and resumed.step == 20
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")["model"]
    for name, tensor in a.items():
        torch.testing.assert_close(b[name], tensor, atol=1e-6, rtol=0, msg=name)
    saved = yaml_config(tmp_path / "full")
    assert saved["data"]["synthetic"][0]["tag"] == "<bt>" and Path(saved["data"]["synthetic"][0]["path"]).is_absolute()


def yaml_config(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


@pytest.mark.parametrize("entry, key", [
    ({"path": "x", "tag": "<bt>", "weight": 0}, "data.synthetic[0].weight"),
    ({"path": "x", "tag": ">>eng<<"}, "data.synthetic[0].tag"),
    ({"path": "x", "tag": "<bt>", "direction": "fr-en"}, "data.synthetic[0].direction"),
    ({"path": "x"}, "data.synthetic[0].tag"),
    ({"tag": "<bt>"}, "data.synthetic[0].path"),
])
def test_a_bad_synthetic_entry_names_its_key(tmp_path, multi30k_subset, entry, key):
    path = write_small_config(tmp_path, multi30k_subset, data={"synthetic": [entry]})
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{key}: " in str(err.value)


@pytest.mark.slow
def test_the_toy_chain_reverse_model_then_synthesis_then_training(trained_run, multi30k_subset, tmp_path):
    """The back-translation chain as a user runs it: a reverse model (trained_run, de->en) translates German text
    (SIGINT in the middle, then the same command again), and an en->de run trains on the parallel pairs plus the
    tagged synthetic ones; the model it writes translates."""
    mono = tmp_path / "mono.de"
    lines = gzip.decompress((multi30k_subset / "train.de.gz").read_bytes()).decode().split("\n")[2000:3200]
    mono.write_text("\n".join(lines) + "\n")
    out = tmp_path / "bt"
    command = [sys.executable, "-m", "transformer", "synthesize", "--checkpoint",
               str(trained_run / "checkpoints" / "best.pt"), "--input", str(mono), "--output", str(out),
               "--chunk-lines", "100", "--beam-size", "2"]
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = tmp_path / ".bt.work" / "progress.json"
    deadline = time.monotonic() + 120
    while not progress.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 130, err  # stopped after its first chunks: the same command goes on
    assert "goes on after the last complete chunk" in err and not out.exists()
    assert 0 < json.loads(progress.read_text())["done"] < 1200
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert re.search(r"^synthesize: (\d+) of \1 lines \(100%\), \d+ sentences/s", finished.stderr, re.M)  # redirected
    assert "\r" not in finished.stderr  # a line per chunk, no progress bar redraws
    uninterrupted = subprocess.run([*command[:-5], str(tmp_path / "bt_whole"), *command[-4:]], cwd=ROOT,
                                   capture_output=True, text=True, timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    for lang in ("de", "en"):
        assert gzip.decompress((out / f"train.{lang}.gz").read_bytes()) == gzip.decompress(
            (tmp_path / "bt_whole" / f"train.{lang}.gz").read_bytes())
    origin = json.loads((out / "origin.json").read_text())
    assert origin["input_lang"] == "de" and origin["output_lang"] == "en" and origin["counts"]["kept"] > 0
    data = {**TINY["data"], "src_lang": "en", "tgt_lang": "de", "synthetic": [{"path": str(out), "tag": "<bt>"}]}
    config = write_small_config(tmp_path, multi30k_subset, **{**TINY, "data": data})
    run = tmp_path / "en_de_bt"
    assert main(["train", "--config", str(config), "--run-dir", str(run)]) == 0
    translator = Translator.from_checkpoint(run / "checkpoints" / "best.pt")
    assert translator.languages == ["de"] and len(translator.translate(["A dog runs.", "Two men."])) == 2
    assert translator.config.data.synthetic[0].path == str(out)  # the run records where its corpus came from
    from transformer.serve.service import TranslationService

    assert TranslationService(translator).health()["languages"] == {  # a synthetic corpus is not a direction
        "src_langs": ["en"], "tgt_langs": ["de"], "directions": ["en-de"]}
    tag = translator.tokenizer.token_id("<bt>")  # one whole piece of the vocabulary, put by id, never read from text
    assert tag not in translator.tokenizer.src_ids(["<bt> A dog", "A <bt> dog"])[0]


def test_an_output_synthesize_did_not_write_is_refused_before_any_work(trained_run, tmp_path, capsys, caplog):
    from transformer.cli import main

    (tmp_path / "mono.en").write_text("A dog runs.\n")
    common = ["synthesize", "--checkpoint", str(trained_run / "checkpoints" / "best.pt"), "--input",
              str(tmp_path / "mono.de"), "--output"]
    (tmp_path / "mono.de").write_text("Ein Hund rennt.\nZwei Katzen schlafen.\n")
    (tmp_path / "a_file").write_text("keep me\n")
    assert main([*common, str(tmp_path / "a_file")]) == 2
    assert "a file, not a corpus folder" in capsys.readouterr().err
    assert (tmp_path / "a_file").read_text() == "keep me\n"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    assert main([*common, str(mine)]) == 2
    assert "did not write (no origin.json)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "mine", "mono.de", "mono.en"]  # nothing left
    corpus = tmp_path / "corpus"
    capped = [str(corpus), "--max-len-b", "3", "--max-len-a", "0", "--chunk-lines", "1"]
    assert main([*common, *capped]) == 0
    assert [r.getMessage()[:33] for r in caplog.records if "length cap" in r.getMessage()] == [
        "2 of 2 outputs reached the length"]  # once for the job, not once per chunk
    (corpus / "stale").write_text("")
    assert main([*common, *capped]) == 0  # an earlier corpus: replaced whole
    assert (corpus / "origin.json").is_file() and not (corpus / "stale").exists()


def test_lines_longer_than_the_model_reads_are_counted_and_a_wrong_input_language_refused(trained_run, tmp_path,
                                                                                         capsys):
    from transformer.cli import main

    mono = tmp_path / "mono.de"
    mono.write_text("Ein Hund rennt.\n" + " ".join(["ein großer Hund und eine kleine Katze"] * 40) + "\n")
    common = ["synthesize", "--checkpoint", str(trained_run / "checkpoints" / "best.pt"), "--input", str(mono),
              "--output", str(tmp_path / "out"), "--max-len-a", "0", "--max-len-b", "4"]
    assert main([*common, "--input-lang", "fr"]) == 2
    assert "--input-lang fr: the model translates from de only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(common) == 0
    assert "1 longer than the model reads, translated from their start" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "origin.json").read_text())["counts"]["truncated"] == 1
