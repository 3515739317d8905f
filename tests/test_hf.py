"""Hugging Face Marian models in and out (`transformer/hf.py`), checked against `transformers` itself on tiny models
built here (no network): logits, greedy and beam outputs, round trips that keep every tensor (ours) or the same
function (Marian's, written back in our vocabulary order), and every refusal."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from tests.hf_models import sentences, write_marian, write_our_checkpoint
from transformer.cli import main
from transformer.config import ConfigError
from transformer.decoding import max_output_length
from transformer.engines import PyTorchEngine, load_model
from transformer.files import ExportError
from transformer.hf import export_huggingface as _export
from transformer.hf import marian_order
from transformer.translate import Translator

transformers = pytest.importorskip("transformers")


def export_huggingface(checkpoint, output):
    """As `transformer export --format huggingface --checkpoint CHECKPOINT --output OUTPUT`."""
    return _export(*load_model(checkpoint), output)


safetensors = pytest.importorskip("safetensors.torch")


def _our_id_of_each_marian_row(folder):
    """Our token id of each row of a Marian folder's vocabulary, as the import orders them (its decoder start row is
    our bos, also when it is the pad row)."""
    from transformer.hf import _import_vocabulary

    rows = _import_vocabulary(folder, json.loads((folder / "config.json").read_text()))[1]
    ours = torch.zeros(max(rows) + 1, dtype=torch.long)
    ours[torch.tensor(rows)] = torch.arange(len(rows))  # bos (our id 2) is written after pad (0): it wins
    return ours


def _hf(folder):
    return (transformers.MarianTokenizer.from_pretrained(folder),
            transformers.MarianMTModel.from_pretrained(folder).eval())


def _generate(folder, lines, num_beams, max_new_tokens):
    tokenizer, model = _hf(folder)
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, num_beams=num_beams, do_sample=False, max_new_tokens=max_new_tokens,
                             length_penalty=0.0, early_stopping=True)
    return tokenizer.batch_decode(out[:, 1:], skip_special_tokens=True)  # without the decoder start token


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
    return write_marian(tmp_path_factory.mktemp("marian") / "opus-mt-tiny")


def test_marian_order_moves_the_sines_first_and_the_cosines_second():
    order = marian_order(8)
    assert order.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    from transformer.model.layers import SinusoidalPositionalEncoding

    ours = SinusoidalPositionalEncoding(8, 10).table
    f = torch.pow(10000.0, -torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    pos = torch.arange(10, dtype=torch.float64)[:, None]
    marian = torch.cat([torch.sin(pos * f), torch.cos(pos * f)], dim=1).float()  # Marian's table, halves
    assert torch.allclose(ours[:, order], marian, atol=1e-6)


def test_imported_marian_model_gives_the_logits_of_transformers(marian_dir):
    tokenizer, hf = _hf(marian_dir)
    config, model, ours = load_model(marian_dir)
    lines = sentences(6, seed=3)
    lines[0] = ">>fra<< " + lines[0]  # a target-language token, kept as one piece
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    to_marian = _our_id_of_each_marian_row(marian_dir)  # our id of each Marian id
    our_src = [torch.tensor(ids) for ids in ours.encode_src(lines)]
    for row, ids in zip(batch.input_ids, our_src):
        assert to_marian[row[: len(ids)]].tolist() == ids.tolist()  # same tokens, our ids
    assert ours.src_pieces(lines[0])[0] == ">>fra<<"
    src = torch.nn.utils.rnn.pad_sequence(our_src, batch_first=True, padding_value=0)
    tgt_marian = torch.tensor([[config.model.tgt_vocab_size - 2, 5, 9, 7, 0]] * len(lines))
    tgt_marian[:, 0] = hf.config.decoder_start_token_id
    tgt_ours = to_marian[tgt_marian]
    with torch.no_grad():
        theirs = hf(**batch, decoder_input_ids=tgt_marian).logits  # (batch, 5, marian vocab)
        logits = model(src, tgt_ours)  # (batch, 5, our vocab)
    kept = [i for i in range(len(to_marian)) if i != hf.config.pad_token_id]  # pad: never produced
    assert (logits[..., to_marian[kept]] - theirs[..., kept]).abs().max() < 1e-4


@pytest.mark.parametrize("beam_size", [1, 4])
def test_imported_model_translates_as_generate_does(marian_dir, beam_size):
    config, model, tokenizer = load_model(marian_dir)
    lines = sentences(24, seed=7)
    translator = Translator(PyTorchEngine(model, tokenizer, config))
    options = translator.resolve_options(beam_size=beam_size, max_len_a=0.0, max_len_b=12, length_penalty=0.0, n_best=1)
    result = translator.run(translator.request(lines, options))
    ours = result.texts
    theirs = _generate(marian_dir, lines, beam_size, 12)
    assert sum(a == b for a, b in zip(ours, theirs)) == len(lines), [(a, b) for a, b in zip(ours, theirs) if a != b]
    assert 0 < result.n_hit_max_len < len(lines)  # some end with eos before the cap, some do not


@pytest.mark.parametrize("num_beams", [1, 4])
def test_marian_to_ours_to_marian_is_the_same_function_in_our_row_order(marian_dir, tmp_path, num_beams):
    out = export_huggingface(marian_dir, tmp_path / f"again{num_beams}")
    before = safetensors.load_file(str(marian_dir / "model.safetensors"))
    after = safetensors.load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    to_ours = _our_id_of_each_marian_row(marian_dir)
    for name in before:
        if name == "model.shared.weight":  # vocabulary rows: Marian's row r is now row to_ours[r]
            assert torch.equal(before[name], after[name][to_ours])
        elif name == "final_logits_bias":
            assert torch.equal(before[name], after[name][:, to_ours])
        else:
            assert torch.equal(before[name], after[name]), name
    exported = json.loads((out / "config.json").read_text())
    assert (exported["pad_token_id"], exported["decoder_start_token_id"], exported["eos_token_id"]) == (0, 2, 3)
    lines = sentences(12, 2)
    assert _generate(out, lines, num_beams, 10) == _generate(marian_dir, lines, num_beams, 10)


def test_ours_to_marian_to_ours_keeps_every_tensor_and_translates_alike(tmp_path):
    checkpoint = write_our_checkpoint(tmp_path / "ours.pt")
    out = export_huggingface(checkpoint, tmp_path / "hf")
    config, model, tokenizer = load_model(checkpoint)
    config2, model2, tokenizer2 = load_model(out)
    original, back = model.state_dict(), model2.state_dict()
    for name in original:
        assert torch.equal(original[name], back[name]), name
    assert not torch.count_nonzero(back["output_projection.bias"])  # ours has no bias: a zero one comes back
    assert config2.decoding == config.decoding and config2.data.src_lang == "de"
    lines = sentences(20, seed=11)
    assert tokenizer2.encode_src(lines) == tokenizer.encode_src(lines)
    ours = Translator(PyTorchEngine(model, tokenizer, config))
    greedy = ours.translate(lines, beam_size=1, max_len_a=0.0, max_len_b=10, max_repeat=0)  # generate has no limit
    assert _generate(out, lines, 1, 10) == greedy  # plain transformers code on the export


def test_export_logits_equal_ours(tmp_path):
    checkpoint = write_our_checkpoint(tmp_path / "ours.pt", seed=1)
    out = export_huggingface(checkpoint, tmp_path / "hf")
    config, model, tokenizer = load_model(checkpoint)
    hf_tokenizer, hf = _hf(out)
    lines = sentences(5, seed=4)
    batch = hf_tokenizer(lines, return_tensors="pt", padding=True)
    assert [row[mask.bool()].tolist() for row, mask in zip(batch.input_ids, batch.attention_mask)] == \
        tokenizer.encode_src(lines)
    tgt = torch.tensor([[2, 7, 9, 11]] * len(lines))
    with torch.no_grad():
        assert (hf(**batch, decoder_input_ids=tgt).logits - model(batch.input_ids, tgt)).abs().max() < 1e-4
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == 2 and generation["suppress_tokens"] == [0, 2]
    assert generation["num_beams"] == config.decoding.beam_size


def test_cli_translate_and_export_of_a_marian_folder(marian_dir, tmp_path, capsys):
    lines = sentences(6, seed=9)
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    assert main(["translate", "--checkpoint", str(marian_dir), "--input", str(tmp_path / "in.txt"),
                 "--beam-size", "1", "--max-len-a", "0", "--max-len-b", "12"]) == 0
    assert capsys.readouterr().out.splitlines() == _generate(marian_dir, lines, 1, 12)
    assert main(["export", "--format", "huggingface", "--checkpoint", str(marian_dir),
                 "--output", str(tmp_path / "hf")]) == 0
    note = capsys.readouterr().out  # generate has no per-sentence cap: the export says how to give one
    assert "no cap per sentence" in note and "max_length=64 tokens; give generate max_new_tokens" in note
    assert main(["export", "--format", "huggingface", "--checkpoint", str(marian_dir),
                 "--output", str(tmp_path / "hf")]) == 2  # exists: no overwrite without --force
    assert "use --force" in capsys.readouterr().err
    assert main(["export", "--format", "huggingface", "--checkpoint", str(marian_dir),
                 "--output", str(tmp_path / "hf"), "--force"]) == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    assert main(["export", "--format", "huggingface", "--checkpoint", str(marian_dir),
                 "--output", str(tmp_path / "other"), "--force"]) == 2
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"


def test_export_refuses_what_marian_cannot_express(tmp_path, capsys):
    checkpoint = write_our_checkpoint(tmp_path / "prenorm.pt", norm_first=True)
    with pytest.raises(ExportError, match="model.norm_first"):
        export_huggingface(checkpoint, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert main(["export", "--format", "huggingface", "--checkpoint", str(checkpoint),
                 "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.norm_first" in err[0]


@pytest.mark.parametrize("field, value, message", [
    ("scale_embedding", False, "scale_embedding=False"),
    ("decoder_ffn_dim", 48, "decoder_ffn_dim=48"),
    ("activation_function", "tanh", "activation_function='tanh'"),
    ("share_encoder_decoder_embeddings", False, "share_encoder_decoder_embeddings=False"),
])
def test_import_refuses_what_our_model_cannot_express(tmp_path, field, value, message):
    folder = write_marian(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_model(folder)


def test_decoder_start_other_than_pad_is_kept(tmp_path):
    folder = write_marian(tmp_path / "m", decoder_start_is_pad=False)  # starts with >>fra<< (id 2)
    config, model, tokenizer = load_model(folder)
    marian_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert config.model.tgt_vocab_size == marian_size  # no extra row: start has its own
    lines = sentences(10, seed=5)
    ours = Translator(PyTorchEngine(model, tokenizer, config)).translate(
        lines, beam_size=1, max_len_a=0.0, max_len_b=12)
    assert ours == _generate(folder, lines, 1, 12)


@pytest.mark.slow
def test_trained_model_export_matches_on_real_sentences(trained_run, multi30k_subset, tmp_path):
    """The parity the export promises, on the small trained model: logits within 1e-4 and `generate`'s greedy text
    equal to ours on >= 99% of the test lines (each `generate` output cut at our length cap)."""
    checkpoint = trained_run / "checkpoints" / "best.pt"
    out = export_huggingface(checkpoint, tmp_path / "hf")
    translator = Translator.from_checkpoint(checkpoint)
    tokenizer, hf = _hf(out)
    lines = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().split("\n")
    lines = [line for line in lines if line][:100]
    ours = translator.translate(lines, beam_size=1, max_repeat=0)  # generate has no decoding.max_repeat
    decoding, theirs = translator.config.decoding, []
    with torch.no_grad():
        for start in range(0, len(lines), 50):
            batch = tokenizer(lines[start:start + 50], return_tensors="pt", padding=True)
            logits = hf(**batch, decoder_input_ids=torch.full((len(batch.input_ids), 3), 2)).logits
            ours_logits = translator.engine.attention_model(batch.input_ids, torch.full((len(logits), 3), 2))
            assert (logits - ours_logits).abs().max() < 1e-4
            generated = hf.generate(**batch, num_beams=1, do_sample=False)
            for row, n in zip(generated.tolist(), batch.attention_mask.sum(1).tolist()):
                cap = max_output_length(n, decoding.max_len_a, decoding.max_len_b,
                                        translator.config.model.max_positions)
                theirs.append(tokenizer.decode(row[:1 + cap], skip_special_tokens=True))
    assert sum(a == b for a, b in zip(ours, theirs)) >= 0.99 * len(lines)


def test_an_imported_marian_model_exports_to_ctranslate2_and_translates_alike(marian_dir, tmp_path):
    ct2 = pytest.importorskip("transformer.ct2")
    pytest.importorskip("ctranslate2")
    ct2.export_ctranslate2(*load_model(marian_dir), tmp_path / "ct2")
    lines = sentences(20, seed=3)
    options = dict(beam_size=1, max_len_a=0.0, max_len_b=12)
    theirs, ours = Translator.from_checkpoint(tmp_path / "ct2"), Translator.from_checkpoint(marian_dir)
    assert (theirs.engine.name, ours.engine.name) == ("ctranslate2", "pytorch")
    assert theirs.translate(lines, **options) == ours.translate(lines, **options)


def test_a_marian_tokenizer_saved_in_a_run_and_loaded_back_keeps_its_digest(marian_dir, tmp_path):
    """Fine-tuning saves the source's tokenizer in the run; --resume loads it from there: the same ids, the same
    digest (else the token cache, keyed by it, would be built again)."""
    from transformer.tokenizer import Tokenizer

    tokenizer = load_model(marian_dir)[2]
    tokenizer.save(tmp_path, "de", "en")
    again = Tokenizer.load(tmp_path, "de", "en", joint=True)
    assert again.digest() == tokenizer.digest()
    lines = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]
    assert again.encode_src(lines) == tokenizer.encode_src(lines)


def test_a_multi_target_marian_folder_gives_its_languages_to_tgt_lang(tmp_path, capsys):
    """A vocabulary with several `>>xxx<<` tokens (as opus-mt-en-ROMANCE): the import reads them as the model's
    languages; tgt_lang puts its token first, as `>>fra<<` written before the text does for `transformers`."""
    folder = write_marian(tmp_path / "mul", seed=4, languages=("fra", "deu", "cmn_Hans"))
    translator = Translator.from_checkpoint(folder)
    assert translator.languages == ["fr", "de", "cmn_Hans"]
    lines = sentences(16, seed=5)
    options = dict(beam_size=1, max_len_a=0.0, max_len_b=12, length_penalty=0.0)
    outputs = {}
    for lang, token in (("fr", ">>fra<<"), ("de", ">>deu<<"), ("cmn_Hans", ">>cmn_Hans<<")):
        outputs[lang] = translator.translate(lines, tgt_lang=lang, **options)
        assert outputs[lang] == _generate(folder, [f"{token} {line}" for line in lines], 1, 12), lang
    assert outputs["fr"] != outputs["de"]  # the token reaches the encoder
    with pytest.raises(ConfigError, match="one of fr, de, cmn_Hans"):
        translator.translate(lines[:1])
    assert main(["translate", "--checkpoint", str(folder), "--tgt-lang", "de", "--beam-size", "1", "--max-len-a", "0",
                 "--max-len-b", "12", lines[0]]) == 0
    assert capsys.readouterr().out.strip() == outputs["de"][0]
    single = write_marian(tmp_path / "one", seed=4)  # one token (>>fra<<): a bilingual model, as before
    assert Translator.from_checkpoint(single).languages == ["tgt"]


def test_a_multi_target_folder_with_two_letter_tokens_names_the_same_languages(tmp_path):
    """Older OPUS-MT vocabularies name their targets `>>de<<`, `>>fr<<` (opus-mt-en-ROMANCE): the import reads them
    as de and fr (not a bilingual model) and keeps the model's own tokens: for every language, however --tgt-lang or
    a written token names it, our source pieces are `MarianTokenizer`'s for `>>de<< text`, greedy output equals
    `generate`'s, and the export writes the same tokens back."""
    from transformer.request import make_request

    folder = write_marian(tmp_path / "two", seed=4, languages=("fr", "de", "cmn_Hans"))
    translator = Translator.from_checkpoint(folder)
    assert translator.languages == ["fr", "de", "cmn_Hans"]
    assert translator.config.data.language_tokens == {"fr": ">>fr<<", "de": ">>de<<"}  # >>cmn_Hans<< is ours
    marian = transformers.MarianTokenizer.from_pretrained(folder)
    lines = sentences(12, seed=6)
    options = dict(beam_size=1, max_len_a=0.0, max_len_b=12, length_penalty=0.0)
    for lang, token in (("fr", ">>fr<<"), ("de", ">>de<<"), ("cmn_Hans", ">>cmn_Hans<<")):
        for named in {lang, token[2:-2], {"fr": "fra", "de": "deu"}.get(lang, lang)}:  # de, deu: one language
            resolved = translator.resolve_options(tgt_lang=named)
            request = make_request(translator.tokenizer, translator.config, lines[:3], resolved)
            for line, ids in zip(lines[:3], request.ids):
                ours = [translator.tokenizer.id_to_piece(i, "src") for i in [*resolved.source_prefix, *ids]]
                assert ours + ["</s>"] == marian.tokenize(f"{token} {line}") + ["</s>"], (named, line)
        ours = translator.translate(lines, tgt_lang=lang, **options)
        assert ours == _generate(folder, [f"{token} {line}" for line in lines], 1, 12), lang
        assert translator.translate([f"{token} {line}" for line in lines], **options) == ours  # written alone
        assert translator.translate([f">>{lang}<< {line}" for line in lines], **options) == ours
    export_huggingface(folder, tmp_path / "back")
    vocab = json.loads((tmp_path / "back" / "vocab.json").read_text())
    assert {">>fr<<", ">>de<<", ">>cmn_Hans<<"} <= set(vocab) and not {">>fra<<", ">>deu<<"} & set(vocab)
    again = Translator.from_checkpoint(tmp_path / "back")
    assert again.translate(lines, tgt_lang="de", **options) == translator.translate(lines, tgt_lang="de", **options)
    assert _generate(tmp_path / "back", [f">>de<< {line}" for line in lines], 1, 12) == \
        translator.translate(lines, tgt_lang="de", **options)


def test_the_marian_tokenizer_loads_without_asking_for_sacremoses(marian_dir):
    """The hf extra installs sacremoses, whose absence MarianTokenizer warns about at every load."""
    import warnings

    from transformers import MarianTokenizer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MarianTokenizer.from_pretrained(marian_dir)
    assert not [w for w in caught if "sacremoses" in str(w.message)]


def test_a_written_token_is_read_once_per_sentence_by_the_cli_and_the_server(tmp_path, monkeypatch, capsys):
    """Lines that name their own language (`>>de<< text`) are read once each where a call enters, then chosen,
    checked and taken out from what was read (`request.read_sentences`); the translations are those of --tgt-lang."""
    import asyncio

    from transformer import request as request_module
    from transformer.serve.service import ServeLimits, TranslationService

    folder = write_marian(tmp_path / "two", seed=4, languages=("fr", "de"))
    lines = [f">>de<< {s}" for s in sentences(3, seed=8)] + [f">>fra<< {s}" for s in sentences(2, seed=9)]
    reads = []
    real = request_module.read_written
    monkeypatch.setattr(request_module, "read_written", lambda s: reads.append(s) or real(s))
    flags = ["--checkpoint", str(folder), "--beam-size", "1", "--max-len-a", "0", "--max-len-b", "12"]
    assert main(["translate", *flags, *lines]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(reads) == sorted(lines)  # each line once
    reads.clear()
    translator = Translator.from_checkpoint(folder)
    options = dict(beam_size=1, max_len_a=0.0, max_len_b=12)
    plain = [line.split(" ", 1)[1] for line in lines]
    assert out == translator.translate(plain[:3], tgt_lang="de", **options) + \
        translator.translate(plain[3:], tgt_lang="fr", **options)
    reads.clear()
    service = TranslationService(translator, limits=ServeLimits())

    async def call():
        service.start()
        try:
            return await service.translate(lines[:3], options, None)
        finally:
            await service.stop()

    assert asyncio.run(call())["translations"] == out[:3]
    assert sorted(reads) == sorted(lines[:3])
