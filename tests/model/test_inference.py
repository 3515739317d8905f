"""The CPU decoding copy (`model/inference.py`): float32 weight layout and int8 dynamic quantization."""

import gzip

import pytest
import sacrebleu
import torch
from torch import nn

from tests.conftest import random_tokens, tiny_model
from transformer import Transformer, Translator
from transformer.cli import main
from transformer.config import ConfigError
from transformer.data import make_batch
from transformer.decoding import beam_search, greedy_decode
from transformer.model import MultiHeadAttention
from transformer.model.inference import PackedLinear, for_cpu_decoding


def _inputs(model, batch=3, src_len=9, tgt_len=7):
    src = random_tokens(batch, src_len, model.config.src_vocab_size, lengths=[9, 5, 7])
    tgt = random_tokens(batch, tgt_len, model.config.tgt_vocab_size, seed=1)
    tgt[:, 0] = 1
    return src, tgt


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "column-major"])
def test_float32_copy_computes_the_same_logits_and_leaves_the_model_alone(model, onednn, monkeypatch):
    if onednn and not PackedLinear.is_available():
        pytest.skip("this PyTorch build has no oneDNN linear ops")
    if not onednn:
        monkeypatch.setattr(PackedLinear, "is_available", staticmethod(lambda: False))
    src, tgt = _inputs(model)
    before = {name: (p.detach().clone(), p.stride()) for name, p in model.named_parameters()}
    fast = for_cpu_decoding(model)
    with torch.no_grad():
        torch.testing.assert_close(fast(src, tgt), model(src, tgt), atol=1e-5, rtol=1e-5)
        memory = fast.encode(src, src.eq(0))
        cache, steps = fast.new_cache(), []
        for t in range(tgt.size(1)):
            steps.append(fast.decode(tgt[:, t:t + 1], memory, src.eq(0), cache=cache))
        torch.testing.assert_close(torch.cat(steps, 1), model(src, tgt), atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():  # the original is neither changed nor re-laid out
        assert torch.equal(p, before[name][0]) and p.stride() == before[name][1], name
    linear = fast.decoder.layers[0].feed_forward.linear1
    assert linear.weight.shape == model.decoder.layers[0].feed_forward.linear1.weight.shape
    assert linear.weight.t().is_contiguous()  # column-major: sgemm gets x and Wᵀ as plain row-major operands
    assert fast.decoder.layers[0].cross_attn.kv_proj.weight.t().is_contiguous()
    if onednn:  # the output projection alone runs on oneDNN's prepacked weight (a copy of the tied embedding)
        assert isinstance(fast.output_projection, PackedLinear)
        assert [m for m in fast.modules() if isinstance(m, PackedLinear)] == [fast.output_projection]
        assert fast.decoder.embedding.embedding.weight.is_contiguous()
    else:
        assert fast.output_projection.weight is fast.decoder.embedding.embedding.weight
        assert fast.output_projection.weight.t().is_contiguous()


def test_split_projections_give_the_same_attention():
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4).eval()
    query, memory = torch.randn(2, 3, 32), torch.randn(2, 5, 32)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    values = torch.randn(2, 5, 32)
    expected, _ = attn(query, memory, memory, key_padding_mask=padding)
    expected_kv, _ = attn(query, memory, values, key_padding_mask=padding)  # separate keys and values
    expected_self, _ = attn(query, query, query)
    attn.split_projections()
    got, _ = attn(query, memory, memory, key_padding_mask=padding)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(attn(query, memory, values, key_padding_mask=padding)[0], expected_kv,
                               atol=1e-6, rtol=1e-6)
    assert attn.q_proj is not None and attn.kv_proj.out_features == 64
    torch.testing.assert_close(attn(query, query, query)[0], expected_self)  # self-attention keeps in_proj


def test_int8_replaces_every_linear_layer_and_stays_close(model):
    quantized = for_cpu_decoding(model, "int8")
    assert not [m for m in quantized.modules() if type(m) is nn.Linear]  # every linear layer is quantized
    assert type(quantized.output_projection).__name__ == "Linear" and quantized.output_projection.__module__ \
        .startswith("torch.ao.nn.quantized.dynamic")
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))  # original untouched
    src, tgt = _inputs(model)
    with torch.no_grad():
        exact, approx = model(src, tgt).log_softmax(-1), quantized(src, tgt).log_softmax(-1)
    assert not torch.equal(exact, approx)  # it really computes in int8
    assert (exact.exp() - approx.exp()).abs().max() < 0.05  # probabilities within a few hundredths


def test_int8_decoding_properties(model):
    """Beam 1 equals greedy, and the cache changes nothing, with quantized layers too."""
    quantized = for_cpu_decoding(model, "int8")
    src = random_tokens(4, 8, model.config.src_vocab_size, lengths=[8, 3, 6, 5])
    mask = src.eq(0)
    greedy = greedy_decode(quantized, src, mask, 0.0, 12)
    beam1 = [hyps[0] for hyps in beam_search(quantized, src, mask, 1, 0.0, 1, 0.0, 12)]
    assert [h.tokens for h in greedy] == [h.tokens for h in beam1]
    assert [h.score for h in greedy] == pytest.approx([h.score for h in beam1], abs=1e-4)
    uncached = greedy_decode(quantized, src, mask, 0.0, 12, use_cache=False)
    assert [h.tokens for h in greedy] == [h.tokens for h in uncached]


def test_bad_quantization_and_device_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="quantization must be None or 'int8', got 'int4'"):
        for_cpu_decoding(model, "int4")
    with pytest.raises(ValueError, match="is on meta, not on the CPU"):
        for_cpu_decoding(tiny_model().to("meta"))
    with pytest.raises(ValueError, match="already a decoding copy"):
        for_cpu_decoding(for_cpu_decoding(model, "int8"))


@pytest.fixture(scope="module")
def translators(trained_run):
    path = trained_run / "checkpoints" / "best.pt"
    return Translator.from_checkpoint(path), Translator.from_checkpoint(path, quantization="int8")


def test_int8_translations_close_to_float32(translators, multi30k_subset):
    """On the trained model: int8 predicts the same next token as float32 at >= 95% of the reference positions
    (teacher-forced), and greedy and beam BLEU stay within a point. (Whole greedy sentences are not compared: this
    briefly trained model loops, and a loop flips on a small change.)"""
    fp32, int8 = translators
    assert int8.quantization == "int8" and fp32.quantization is None
    trained = Transformer(fp32.model.config).num_parameters()
    assert int8.num_parameters == fp32.num_parameters == trained
    assert int8.model.num_parameters() < trained  # quantized (and oneDNN) layers hold packed weights instead
    src = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt").read().split("\n")[:100]
    ref = gzip.open(multi30k_subset / "test_2016_flickr.en.gz", "rt").read().split("\n")[:100]
    batch = make_batch(fp32.tokenizer.encode_src(src), fp32.tokenizer.encode_tgt(ref))
    with torch.no_grad():
        predicted = [m(batch.src, batch.tgt_in, batch.src_key_padding_mask).argmax(-1)
                     for m in (fp32.model, int8.model)]
    real = batch.tgt_out.ne(0)
    agreement = (predicted[0].eq(predicted[1]) & real).sum() / real.sum()
    assert agreement >= 0.95, agreement
    for beam_size in (1, 4):
        a, b = fp32.translate(src, beam_size=beam_size), int8.translate(src, beam_size=beam_size)
        bleu_a, bleu_b = (sacrebleu.corpus_bleu(h, [ref]).score for h in (a, b))
        assert abs(bleu_a - bleu_b) <= 1.0, (beam_size, bleu_a, bleu_b)


def test_translator_refuses_unknown_quantization(translators):
    fp32, _ = translators
    with pytest.raises(ConfigError, match="quantization must be None or 'int8', got 'float16'"):
        Translator(fp32.model, fp32.tokenizer, fp32.config, quantization="float16")


def test_cli_quantization_flag(trained_run, capsys):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    assert main(["translate", "--checkpoint", ckpt, "--quantization", "int8", "--beam-size", "4",
                 "Ein Mann fährt Fahrrad.", "", "Zwei Hunde spielen im Schnee."]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] and lines[1] == "" and lines[2]
    assert main(["evaluate", "--checkpoint", ckpt, "--quantization", "int8", "--split", "test",
                 "--beam-size", "1"]) == 0
    assert "BLEU = " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["translate", "--checkpoint", ckpt, "--quantization", "int4", "x"])
