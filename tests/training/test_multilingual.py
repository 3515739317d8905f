"""A multilingual run end to end (data.directions): a tiny model trained through the real training code to copy
its source into two "languages" with distinct words, told apart only by the target-language token at the start of
the source; then translation with tgt_lang, its refusals, per-direction validation, /health and attention."""

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
from transformer.config.languages import for_direction
from transformer.data import get_token_cache
from transformer.serve.service import TranslationService
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
    assert ">>b<<" in tokenizer.src_pieces(">>b<< ka")  # a user-defined piece: whole wherever it is written
    for direction, lang in (("x-a", "a"), ("x-b", "b")):
        cache = get_token_cache(for_direction(config.data, direction), "train", tokenizer)
        assert len(cache) == 1500 and all(cache.src(i)[0] == ids[lang] for i in range(len(cache)))
        assert cache.spec["src_prefix"] == [ids[lang]]
    assert translator.source_prefix("a") == [ids["a"]] and translator.languages == ["a", "b"]


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


def test_health_and_attention_know_the_languages(multilingual_run):
    translator = Translator.from_checkpoint(multilingual_run / "checkpoints" / "best.pt")
    health = TranslationService(translator).health()
    assert health["languages"] == {"tgt_langs": ["a", "b"], "directions": ["x-a", "x-b"]}
    data = attention_for(translator, "ka ke", translator.decoding_options(tgt_lang="b", beam_size=1, n_best=1))
    assert data["src_pieces"][0] == ">>b<<" and data["translation"] == "pa pe"
    assert len(data["cross"][0][0][0]) == len(data["src_pieces"])


def test_a_bilingual_model_takes_only_its_own_target_language(trained_run):
    translator = Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt")
    sentence = ["Ein Hund rennt über die Wiese."]
    assert translator.translate(sentence, tgt_lang="en") == translator.translate(sentence)
    with pytest.raises(ConfigError, match=r"translates de->en only; tgt_lang 'fr' is not its language"):
        translator.translate(sentence, tgt_lang="fr")
    assert TranslationService(translator).health()["languages"] == {"tgt_langs": ["en"], "directions": []}


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
        assert record["direction"] == direction and record["n_sentences"] == 50
        hyps = (tmp_path / f"{direction}.hyp.txt").read_text().splitlines()
        assert all(set(h.split()) <= set(WORDS[direction[-1]]) for h in hyps)  # translated into that language
        scores[direction] = record["bleu"]
    assert min(scores.values()) > 50
    for extra, words in (([], ["--direction", "x-a, x-b"]), (["--direction", "x-c"], ["not x-c"])):
        assert main(["evaluate", "--checkpoint", best, "--split", "test", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err
