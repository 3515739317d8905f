"""Sampling and n-gram blocking as users reach them: `Translator`, `transformer translate`, the server and the
CTranslate2 path, on the small trained model; bad values get one line naming the flag or field."""

from __future__ import annotations

import gzip

import pytest

from transformer.checkpoint import load_checkpoint, save_checkpoint
from transformer.cli import main
from transformer.translate import Translator


@pytest.fixture(scope="module")
def checkpoint(trained_run):
    return trained_run / "checkpoints" / "best.pt"


@pytest.fixture(scope="module")
def lines(multi30k_subset):
    text = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read()
    return [line for line in text.split("\n") if line][:40]


def _ngrams(text, n):
    words = text.split()
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def test_samples_do_not_depend_on_the_batch_size_or_the_other_lines(checkpoint, lines):
    translator = Translator.from_checkpoint(checkpoint)
    options = dict(sampling=True, top_p=0.9, seed=4)
    texts = lambda results: [[text for text, _ in hyps] for hyps in results]  # noqa: E731
    big = translator.translate_n_best(lines, n_best=2, batch_size=64, **options)
    small = translator.translate_n_best(lines, n_best=2, batch_size=3, **options)
    assert texts(big) == texts(small)
    assert [s for hyps in big for _, s in hyps] == pytest.approx([s for hyps in small for _, s in hyps], abs=1e-4)
    assert texts(translator.translate_n_best(lines[7:8], n_best=2, **options)) == texts(big[7:8])
    assert translator.translate(lines, sampling=True, top_k=1) == translator.translate(lines, beam_size=1)
    int8 = Translator.from_checkpoint(checkpoint, quantization="int8")
    assert int8.translate(lines, sampling=True, top_k=1) == int8.translate(lines, beam_size=1)


def _texts(out):
    return [(line.split("\t")[0], line.split("\t")[2]) for line in out.splitlines()]


def _scores(out):
    return [float(line.split("\t")[1]) for line in out.splitlines()]


def test_cli_sampling_is_reproducible_and_bad_values_name_the_flag(checkpoint, lines, tmp_path, capsys):
    source = tmp_path / "in.de"
    source.write_text("\n".join(lines[:10]) + "\n")
    args = ["translate", "--checkpoint", str(checkpoint), "--input", str(source), "--sampling", "--n-best", "3",
            "--seed", "9", "--temperature", "0.8"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args + ["--batch-size", "2"]) == 0
    second = capsys.readouterr().out
    assert len(first.splitlines()) == 30 and _texts(second) == _texts(first)
    # Scores agree up to float rounding (other batches pad to other shapes): within one unit of the 4th decimal.
    assert all(abs(a - b) <= 1.5e-4 for a, b in zip(_scores(first), _scores(second)))
    for flags, name in ((["--top-p", "0"], "--top-p"), (["--temperature", "0"], "--temperature"),
                        (["--beam-size", "4"], "--beam-size"), (["--top-k", "-1"], "--top-k")):
        assert main(["translate", "--checkpoint", str(checkpoint), "--sampling", lines[0], *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {name}:"), err
    for flag, value in (("--top-k", "5"), ("--top-p", "0.9"), ("--temperature", "0.5"), ("--seed", "3")):
        assert main(["translate", "--checkpoint", str(checkpoint), lines[0], flag, value]) == 2  # not sampling
        assert capsys.readouterr().err == f"error: {flag}: used only when sampling (--sampling; sampling: true " \
                                          "in a config or request): add it, or leave this option out\n"


def test_cli_no_repeat_ngram_size(checkpoint, lines, capsys):
    assert main(["translate", "--checkpoint", str(checkpoint), "--no-repeat-ngram-size", "2", *lines]) == 0
    outputs = capsys.readouterr().out.splitlines()
    assert len(outputs) == len(lines)
    # pieces, not words, are blocked; whole words repeating a bigram would need the same pieces twice
    for text in outputs:
        assert len(set(_ngrams(text, 2))) == len(_ngrams(text, 2)), text
    assert main(["translate", "--checkpoint", str(checkpoint), "--no-repeat-ngram-size", "-2", lines[0]]) == 2
    assert "--no-repeat-ngram-size" in capsys.readouterr().err


def test_server_fields(checkpoint, lines):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from transformer.serve import create_app

    translator = Translator.from_checkpoint(checkpoint)
    with TestClient(create_app(translator, checkpoints=[str(checkpoint)])) as client:
        body = {"text": lines[:3], "sampling": True, "n_best": 2, "seed": 5, "top_k": 10}
        response = client.post("/translate", json=body)
        assert response.status_code == 200, response.text
        expected = translator.translate_n_best(lines[:3], n_best=2, sampling=True, seed=5, top_k=10)
        assert [[h["text"] for h in hyps] for hyps in response.json()["n_best"]] == \
            [[text for text, _ in hyps] for hyps in expected]
        blocked = client.post("/translate", json={"text": lines[:3], "no_repeat_ngram_size": 2}).json()
        assert blocked["translations"] == translator.translate(lines[:3], no_repeat_ngram_size=2)
        for bad, field in (({"top_p": 1.5}, "top_p"), ({"temperature": -1.0}, "temperature"),
                           ({"sampling": "yes"}, "sampling"), ({"sampling": True, "n_best": 500}, "n_best"),
                           ({"top_k": 5}, "top_k")):
            response = client.post("/translate", json={"text": lines[:1], **bad})
            assert response.status_code == 422 and response.json()["field"] == field, response.text
        # /attention takes every decoding option but n_best (it shows one translation), sampling included
        response = client.post("/attention", json={"text": lines[0], "sampling": True, "seed": 5, "top_k": 10})
        assert response.status_code == 200, response.text
        assert response.json()["translation"] == translator.translate(lines[:1], sampling=True, seed=5, top_k=10)[0]
        response = client.post("/attention", json={"text": lines[0], "n_best": 2})
        assert response.status_code == 422 and response.json()["field"] == "n_best", response.text


def test_ctranslate2_takes_the_same_options(checkpoint, lines, tmp_path):
    pytest.importorskip("ctranslate2")
    from transformer.ct2 import export_ctranslate2
    from transformer.engines import load_model

    export_ctranslate2(*load_model(checkpoint), tmp_path / "ct2")
    ours, theirs = Translator.from_checkpoint(checkpoint), Translator.from_checkpoint(tmp_path / "ct2")
    assert theirs.engine.name == "ctranslate2"
    assert theirs.translate(lines, beam_size=1, no_repeat_ngram_size=2) == \
        ours.translate(lines, beam_size=1, no_repeat_ngram_size=2)
    assert theirs.translate(lines, sampling=True, top_k=1) == ours.translate(lines, beam_size=1)
    samples = theirs.translate_n_best(lines[:5], n_best=3, sampling=True, seed=2)
    assert samples == theirs.translate_n_best(lines[:5], n_best=3, sampling=True, seed=2)  # the same call, again
    assert all(len(hyps) == 3 for hyps in samples)


def test_prefixes_from_the_api_the_cli_the_server_and_ctranslate2(checkpoint, lines, tmp_path, capsys):
    translator = Translator.from_checkpoint(checkpoint)
    prefixes = ["A dog", "", "Two women are", None]
    out = translator.translate(lines[:4], prefixes=prefixes, beam_size=4)
    assert out[0].startswith("A dog") and out[2].startswith("Two women are")
    assert out[1] == translator.translate(lines[1:2], beam_size=4)[0]
    (tmp_path / "in.de").write_text("\n".join(lines[:3]) + "\n")
    (tmp_path / "prefix.en").write_text("A dog\n\nTwo women are\n")
    assert main(["translate", "--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--prefix-file",
                 str(tmp_path / "prefix.en"), "--beam-size", "4", "--buffer-size", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == out[:3]
    (tmp_path / "short.en").write_text("A dog\n")
    assert main(["translate", "--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--prefix-file",
                 str(tmp_path / "short.en")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefix-file" in err[0] and "short.en" in err[0]
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from transformer.serve import create_app

    with TestClient(create_app(translator, checkpoints=[str(checkpoint)])) as client:
        body = client.post("/translate", json={"text": lines[:3], "prefix": prefixes[:3], "beam_size": 4}).json()
        assert body["translations"] == out[:3]
        response = client.post("/translate", json={"text": lines[:3], "prefix": ["A"]})
        assert response.status_code == 422 and response.json()["field"] == "prefix"
        counts = client.get("/health").json()["batching"]  # decoded on its own, and counted
        assert (counts["requests"], counts["sentences"], counts["batches"]) == (1, 3, 1)
    pytest.importorskip("ctranslate2")
    from transformer.ct2 import export_ctranslate2
    from transformer.engines import load_model

    export_ctranslate2(*load_model(checkpoint), tmp_path / "ct2")
    greedy = translator.translate(lines[:4], prefixes=prefixes, beam_size=1)
    theirs = Translator.from_checkpoint(tmp_path / "ct2")
    assert theirs.engine.name == "ctranslate2"
    assert theirs.translate(lines[:4], prefixes=prefixes, beam_size=1) == greedy


def test_ensembles_from_the_cli_and_their_refusals(trained_run, checkpoint, lines, tmp_path, capsys):
    from tests.hf_models import write_our_checkpoint

    last = trained_run / "checkpoints" / "last.pt"
    ensemble = Translator.from_checkpoint([checkpoint, last])
    assert len(ensemble.engine.members) == 2
    outputs = ensemble.translate(lines[:5], beam_size=4)
    assert main(["translate", "--checkpoint", str(checkpoint), "--checkpoint", str(last), "--beam-size", "4",
                 *lines[:5]]) == 0
    assert capsys.readouterr().out.splitlines() == outputs
    assert Translator.from_checkpoint([checkpoint, checkpoint]).translate(lines[:5], beam_size=4) == \
        Translator.from_checkpoint(checkpoint).translate(lines[:5], beam_size=4)
    other = write_our_checkpoint(tmp_path / "other.pt")  # another tokenizer
    reverse = load_checkpoint(last)  # the same tokenizer, declared the other direction
    data = reverse["config"]["data"]
    data["src_lang"], data["tgt_lang"] = data["tgt_lang"], data["src_lang"]
    save_checkpoint(reverse, tmp_path / "reverse.pt")
    refused = {("--checkpoint", str(other)): ["tokenizer", str(checkpoint), str(other)],
               ("--checkpoint", str(tmp_path / "reverse.pt")): ["the same directions", "de->en", "en->de"],
               ("--checkpoint", str(last), "--compile"): ["--compile"]}
    for extra, words in refused.items():
        assert main(["translate", "--checkpoint", str(checkpoint), *extra, lines[0]]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err


def test_alignments_cover_every_target_word_within_the_source(checkpoint, lines, capsys):
    translator = Translator.from_checkpoint(checkpoint)
    translations = translator.translate(lines[:10])

    def align(sentences, texts):
        return translator.align(translator.request(sentences, translator.resolve_options()), texts)
    for line, text, pairs in zip(lines, translations, align(lines[:10], translations)):
        assert {j for _, j in pairs} == set(range(len(text.split())))  # each target word aligned
        assert all(0 <= i < len(line.split()) for i, _ in pairs)
    assert main(["translate", "--checkpoint", str(checkpoint), "--alignment", *lines[:3]]) == 0
    printed = [row.split("\t") for row in capsys.readouterr().out.splitlines()]
    assert [text for text, _ in printed] == translations[:3]
    assert [links for _, links in printed] == [" ".join(f"{i}-{j}" for i, j in pairs)
                                               for pairs in align(lines[:3], translations[:3])]


def test_server_alignments(checkpoint, lines):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from transformer.serve import create_app

    translator = Translator.from_checkpoint(checkpoint)
    with TestClient(create_app(translator, checkpoints=[str(checkpoint)])) as client:
        body = client.post("/translate", json={"text": lines[:2], "alignment": True}).json()
        request = translator.request(lines[:2], translator.resolve_options())
        assert body["alignments"] == [[list(p) for p in pairs]
                                      for pairs in translator.align(request, body["translations"])]
