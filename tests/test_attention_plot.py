import builtins
import json

import pytest
import torch

from tests.conftest import random_tokens, tiny_model
from transformer.attention_plot import AttentionPlotError, run
from transformer.cli import main


@pytest.fixture(scope="module")
def ckpt(trained_run):
    return str(trained_run / "checkpoints" / "best.pt")


def test_json_shapes_rows_and_causality(ckpt, tmp_path):
    out = tmp_path / "a.json"
    assert main(["attention", "--checkpoint", ckpt, "Eine Frau spielt Gitarre.", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    S, T = len(data["src_pieces"]), len(data["tgt_in_pieces"])
    assert data["src_pieces"][-1] == "</s>" and data["tgt_in_pieces"][0] == "<s>"
    assert len(data["tgt_out_pieces"]) == T and data["tgt_out_pieces"][-1] == "</s>"
    for kind, (q, k) in {"encoder_self": (S, S), "decoder_self": (T, T), "cross": (T, S)}.items():
        weights = torch.tensor(data[kind])
        assert weights.shape == (2, 4, q, k), kind  # the small model: 2 layers, 4 heads
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, q), atol=1e-5, rtol=0)
    assert (torch.tensor(data["decoder_self"]).triu(1) == 0).all()
    assert data["translation"]


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_images_are_written(ckpt, tmp_path, suffix):
    out = tmp_path / f"a.{suffix}"
    run(ckpt, "Ein Hund läuft im Park.", str(out))
    assert out.stat().st_size > 1000
    one = tmp_path / f"one.{suffix}"
    run(ckpt, "Ein Hund läuft im Park.", str(one), layer=0, head=1, kind="cross")
    assert one.stat().st_size > 500


def test_bad_requests_are_clear_errors(ckpt, tmp_path, monkeypatch):
    with pytest.raises(AttentionPlotError, match="heads 0..3"):
        run(ckpt, "Hallo", str(tmp_path / "x.png"), head=7)
    with pytest.raises(AttentionPlotError, match="suffix must be .png, .svg or .pdf"):
        run(ckpt, "Hallo", str(tmp_path / "x.bmp"))
    for empty in ("", "  "):  # nothing to show (translate gives an empty line; attention has no rows or columns)
        with pytest.raises(AttentionPlotError, match="the sentence is empty"):
            run(ckpt, empty, str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(AttentionPlotError, match="pip install"):
        run(ckpt, "Hallo", str(tmp_path / "x.png"))


def test_padded_source_positions_get_zero_weight():
    model = tiny_model()
    src = random_tokens(2, 6, 23, lengths=[6, 3])
    _, weights = model.forward_with_attention(src, random_tokens(2, 4, 29, seed=1))
    for layer in weights.encoder_self:
        assert (layer[1, :, :, 3:] == 0).all()
        torch.testing.assert_close(layer.sum(-1), torch.ones_like(layer.sum(-1)))
    for layer in weights.cross:
        assert (layer[1, :, :, 3:] == 0).all()


def test_the_translation_shown_takes_the_decoding_flags(ckpt, tmp_path, capsys):
    """`transformer attention` takes translate's decoding flags but --n-best (default: greedy); `run(options=...)`
    is what they reach: the translation shown is the one translate gives with them."""
    from transformer.translate import Translator

    sentence = "Ein Hund läuft im Park."
    translator = Translator.from_checkpoint(ckpt)
    out = tmp_path / "a.json"
    for flags, options in (([], dict(beam_size=1)), (["--beam-size", "4"], dict(beam_size=4)),
                           (["--max-len-a", "0", "--max-len-b", "2"], dict(beam_size=1, max_len_a=0.0, max_len_b=2))):
        assert main(["attention", "--checkpoint", ckpt, sentence, "--out", str(out), *flags]) == 0
        assert json.loads(out.read_text())["translation"] == translator.translate([sentence], **options)[0], flags
    assert len(translator.tokenizer.encode_tgt([json.loads(out.read_text())["translation"]])[0]) <= 2
    run(ckpt, sentence, str(out), options={"beam_size": 4})
    assert json.loads(out.read_text())["translation"] == translator.translate([sentence], beam_size=4)[0]
    with pytest.raises(SystemExit):
        main(["attention", "--checkpoint", ckpt, sentence, "--out", str(out), "--n-best", "2"])
    assert "unrecognized arguments: --n-best" in capsys.readouterr().err


def test_a_translation_cut_at_the_length_cap_is_not_labelled_with_an_eos_it_never_produced(looping_checkpoint,
                                                                                           ckpt):
    from transformer.attention_plot import CUT, attention_for, attention_options
    from transformer.translate import Translator

    translator = Translator.from_checkpoint(looping_checkpoint)
    cut = attention_for(translator, "Ein Hund läuft.", attention_options(translator, {"max_repeat": 0}))
    assert cut["tgt_out_pieces"][-1] == CUT and "</s>" not in cut["tgt_out_pieces"]
    assert len(cut["tgt_out_pieces"]) == len(cut["cross"][0][0])  # one label per row still
    trained = Translator.from_checkpoint(ckpt)
    assert attention_for(trained, "Ein Hund läuft.")["tgt_out_pieces"][-1] == "</s>"  # it ended with eos
