"""A multilingual run end to end (data.directions): a tiny model trained through the real training code to copy
its source into two "languages" with distinct words, told apart only by the target-language token at the start of
the source; then translation with tgt_lang, its refusals, per-direction validation, /health and attention."""

import asyncio
import gzip
import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from transformer import Translator
from transformer.attention_plot import attention_for
from transformer.checkpoint import load_checkpoint
from transformer.cli import main
from transformer.config import ConfigError, load_config
from transformer.data import get_token_cache
from transformer.serve.service import RequestError, TranslationService
from transformer.training.trainer import TrainingInterrupted, train

from .test_resume import interrupt_after

pytestmark = pytest.mark.slow  # trains a model (400 updates, about 6 s on 2 cores)

WORDS = {"x": "ka ke ki ko ku la le li".split(), "a": "ma me mi mo mu na ne ni".split(),
         "b": "pa pe pi po pu ra re ri".split()}
"""The source language x and the two target languages: word i of x is word i of a and of b."""

CONFIG = {
    "model": {"d_model": 64, "n_heads": 4, "d_ff": 128, "n_encoder_layers": 2, "n_decoder_layers": 2, "dropout": 0.0,
              "attention_dropout": 0.0, "max_positions": 32, "share_all_embeddings": True, "norm_first": True},
    "data": {"directions": ["x-a", "x-b"], "direction_temperature": 2.0, "vocab_size": 48, "max_len": 30,
             "max_tokens_per_batch": 480, "valid_max_sentences": 40},
    "training": {"max_steps": 400, "warmup_steps": 60, "lr_scale": 0.5, "log_every_steps": 50,
                 "eval_every_steps": 200, "seed": 6, "threads": 2, "keep_last_checkpoints": 0, "label_smoothing": 0.0},
    "decoding": {"beam_size": 1, "max_len_b": 4, "max_len_a": 1.0},
}


def _sentences(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8) for _ in range(rng.randint(2, 6))] for _ in range(n)]


def _write(folder: Path, split: str, sentences: list[list[int]]) -> None:
    for lang, words in WORDS.items():
        text = "\n".join(" ".join(words[i] for i in s) for s in sentences) + "\n"
        (folder / f"{split}.{lang}.gz").write_bytes(gzip.compress(text.encode()))


@pytest.fixture(scope="module")
def multilingual_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("multilingual")
    data = folder / "data"
    data.mkdir()
    _write(data, "train", _sentences(1500, 0))
    _write(data, "val", _sentences(60, 1))
    _write(data, "test", _sentences(50, 2))
    raw = yaml.safe_load(yaml.safe_dump(CONFIG))
    raw["data"]["path"] = str(data)
    (folder / "config.yaml").write_text(yaml.safe_dump(raw))
    train(load_config(folder / "config.yaml"), folder / "run")
    return folder / "run"


def _test_set(run: Path) -> tuple[list[str], dict[str, list[str]]]:
    data = Path(load_config(run / "config.yaml").data.path)
    read = lambda lang: gzip.decompress((data / f"test.{lang}.gz").read_bytes()).decode().splitlines()  # noqa: E731
    return read("x"), {"a": read("a"), "b": read("b")}


def test_the_language_token_starts_every_source_and_is_one_piece(multilingual_run):
    config = load_config(multilingual_run / "config.yaml")
    translator = Translator.from_checkpoint(multilingual_run / "checkpoints" / "best.pt")
    tokenizer = translator.tokenizer
    ids = {lang: tokenizer.token_id(f">>{lang}<<") for lang in "ab"}
    # the token is the model's mark, put by id: written in a text (anywhere) it is text, spelled with other pieces
    for text in (">>b<< ka", "ka >>b<< ke", "ka>>a<<"):
        assert not {ids["a"], ids["b"]} & set(tokenizer.src_ids([text])[0]), text
        assert not {ids["a"], ids["b"]} & set(tokenizer.tgt_ids([text])[0]), text
    assert tokenizer.src_ids(["ka ke"]) == tokenizer.src.encode(["ka ke"])  # text without marks: as sentencepiece
    for corpus, lang in zip(config.data.corpora, "ab"):
        cache = get_token_cache(corpus.section(config.data), "train", tokenizer)
        assert len(cache) == 1500 and all(cache.src(i)[0] == ids[lang] for i in range(len(cache)))
        assert cache.spec["src_prefix"] == [ids[lang]]
    assert translator.resolve_options(tgt_lang="a").source_prefix == (ids["a"],)
    assert translator.languages == ["a", "b"]
    assert translator.engine.banned_ids == (ids["a"], ids["b"])  # instructions, never written in an output


def test_the_target_language_token_chooses_the_output_language(multilingual_run):
    """The decisive property: the same sources, translated with tgt_lang a and b, come out in each language's words
    (the only thing that tells the model which is the token at the start of the source)."""
    translator = Translator.from_checkpoint(multilingual_run / "checkpoints" / "best.pt")
    sources, references = _test_set(multilingual_run)
    outputs = {lang: translator.translate(sources, tgt_lang=lang) for lang in "ab"}
    for lang in "ab":
        exact = sum(o == r for o, r in zip(outputs[lang], references[lang])) / len(sources)
        assert exact >= 0.7, (lang, exact, list(zip(outputs[lang], references[lang]))[:5])  # 0.86-0.98 seen
        assert all(o and set(o.split()) <= set(WORDS[lang]) for o in outputs[lang])  # only that language's words
    assert sum(a != b for a, b in zip(outputs["a"], outputs["b"])) == len(sources)


def test_a_multilingual_model_needs_one_of_its_languages(multilingual_run, capsys):
    best = multilingual_run / "checkpoints" / "best.pt"
    translator = Translator.from_checkpoint(best)
    with pytest.raises(ConfigError, match="translates into 2 languages: give the one to translate into, one of a, b"):
        translator.translate(["ka ke"])
    with pytest.raises(ConfigError, match="translates into a, b, not 'c'") as err:
        translator.translate(["ka ke"], tgt_lang="c")
    assert err.value.key == "decoding.tgt_lang"
    assert main(["translate", "--checkpoint", str(best), "ka ke"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--tgt-lang" in error and "one of a, b" in error
    assert main(["translate", "--checkpoint", str(best), "--tgt-lang", "b", "ka ke ki"]) == 0
    assert capsys.readouterr().out.strip() == "pa pe pi"


def test_a_token_written_at_the_start_of_a_sentence_is_read_once_or_refused(multilingual_run, capsys):
    """OPUS-MT's users write `>>fra<< text`: the written token of tgt_lang is taken out of the text, so the model
    reads the one token it was trained with (not it twice, nor a stray piece); another language's is refused, in
    the API, the CLI and the server (before batching, so no other request fails with it)."""
    best = multilingual_run / "checkpoints" / "best.pt"
    translator = Translator.from_checkpoint(best)
    seen = []
    decode_ids = translator.decode_ids
    translator.decode_ids = lambda ids, *args, **kwargs: seen.append(ids) or decode_ids(ids, *args, **kwargs)
    plain = translator.translate(["ka ke ki", "ko ku"], tgt_lang="b")
    written = translator.translate([">>b<< ka ke ki", "  >>b<<ko ku"], tgt_lang="b")
    assert seen[0] == seen[1] and written == plain == ["pa pe pi", "po pu"]
    options = translator.resolve_options(tgt_lang="b", beam_size=1, n_best=1)
    assert translator.align(translator.request([">>b<< ka ke ki"], options), ["pa pe pi"]) == translator.align(
        translator.request(["ka ke ki"], options), ["pa pe pi"])
    assert attention_for(translator, ">>b<< ka ke", options)["src_pieces"] == attention_for(
        translator, "ka ke", options)["src_pieces"]
    with pytest.raises(ConfigError, match=r"starts with >>a<< but the target language is b") as err:
        translator.translate(["ko ku", ">>a<< ka ke"], tgt_lang="b")
    assert err.value.key == "decoding.tgt_lang" and err.value.sentence == 1
    assert main(["translate", "--checkpoint", str(best), "--tgt-lang", "b", "ko ku", ">>a<< ka ke"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--tgt-lang: input line 2: a sentence starts with >>a<<" in error[0], error
    assert main(["translate", "--checkpoint", str(best), ">>b<< ko ku", "ka ke"]) == 2  # no token, no --tgt-lang
    out, err = capsys.readouterr()
    assert out.splitlines() == ["po pu"] and err.count("\n") == 1 and "input line 2: " in err, err
    service = TranslationService(translator)
    with pytest.raises(RequestError, match="starts with >>a<<") as refused:
        asyncio.run(service.translate(["ko ku", ">>a<< ka ke"], {"tgt_lang": "b"}))
    assert refused.value.status == 422 and refused.value.field == "text[1]"


def test_the_explorer_page_translates_into_the_language_chosen(multilingual_run, tmp_path):
    """`transformer serve` of a multilingual model in Chromium: the page offers the model's target languages and
    sends the one chosen with both requests (without it every request would be refused)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    sync_api = pytest.importorskip("playwright.sync_api")
    from ..test_serve_live import _chromium, _start

    chromium = _chromium()
    process, url = _start(multilingual_run, tmp_path / "server.log")
    try:
        health = httpx.get(url + "/health", timeout=60).json()
        assert health["vocabulary"]["tgt_lang"] is None and health["languages"]["tgt_langs"] == ["a", "b"]
        expected = {lang: httpx.post(url + "/translate", json={"text": ["ka ke ki"], "tgt_lang": lang},
                                     timeout=60).json()["translations"][0] for lang in "ab"}
        assert expected["a"] != expected["b"]
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                page = browser.new_page()
                page.goto(url + "/")
                page.wait_for_function("document.getElementById('model-info').textContent.includes('x → a, b')")
                assert page.eval_on_selector_all("#tgt-lang-select option", "o => o.map(x => x.value)") == ["a", "b"]
                page.fill("#source", "ka ke ki")
                for lang in "ba":
                    page.select_option("#tgt-lang-select", lang)
                    page.click("#translate")
                    page.wait_for_function("t => document.querySelector('#translations li')?.textContent.trim() === t",
                                           arg=expected[lang])
                    page.wait_for_function("t => document.querySelector('#key-pieces .piece')?.textContent === t",
                                           arg=f">>{lang}<<")  # the attention of the source as translated
                    assert page.inner_text("#tgt-lang") == lang and page.is_hidden("#error")
            finally:
                browser.close()
    finally:
        process.terminate()
        process.wait(30)


def test_validation_scores_each_direction_and_their_mean_picks_best(multilingual_run):
    records = [json.loads(line) for line in (multilingual_run / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["type"] == "valid"]
    assert [r["step"] for r in valid] == [200, 400]
    for record in valid:
        directions = record["directions"]
        assert set(directions) == {"x-a", "x-b"} and all(d["n_sentences"] == 40 for d in directions.values())
        assert record["bleu"] == pytest.approx(sum(d["bleu"] for d in directions.values()) / 2)
        assert record["chrf"] == pytest.approx(sum(d["chrf"] for d in directions.values()) / 2)
        assert record["n_sentences"] == 80
    assert valid[-1]["best_bleu"] == max(r["bleu"] for r in valid)


def test_a_written_token_alone_chooses_the_language_everywhere(multilingual_run, capsys):
    """Without tgt_lang, the token written at the start names the language (as OPUS-MT's models are told theirs):
    the API, the CLI (a file's lines each with their own token, run by run, in input order), the server and the
    attention view; sentences of one call naming different languages are refused, naming the second."""
    best = multilingual_run / "checkpoints" / "best.pt"
    translator = Translator.from_checkpoint(best)
    assert translator.translate([">>b<< ka ke ki", ">>B<<ko ku"]) == translator.translate(
        ["ka ke ki", "ko ku"], tgt_lang="b") == ["pa pe pi", "po pu"]
    assert translator.translate([">>a<< ka ke ki"]) == ["ma me mi"]
    with pytest.raises(ConfigError, match="sentence 1 starts with >>a<< and sentence 2 with >>b<<") as err:
        translator.translate([">>a<< ka", ">>b<< ka"])
    assert err.value.sentence == 1
    with pytest.raises(ConfigError, match="sentence 1 starts with >>a<< and sentence 2 with no language token"):
        translator.translate([">>a<< ka", "ka"])
    with pytest.raises(ConfigError, match=">>c<<.*does not translate into: it translates into a, b"):
        translator.translate([">>c<< ka"])
    lines = [("a", "ka ke"), ("b", "ka ke"), ("b", "ko ku ki"), ("a", "ku ka")]
    assert main(["translate", "--checkpoint", str(best), *[f">>{lang}<< {text}" for lang, text in lines]]) == 0
    expected = [translator.translate([text], tgt_lang=lang)[0] for lang, text in lines]
    assert capsys.readouterr().out.splitlines() == expected and expected[0] != expected[1]
    assert main(["translate", "--checkpoint", str(best), ">>a<< ka ke", "ko ku"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--tgt-lang" in error[0] and "one of a, b" in error[0], error
    service = TranslationService(translator)

    async def serve(text):
        service.start()
        try:
            return await service.translate(text, {})
        finally:
            await service.stop()
    assert asyncio.run(serve([">>b<< ka ke"]))["translations"] == translator.translate(["ka ke"], tgt_lang="b")
    with pytest.raises(RequestError, match="sentence 1 starts with >>a<< and sentence 2 with >>b<<") as refused:
        asyncio.run(serve([">>a<< ka", ">>b<< ka"]))
    assert refused.value.status == 422 and refused.value.field == "text[1]"
    data = attention_for(translator, ">>b<< ka ke")
    assert data["translation"] == translator.translate(["ka ke"], tgt_lang="b")[0] and data["src_pieces"][0] == ">>b<<"


def test_health_and_attention_know_the_languages(multilingual_run):
    translator = Translator.from_checkpoint(multilingual_run / "checkpoints" / "best.pt")
    health = TranslationService(translator).health()
    assert health["languages"] == {"src_langs": ["x"], "tgt_langs": ["a", "b"], "directions": ["x-a", "x-b"]}
    data = attention_for(translator, "ka ke", translator.resolve_options(tgt_lang="b", beam_size=1, n_best=1))
    assert data["src_pieces"][0] == ">>b<<" and data["translation"] == "pa pe"
    assert len(data["cross"][0][0][0]) == len(data["src_pieces"])


def test_a_bilingual_model_takes_only_its_own_target_language(trained_run):
    translator = Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt")
    sentence = ["Ein Hund rennt über die Wiese."]
    assert translator.translate(sentence, tgt_lang="en") == translator.translate(sentence)
    with pytest.raises(ConfigError, match=r"translates de->en only; tgt_lang 'fr' is not its language"):
        translator.translate(sentence, tgt_lang="fr")
    assert TranslationService(translator).health()["languages"] == {"src_langs": ["de"], "tgt_langs": ["en"],
                                                                   "directions": ["de-en"]}
    assert translator.engine.banned_ids == ()  # a bilingual model has no marks to ban
    # a token written at the start is a language instruction on every model: its own is taken out, another refused
    assert translator.translate([">>eng<< " + sentence[0]]) == translator.translate([">>en<<" + sentence[0]]) == \
        translator.translate(sentence)
    with pytest.raises(ConfigError, match=">>fra<<.*a language this model does not translate into: it "
                                          "translates into en"):
        translator.translate([">>fra<< " + sentence[0]])
    with pytest.raises(ConfigError, match="starts with >>fra<< but the target language is en"):
        translator.translate([">>fra<< " + sentence[0]], tgt_lang="en")


def test_a_bilingual_run_carries_no_language_token(trained_run, monkeypatch):
    """Bilingual runs are as before the multilingual code: the token cache's key has no src_prefix, and the engine
    gets exactly the tokenizer's ids."""
    config = load_config(trained_run / "config.yaml")
    translator = Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt")
    cache = get_token_cache(config.data, config.data.train_split, translator.tokenizer)
    assert set(cache.spec) == {"format", "corpus", "tokenizer_sha256", "encoding", "max_len", "src_lang",
                               "tgt_lang"}
    assert translator.resolve_options().source_prefix == translator.resolve_options(tgt_lang="en").source_prefix == ()
    seen = []
    decode_ids = translator.decode_ids
    monkeypatch.setattr(translator, "decode_ids", lambda src_ids, *a, **k: seen.extend(src_ids) or
                        decode_ids(src_ids, *a, **k))
    sentences = ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball."]
    translator.translate(sentences)
    assert seen == translator.tokenizer.encode_src(sentences)


def test_an_interrupted_multilingual_run_resumes_exactly(multilingual_run, tmp_path, monkeypatch):
    """With subword sampling per direction and an epoch boundary after the interruption (an epoch is about 75
    batches here): the same mixed epochs, batches and weights as an uninterrupted run."""
    config = load_config(multilingual_run / "config.yaml", ["training.max_steps=100", "training.eval_every_steps=100",
                                                            "data.subword_sampling=true", "data.subword_alpha=0.1"])
    full = train(config, tmp_path / "full")
    with monkeypatch.context() as patch:
        interrupt_after(patch, 40)
        with pytest.raises(TrainingInterrupted, match="stopped at step 40"):
            train(config, tmp_path / "resumed")
    resumed = train(config, tmp_path / "resumed", resume=True)
    assert full.epoch == resumed.epoch >= 1 and resumed.step == 100
    assert sorted(p.name for p in (tmp_path / "full" / "subword_samples").iterdir()) == ["x-a", "x-b"]
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, atol=1e-6, rtol=0, msg=name)


def test_the_ctranslate2_export_translates_with_the_language_token_as_ours(multilingual_run, tmp_path):
    """The token is a piece of the exported vocabulary like any other: CTranslate2 gets it at the start of each
    source (the text layer puts it there for every engine), and switches language as our model does."""
    pytest.importorskip("ctranslate2")
    from transformer.ct2 import export_ctranslate2
    from transformer.engines import load_model

    best = multilingual_run / "checkpoints" / "best.pt"
    export_ctranslate2(*load_model(best), tmp_path / "ct2")
    ours, theirs = Translator.from_checkpoint(best), Translator.from_checkpoint(tmp_path / "ct2")
    assert theirs.engine.name == "ctranslate2" and theirs.languages == ["a", "b"]
    sources, _ = _test_set(multilingual_run)
    for lang in "ab":
        for beam_size in (1, 4):
            assert theirs.translate(sources, tgt_lang=lang, beam_size=beam_size) == \
                ours.translate(sources, tgt_lang=lang, beam_size=beam_size), (lang, beam_size)
    with pytest.raises(ConfigError, match="one of a, b"):
        theirs.translate(sources[:1])


def test_evaluate_scores_one_direction_of_a_multilingual_model(multilingual_run, tmp_path, capsys):
    best = str(multilingual_run / "checkpoints" / "best.pt")
    scores = {}
    for direction in ("x-a", "x-b"):
        assert main(["evaluate", "--checkpoint", best, "--split", "test", "--set", "data.test_split=test",
                     "--direction", direction, "--beam-size", "1", "--json", str(tmp_path / f"{direction}.json")]) == 0
        out = capsys.readouterr().out
        assert f"test.{direction[-1]}.gz" in out
        record = json.loads((tmp_path / f"{direction}.json").read_text())
        assert record["direction"] == direction and record["tgt_lang"] == direction[-1] and record["n_sentences"] == 50
        hyps = (tmp_path / f"{direction}.hyp.txt").read_text().splitlines()
        assert all(set(h.split()) <= set(WORDS[direction[-1]]) for h in hyps)  # translated into that language
        scores[direction] = record["bleu"]
    assert min(scores.values()) > 50
    for extra, words in (([], ["--direction", "x-a, x-b"]), (["--direction", "x-c"], ["not x-c"]),
                         (["--direction", "x-a", "--tgt-lang", "b"], ["--tgt-lang b and --direction x-a"])):
        assert main(["evaluate", "--checkpoint", best, "--split", "test", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err
    data = Path(load_config(multilingual_run / "config.yaml").data.path)
    files = ["--src", str(data / "test.x.gz"), "--ref", str(data / "test.b.gz")]
    assert main(["evaluate", "--checkpoint", best, *files, "--direction", "x-b"]) == 2  # it would not say the language
    assert "with --src/--ref give the language to translate into with --tgt-lang" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", best, *files, "--tgt-lang", "B", "--beam-size", "1",
                 "--json", str(tmp_path / "files.json")]) == 0  # B names b, as fra names fr
    record = json.loads((tmp_path / "files.json").read_text())
    assert record["tgt_lang"] == "b" and record["direction"] is None and record["bleu"] == scores["x-b"]


def _post_norm_run(run: Path, folder: Path) -> Path:
    """The fixture's recipe as post-norm (what MarianMT expresses; the fixture is pre-norm), trained 200 updates on
    the same data: enough to write each language's words. Returns its last.pt."""
    overrides = ["model.norm_first=false", "training.lr_scale=0.3", "training.max_steps=200",
                 "training.eval_every_steps=200"]
    train(load_config(run / "config.yaml", overrides), folder)
    return folder / "checkpoints" / "last.pt"


def test_the_marian_export_translates_with_the_language_token_as_ours(multilingual_run, tmp_path):
    """Plain `transformers` code with `>>b<<` at the start of the source, as for the OPUS-MT multi-target models,
    gives our translations with tgt_lang b (all different from those into a); the folder imported back is the same
    multilingual model."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from transformer.engines import load_model
    from transformer.hf import export_huggingface

    checkpoint = _post_norm_run(multilingual_run, tmp_path / "post_norm")
    folder = export_huggingface(*load_model(checkpoint), tmp_path / "hf")
    assert json.loads((folder / "tokenizer_config.json").read_text())["target_lang"] == "a+b"
    tokenizer = transformers.MarianTokenizer.from_pretrained(folder)
    model = transformers.MarianMTModel.from_pretrained(folder).eval()
    ours, back = Translator.from_checkpoint(checkpoint), Translator.from_checkpoint(folder)
    assert back.languages == ["a", "b"]
    sources, _ = _test_set(multilingual_run)
    outputs = {}
    for lang in "ab":
        batch = tokenizer([f">>{lang}<< {s}" for s in sources], return_tensors="pt", padding=True)
        assert (batch["input_ids"][:, 0] == ours.tokenizer.token_id(f">>{lang}<<")).all()
        with torch.no_grad():
            generated = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=12)
        outputs[lang] = ours.translate(sources, tgt_lang=lang, beam_size=1, max_len_a=0.0, max_len_b=12, max_repeat=0)
        assert tokenizer.batch_decode(generated[:, 1:], skip_special_tokens=True) == outputs[lang], lang
        assert back.translate(sources, tgt_lang=lang) == ours.translate(sources, tgt_lang=lang)
    assert sum(a != b for a, b in zip(outputs["a"], outputs["b"])) == len(sources)  # the token reaches the encoder


def test_alignments_read_the_attention_of_the_source_as_translated(multilingual_run):
    """The token starts the source the attention is read from (as when translating) and is never aligned to: word
    indices count the sentence's own words. A copy model's alignment is the diagonal."""
    from transformer.decoding.alignment import align_words

    translator = Translator.from_checkpoint(multilingual_run / "checkpoints" / "best.pt")
    source, target = "ka ke ki ko", "pa pe pi po"
    assert translator.translate([source], tgt_lang="b") == [target]
    data = attention_for(translator, source, translator.resolve_options(tgt_lang="b", beam_size=1, n_best=1))
    cross = torch.tensor(data["cross"][-1]).mean(0)[:, 1:]  # last layer, heads averaged, the token's column off
    expected = align_words(cross, data["src_pieces"][1:-1], data["tgt_out_pieces"][:-1])
    assert translator.align(translator.request([source], translator.resolve_options(tgt_lang="b")),
                            [target]) == [expected]
    assert expected == [(0, 0), (1, 1), (2, 2), (3, 3)]
    with pytest.raises(ConfigError, match="one of a, b"):
        translator.resolve_options()


def test_fine_tuning_a_multilingual_model_keeps_its_language_tokens(multilingual_run, tmp_path, capsys):
    """--init-from onto one direction: the run reuses the source's vocabulary, its sources keep their token, and
    the fine-tuned model still takes tgt_lang. A bilingual config, or a target language without a token, is
    refused in one line."""
    best = str(multilingual_run / "checkpoints" / "best.pt")
    raw = yaml.safe_load((multilingual_run.parent / "config.yaml").read_text())
    raw["training"].update(max_steps=20, eval_every_steps=20, warmup_steps=10, lr_scale=0.05)

    def run(name: str, **data) -> int:
        config = json.loads(json.dumps(raw))
        config["data"].update(data)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        return main(["train", "--config", str(tmp_path / f"{name}.yaml"), "--run-dir", str(tmp_path / name),
                     "--init-from", best])

    assert run("one", directions=["x-b"]) == 0
    capsys.readouterr()
    source, tuned = Translator.from_checkpoint(best), Translator.from_checkpoint(tmp_path / "one/checkpoints/last.pt")
    assert tuned.tokenizer.digest() == source.tokenizer.digest() and tuned.languages == ["b"]
    assert tuned.resolve_options(tgt_lang="b").source_prefix == source.resolve_options(tgt_lang="b").source_prefix
    assert tuned.translate(["ka ke ki"], tgt_lang="b") == tuned.translate(["ka ke ki"]) == ["pa pe pi"]  # its one
    refusals = {"bilingual": (dict(directions=[], src_lang="x", tgt_lang="b"), ["data.directions", "[x-b]"]),
                "new": (dict(directions=["x-a", "x-c"]), ["data.directions", ">>c<<", "a, b"])}
    for name, (data, words) in refusals.items():
        assert run(name, **data) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err


def test_the_target_language_is_resolved_once_per_request_where_it_enters(multilingual_run, tmp_path, monkeypatch,
                                                                          capsys):
    """One `resolve_target` per served /translate (with an alignment), per CLI run of a line with --alignment and per
    `evaluate`: what enters is resolved once, and translation, alignment and attention take the result."""
    import transformer.request as request_module

    calls = []
    resolve = request_module.resolve_target
    monkeypatch.setattr(request_module, "resolve_target", lambda *a: calls.append(a) or resolve(*a))
    best = multilingual_run / "checkpoints" / "best.pt"
    service = TranslationService(Translator.from_checkpoint(best))

    async def serve():
        service.start()
        try:
            return await service.translate([">>b<< ka ke ki", "ko ku"], {"tgt_lang": "b"}, alignment=True)
        finally:
            await service.stop()
    answer = asyncio.run(serve())
    assert answer["translations"] == ["pa pe pi", "po pu"] and answer["alignments"][0] == [[0, 0], [1, 1], [2, 2]]
    assert len(calls) == 1
    calls.clear()
    assert main(["translate", "--checkpoint", str(best), "--tgt-lang", "b", "--alignment", "ka ke ki"]) == 0
    assert capsys.readouterr().out == "pa pe pi\t0-0 1-1 2-2\n" and len(calls) == 1
    calls.clear()
    (tmp_path / "src.txt").write_text("ka ke ki\nko ku\n")
    (tmp_path / "ref.txt").write_text("pa pe pi\npo pu\n")
    assert main(["evaluate", "--checkpoint", str(best), "--src", str(tmp_path / "src.txt"), "--ref",
                 str(tmp_path / "ref.txt"), "--tgt-lang", "b"]) == 0
    assert "chrF = 100.00" in capsys.readouterr().out and len(calls) == 1


def test_make_evaluate_of_a_short_multilingual_run_ends_with_its_score_table(multilingual_run, tmp_path):
    """A run with fewer step checkpoints than AVERAGE_LAST averages those there are (and says so), scores every
    direction, skips the zero-shot pairs whose languages it lacks, and writes scores.md."""
    import shutil
    import subprocess
    import sys

    run = tmp_path / "run"
    shutil.copytree(multilingual_run, run)
    shutil.copy(run / "checkpoints" / "last.pt", run / "checkpoints" / "step_200.pt")  # one: fewer than 5
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"]["test_split"] = "test"  # the toy corpus's name of its test split
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    venv = Path(sys.executable).parent.parent
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["make", "-s", "evaluate", f"RUN_DIR={run}", f"VENV={venv}",
                           "EVAL_SET_FLAGS=--set data.test_split=test"], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "1 step checkpoints" in done.stdout and "avg_last1 scored beside best.pt" in done.stdout
    table = (run / "scores.md").read_text()
    assert "| x-a |" in table and "| x-b |" in table and "avg_last1 beam" in table
