"""Edges users meet on the small trained model: tiny sampling temperatures, long and unspellable forced prefixes,
inputs longer than the model reads, inputs given twice, and an interrupted `translate --output`."""

from __future__ import annotations

import gzip
import json
import logging
import os

import pytest
import torch

from transformer.cli import main
from transformer.config import ConfigError, OptionError
from transformer.translate import Translator


@pytest.fixture(scope="module")
def checkpoint(trained_run):
    return trained_run / "checkpoints" / "best.pt"


@pytest.fixture(scope="module")
def translator(checkpoint):
    return Translator.from_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def lines(multi30k_subset):
    text = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read()
    return [line for line in text.split("\n") if line][:30]


def test_a_temperature_too_small_for_the_logits_is_greedy(translator, lines, capsys, checkpoint):
    greedy = translator.translate(lines, beam_size=1)
    assert translator.translate(lines, sampling=True, temperature=1e-40, seed=3) == greedy
    assert translator.translate(lines, sampling=True, temperature=1e-8, top_p=0.5) == greedy
    assert main(["translate", "--checkpoint", str(checkpoint), "--sampling", "--temperature", "1e-40", *lines[:3]]) == 0
    assert capsys.readouterr().out.splitlines() == greedy[:3]
    huge = translator.translate_n_best(lines[:3], n_best=2, sampling=True, temperature=1e30, seed=1)
    assert all(text for hyps in huge for text, _ in hyps)  # uniform draws: text, not NaN junk
    for value in ("inf", "0", "-1", "nan"):
        assert main(["translate", "--checkpoint", str(checkpoint), "--sampling", "--temperature", value, "x"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--temperature" in err[0], err


def test_a_long_prefix_comes_back_whole_and_the_cap_counts_after_it(translator, lines):
    words = ("A dog with a red collar runs across a wide green field while two children in blue jackets watch "
             "it from a wooden bench near an old stone wall and a woman with a camera takes pictures of them all "
             "in the evening sun").split()
    prefix = " ".join(words[:41])
    assert len(translator.tokenizer.encode_tgt([prefix])[0]) > 17  # longer than "Ein Hund rennt."'s cap alone
    for options in (dict(beam_size=1), dict(beam_size=4), dict(sampling=True, seed=2)):
        out = translator.translate(["Ein Hund rennt."], prefixes=[prefix], **options)[0]
        assert out.startswith(prefix), (options, out)
    too_long = " ".join(["dog"] * 400)
    with pytest.raises(OptionError, match="prefix 1 has .* tokens"):
        translator.translate(["Ein Hund rennt."], prefixes=[too_long])
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from transformer.serve import create_app

    with TestClient(create_app(translator)) as client:
        refused = client.post("/translate", json={"text": ["Ein Hund.", "Ein Hund rennt."], "prefix": ["", too_long]})
        assert refused.status_code == 422 and refused.json()["field"] == "prefix" and "prefix 2" in refused.text
        whole = client.post("/translate", json={"text": ["Ein Hund rennt."], "prefix": [prefix]}).json()
        assert whole["translations"][0].startswith(prefix)


@pytest.mark.parametrize("prefix", ["Zoë's café", "A dog 🐕 is", "🐕", "Ｆｕｌｌ width"])
def test_a_prefix_comes_back_exactly_as_given(translator, prefix):
    for options in (dict(beam_size=1), dict(beam_size=4)):
        out = translator.translate_n_best(["Ein Hund rennt im Park."], n_best=1, prefixes=[prefix], **options)[0]
        assert out[0][0].startswith(prefix), out
    two = translator.translate_n_best(["Ein Hund rennt im Park."], n_best=2, beam_size=4, prefixes=[prefix])[0]
    assert all(text.startswith(prefix) for text, _ in two)


def test_prefix_file_counts_are_refused_naming_both_before_any_output(checkpoint, lines, tmp_path, capsys):
    (tmp_path / "in.de").write_text("\n".join(lines[:5]) + "\n")
    (tmp_path / "more.en").write_text("A\n" * 7)
    out = tmp_path / "out.en"
    assert main(["translate", "--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--prefix-file",
                 str(tmp_path / "more.en"), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more.en" in err[0] and "7 lines" in err[0] and "5" in err[0], err
    assert not out.exists() and not tmp_path.joinpath("out.en.partial").exists()


def test_over_long_inputs_are_truncated_by_one_rule_and_said_everywhere(translator, checkpoint, tmp_path, caplog,
                                                                        capsys):
    limit = translator.engine.max_source_len
    long = " ".join(["Ein Hund läuft im Park"] * 80)
    assert len(translator.tokenizer.src_ids([long])[0]) + 1 > limit
    head = translator.tokenizer.src_ids([long])[0][:limit - 1]
    result = translator.run(translator.request(["Ein Hund.", long, "", long], translator.resolve_options(beam_size=1)))
    assert result.truncated == [1, 3]
    (tmp_path / "in.de").write_text("Ein Hund.\n" * 4 + long + "\n")
    with caplog.at_level(logging.WARNING):
        assert main(["translate", "--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"),
                     "--buffer-size", "2"]) == 0
    assert "line 5 has more than the model's max_positions" in caplog.text
    assert len(capsys.readouterr().out.splitlines()) == 5
    from transformer.attention_plot import attention_for

    data = attention_for(translator, long)
    assert data["truncated"] and len(data["src_pieces"]) == limit == len(data["cross"][0][0][0])
    assert data["src_pieces"][:-1] == [translator.tokenizer.id_to_piece(i, "src") for i in head]
    assert not attention_for(translator, "Ein Hund.")["truncated"]
    request = translator.request([long], translator.resolve_options(beam_size=1))
    (pairs,) = translator.align(request, translator.run(request).texts)
    assert max(s for s, _ in pairs) < len(" ".join(translator.tokenizer.src.decode(head).split()).split())


def test_sentences_with_input_or_a_checkpoint_as_a_sentence_are_refused(checkpoint, tmp_path, capsys):
    (tmp_path / "in.de").write_text("Ein Hund.\n")
    other = tmp_path / "b.pt"
    other.write_bytes(checkpoint.read_bytes())
    for args, words in (
            (["--input", str(tmp_path / "in.de"), str(other)], ["--input", "--checkpoint " + str(other)]),
            ([str(other)], ["is a model", "--checkpoint " + str(other)]),
            (["--input", str(tmp_path / "in.de"), "Ein Hund."], ["arguments (1)", "one or the other"])):
        assert main(["translate", "--checkpoint", str(checkpoint), *args]) == 2
        err = capsys.readouterr()
        assert err.out == "" and len(err.err.strip().splitlines()) == 1, err
        assert all(w in err.err for w in words), err.err


def test_an_interrupted_translate_keeps_what_it_translated_and_never_an_empty_output(checkpoint, lines, tmp_path,
                                                                                      monkeypatch, capsys):
    (tmp_path / "in.de").write_text("\n".join(lines[:6]) + "\n")
    out = tmp_path / "out.en"
    out.write_text("an earlier translation\n")
    calls = []
    real = Translator.run

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Translator, "run", interrupted)
    assert main(["translate", "--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output",
                 str(out), "--buffer-size", "2"]) == 130
    assert out.read_text() == "an earlier translation\n"  # untouched
    partial = tmp_path / "out.en.partial"
    assert len(partial.read_text().splitlines()) == 2 and str(partial) in capsys.readouterr().err
    monkeypatch.setattr(Translator, "run", real)
    assert main(["translate", "--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output",
                 str(out), "--buffer-size", "2"]) == 0
    assert len(out.read_text().splitlines()) == 6 and not partial.exists()


def test_attention_decodes_alike_in_the_cli_and_the_server(checkpoint, translator, lines, tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from transformer.serve import create_app

    assert translator.config.decoding.beam_size > 1  # the checkpoint's default is a beam: attention is greedy
    assert main(["attention", "--checkpoint", str(checkpoint), lines[3], "--out", str(tmp_path / "a.json")]) == 0
    cli = json.loads((tmp_path / "a.json").read_text())
    with TestClient(create_app(translator, checkpoints=[str(checkpoint)])) as client:
        served = client.post("/attention", json={"text": lines[3]}).json()
    assert served["translation"] == cli["translation"] == translator.translate([lines[3]], beam_size=1)[0]
    assert torch.allclose(torch.tensor(served["cross"]), torch.tensor(cli["cross"]), atol=1e-5)


def test_a_prefix_longer_than_the_model_allows_is_one_line(checkpoint, tmp_path, capsys):
    (tmp_path / "p.en").write_text(" ".join(["dog"] * 400) + "\n")
    assert main(["translate", "--checkpoint", str(checkpoint), "--prefix-file", str(tmp_path / "p.en"),
                 "Ein Hund."]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prefix 1 has" in err[0] and "max_positions" in err[0], err


def test_temperature_is_refused_in_the_config_too():
    from transformer.config import DecodingConfig

    with pytest.raises(ConfigError, match="decoding.temperature"):
        DecodingConfig(sampling=True, beam_size=1, temperature=float("inf"))


def test_n_best_lines_say_which_hypotheses_were_cut_at_the_length_cap(checkpoint, translator, lines, capsys):
    seen = set()
    for cap in (["--max-len-a", "0", "--max-len-b", "2"], []):  # every hypothesis cut; the default cap
        assert main(["translate", "--checkpoint", str(checkpoint), "--n-best", "3", "--beam-size", "4", *cap,
                     *lines[:8]]) == 0
        rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
        assert len(rows) == 24 and {len(row) for row in rows} == {4}
        ends = [row[3] for row in rows]
        seen |= set(ends)
        for i in range(8):  # per input, the finished ones first
            assert ends[3 * i:3 * i + 3] == sorted(ends[3 * i:3 * i + 3], key=lambda end: end == "cut")
        options = dict(max_len_a=0, max_len_b=2) if cap else {}
        result = translator.run(translator.request(lines[:8], translator.resolve_options(n_best=3, beam_size=4,
                                                                                          **options)))
        assert [["eos" if f else "cut" for f in hyps] for hyps in result.finished] == \
            [ends[3 * i:3 * i + 3] for i in range(8)]
    assert seen == {"eos", "cut"}


def test_output_to_a_device_or_through_a_link_is_written_in_place(checkpoint, tmp_path):
    import stat

    assert main(["translate", "--checkpoint", str(checkpoint), "--output", "/dev/null", "Ein Hund."]) == 0
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and not os.path.exists("/dev/null.partial")
    target, link = tmp_path / "target.en", tmp_path / "link.en"
    target.write_text("old\n")
    link.symlink_to(target)
    assert main(["translate", "--checkpoint", str(checkpoint), "--output", str(link), "Ein Hund."]) == 0
    assert link.is_symlink() and target.read_text() != "old\n" and len(target.read_text().splitlines()) == 1


def test_a_sentence_argument_longer_than_a_file_name_is_translated(checkpoint, capsys, tmp_path):
    """The check that refuses a checkpoint given as a sentence (`translate --checkpoint A B.pt`) asks the file system
    about each sentence: one longer than a file name may be (255 bytes) or holding a NUL is a sentence, not an
    error."""
    long = "Ein Mann mit einem roten Hut fährt mit dem Fahrrad über eine sehr lange Brücke. " * 4  # > 255 bytes
    assert len(long.encode()) > 255
    assert main(["translate", "--checkpoint", str(checkpoint), long, "Ein Hund."]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["translate", "--checkpoint", str(checkpoint), "Ein Hund.", str(checkpoint)]) == 2
    assert "is a model, not a sentence" in capsys.readouterr().err


def test_sigterm_stops_translate_as_ctrl_c_does_keeping_what_it_translated(checkpoint, lines, tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    source, out = tmp_path / "in.de", tmp_path / "out.en"
    source.write_text("\n".join(lines * 40) + "\n")
    job = subprocess.Popen([sys.executable, "-m", "transformer", "translate", "--checkpoint", str(checkpoint),
                            "--input", str(source), "--output", str(out), "--buffer-size", "16"],
                           cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE, text=True)
    partial = tmp_path / "out.en.partial"
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.stat().st_size) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 130, err
    assert "translate: interrupted" in err and str(partial) in err and not out.exists()
    assert len(partial.read_text().splitlines()) % 16 == 0 and partial.read_text()  # whole chunks, said on stderr


def test_a_validation_pair_longer_than_the_model_is_validated_as_translation_reads_it(tmp_path, multi30k_subset,
                                                                                      caplog):
    """A recipe whose validation split holds a pair longer than model.max_positions trains through its validations:
    the pair is left out of the loss (said once) and its source translated from its start, as `translate` does."""
    import gzip
    import shutil

    from tests.conftest import write_small_config
    from transformer.cli import main

    data = tmp_path / "data"
    shutil.copytree(multi30k_subset, data)
    for lang, words in (("de", "ein Hund und eine Katze laufen"), ("en", "a dog and a cat run")):
        lines = gzip.decompress((data / f"val.{lang}.gz").read_bytes()).decode().splitlines()
        lines[0] = " ".join([words] * 20)  # far more than 64 pieces
        (data / f"val.{lang}.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    config = write_small_config(tmp_path, data, model={"max_positions": 64}, data={"max_len": 60},
                                training={"max_steps": 10, "eval_every_steps": 10, "log_every_steps": 5})
    assert main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"),
                 "--set", "data.valid_max_sentences=5", "--set", "decoding.max_len_b=5"]) == 0
    said = [r.getMessage() for r in caplog.records if "longer than model.max_positions" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("validation: 1 pairs longer than model.max_positions=64")
    assert (tmp_path / "run" / "checkpoints" / "best.pt").is_file()
