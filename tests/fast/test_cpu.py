"""`CPUDecoder` (`transformer/fast/cpu.py`, `layout.py`, `cache.py`) against the readable model: the same logits at
every step (through beam reorders, sentences leaving and a source of padding only), the weight layouts, int8."""

import gzip

import pytest
import sacrebleu
import torch
from torch import nn

from tests.conftest import random_tokens, search_options, tiny_model
from tests.fast.steps import BEAM_SCHEDULE, GREEDY_SCHEDULE, compare_steps, sources
from transformer import Transformer, Translator
from transformer.cli import main
from transformer.config import OptionError
from transformer.data import make_batch
from transformer.decoding.beam import beam_search
from transformer.decoding.greedy import greedy_decode
from transformer.engines import PyTorchEngine
from transformer.fast import CPUDecoder, decoder_for
from transformer.fast.cache import GrowingKVCache
from transformer.fast.cpu import cached_attention
from transformer.fast.layout import PackedLinear
from transformer.model.attention import causal_mask, scaled_dot_product_attention


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "column-major"])
def test_float32_decoder_gives_the_readable_logits_and_leaves_the_model_alone(model, onednn, monkeypatch):
    if onednn and not PackedLinear.is_available():
        pytest.skip("this PyTorch build has no oneDNN linear ops")
    if not onednn:
        monkeypatch.setattr(PackedLinear, "is_available", staticmethod(lambda: False))
    before = {name: (p.detach().clone(), p.stride()) for name, p in model.named_parameters()}
    decoder = CPUDecoder(model)
    src, mask = sources([7, 4, 5])
    assert compare_steps(model, decoder, src, mask, 2, BEAM_SCHEDULE, 12) == 12
    assert compare_steps(model, decoder, src, mask, 1, GREEDY_SCHEDULE, 12) == 12
    for name, p in model.named_parameters():  # the original is neither changed nor re-laid out
        assert torch.equal(p, before[name][0]) and p.stride() == before[name][1], name
    layer = decoder.layers[0]
    assert layer.feed_forward.linear1.weight.t().is_contiguous()  # column-major: sgemm gets plain operands
    assert layer.cross_kv.weight.t().is_contiguous() and layer.cross_kv.out_features == 2 * model.config.d_model
    if onednn:  # the output projection alone runs on oneDNN's prepacked weight (a copy of the tied embedding)
        assert isinstance(decoder.output_projection, PackedLinear)
        assert [m for m in decoder.modules() if isinstance(m, PackedLinear)] == [decoder.output_projection]
        assert decoder.embedding.embedding.weight.is_contiguous()
    else:
        assert decoder.output_projection.weight is decoder.embedding.embedding.weight
        assert decoder.output_projection.weight.t().is_contiguous()


def test_a_source_of_padding_only_attends_to_nothing_as_in_the_readable_model():
    model = tiny_model(seed=2)
    src, mask = sources([5, 3, 4])
    mask = mask.clone()
    mask[1] = True  # the second sentence's memory is all padding: no additive bias can express it
    assert compare_steps(model, CPUDecoder(model), src, mask, 2, BEAM_SCHEDULE, 8) == 8


def test_searches_give_the_readable_outputs(model):
    decoder = CPUDecoder(model)
    src, mask = sources([7, 3, 5, 1, 6])
    for s, m in ((src, mask), (src[:1, :7], mask[:1, :7])):  # a batch, and one sentence alone
        greedy = search_options(max_len_a=1.0, max_len_b=8)
        expected, got = (greedy_decode(d, s, m, greedy) for d in (model, decoder))
        assert [(h.tokens, h.finished) for h in got] == [(h.tokens, h.finished) for h in expected]
        assert [h.score for h in got] == pytest.approx([h.score for h in expected], abs=1e-4)
        expected, got = (beam_search(d, s, m, search_options(beam_size=3, n_best=3, max_len_b=8))
                         for d in (model, decoder))
        assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
        assert ([h.score for hyps in got for h in hyps]
                == pytest.approx([h.score for hyps in expected for h in hyps], abs=1e-4))


def test_growing_cache_appends_and_selects_like_concatenation():
    """The preallocated cache holds what torch.cat and index_select would, across growth and beam reordering."""
    g = torch.Generator().manual_seed(0)
    cache, keys, values = GrowingKVCache(), None, None
    for step in range(40):  # past the first capacity (16) and its doubling (32)
        batch = 6 if step < 25 else 4
        if step == 25:  # two rows leave, the rest are reordered
            index = torch.tensor([5, 0, 2, 2])
            cache.select(index)
            keys, values = keys.index_select(0, index), values.index_select(0, index)
        elif step % 3 == 0 and keys is not None:  # beams reordered within the batch
            index = torch.randperm(batch, generator=g)
            cache.select(index)
            keys, values = keys.index_select(0, index), values.index_select(0, index)
        new_len = 2 if step == 0 else 1
        k, v = torch.randn(batch, 2, new_len, 8, generator=g), torch.randn(batch, 2, new_len, 8, generator=g)
        keys = k if keys is None else torch.cat([keys, k], dim=2)
        values = v if values is None else torch.cat([values, v], dim=2)
        got_k, got_v = cache.append(k, v)
        assert torch.equal(got_k, keys) and torch.equal(got_v, values), step
    assert keys.shape == (4, 2, 41, 8)


def test_cached_attention_equals_the_explicit_path():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 4, n, 8, generator=g) for n in (2, 6, 6))
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 2 + [True] * 4])
    bias = torch.zeros(3, 6).masked_fill(padding, float("-inf"))[:, None, None, :].expand(-1, 4, 1, -1)
    expected, _ = scaled_dot_product_attention(q, k, v, ~padding[:, None, None, :])
    got = cached_attention(q, k, v, bias.contiguous())
    torch.testing.assert_close(got, expected.transpose(1, 2).reshape(3, 2, 32), atol=1e-6, rtol=1e-6)
    causal_free, _ = scaled_dot_product_attention(q[:, :, -1:], k, v, ~causal_mask(1, 6)[None, None])
    got = cached_attention(q[:, :, -1:], k, v, None)
    torch.testing.assert_close(got, causal_free.transpose(1, 2).reshape(3, 1, 32))


def test_int8_replaces_every_linear_layer_and_stays_close(model):
    quantized = CPUDecoder(model, "int8")
    assert not quantized.is_float and not [m for m in quantized.modules() if type(m) is nn.Linear]
    assert quantized.output_projection.__module__.startswith("torch.ao.nn.quantized.dynamic")
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))  # original untouched
    src, mask = sources([7, 4, 5])
    memory = model.encode(src, mask)
    with torch.no_grad():
        exact = model.decode_step(torch.full((3,), 1), model.new_cache(memory, mask)).log_softmax(-1)
        approx = quantized.decode_step(torch.full((3,), 1), quantized.new_cache(quantized.encode(src, mask), mask))
    approx = approx.log_softmax(-1)
    assert not torch.equal(exact, approx)  # it really computes in int8
    assert (exact.exp() - approx.exp()).abs().max() < 0.05  # probabilities within a few hundredths


def test_int8_beam_1_equals_greedy(model):
    quantized = CPUDecoder(model, "int8")
    src = random_tokens(4, 8, model.config.src_vocab_size, lengths=[8, 3, 6, 5])
    mask = src.eq(0)
    greedy = greedy_decode(quantized, src, mask, search_options(max_len_a=0.0, max_len_b=12))
    beam1 = [hyps[0] for hyps in beam_search(quantized, src, mask, search_options(beam_size=1, length_penalty=0.0,
                                                                                  n_best=1, max_len_a=0.0,
                                                                                  max_len_b=12))]
    assert [h.tokens for h in greedy] == [h.tokens for h in beam1]
    assert [h.score for h in greedy] == pytest.approx([h.score for h in beam1], abs=1e-4)


def test_refusals_name_the_parameters():
    model = tiny_model()
    with pytest.raises(OptionError, match="quantization='int4': expected None or 'int8'"):
        CPUDecoder(model, "int4")
    with pytest.raises(ValueError, match="is on meta, not on the CPU"):
        CPUDecoder(tiny_model().to("meta"))
    with pytest.raises(OptionError, match="compile=True works on float32 models, not with quantization='int8'"):
        decoder_for(model, "int8", compile=True)
    elsewhere = tiny_model().to("meta")
    assert decoder_for(elsewhere) is elsewhere  # elsewhere than the CPU: the readable model itself
    with pytest.raises(OptionError, match="quantization='int8' decodes on the CPU only, not on meta"):
        decoder_for(elsewhere, "int8")
    with pytest.raises(OptionError, match="compile=True decodes on the CPU only"):
        decoder_for(elsewhere, compile=True)


@pytest.fixture(scope="module")
def translators(trained_run):
    path = trained_run / "checkpoints" / "best.pt"
    return Translator.from_checkpoint(path), Translator.from_checkpoint(path, quantization="int8")


def test_int8_translations_close_to_float32(translators, multi30k_subset):
    """On the trained model: int8 predicts the same next token as float32 at >= 95% of the reference positions
    (each position decoded after the reference prefix), and greedy and beam BLEU stay within a point. (Whole greedy
    sentences are not compared: this briefly trained model loops, and a loop flips on a small change.)"""
    fp32, int8 = translators
    assert int8.engine.quantization == "int8" and fp32.engine.quantization is None
    assert (int8.engine.parameters == fp32.engine.parameters
            == Transformer(fp32.engine.attention_model.config).num_parameters())
    src = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt").read().split("\n")[:100]
    ref = gzip.open(multi30k_subset / "test_2016_flickr.en.gz", "rt").read().split("\n")[:100]
    batch = make_batch(fp32.tokenizer.encode_src(src), fp32.tokenizer.encode_tgt(ref))
    predicted = []
    with torch.no_grad():
        for decoder in (fp32.engine.decoder, int8.engine.decoder):
            cache = decoder.new_cache(decoder.encode(batch.src, batch.src_key_padding_mask), batch.src_key_padding_mask)
            predicted.append(torch.stack([decoder.decode_step(batch.tgt_in[:, t], cache).argmax(-1)
                                          for t in range(batch.tgt_in.size(1))], dim=1))
    real = batch.tgt_out.ne(0)
    agreement = (predicted[0].eq(predicted[1]) & real).sum() / real.sum()
    assert agreement >= 0.95, agreement
    for beam_size in (1, 4):
        a, b = fp32.translate(src, beam_size=beam_size), int8.translate(src, beam_size=beam_size)
        bleu_a, bleu_b = (sacrebleu.corpus_bleu(h, [ref]).score for h in (a, b))
        assert abs(bleu_a - bleu_b) <= 1.0, (beam_size, bleu_a, bleu_b)


def test_translator_refuses_unknown_quantization(translators):
    fp32, _ = translators
    with pytest.raises(OptionError, match="quantization='float16': expected None or 'int8'"):
        PyTorchEngine(fp32.engine.attention_model, fp32.tokenizer, fp32.config, quantization="float16")


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
