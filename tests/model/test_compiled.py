"""The compiled decoding step (`--compile`) against the eager decoder: same logits step by step (through buffer
growth, beam reorders, finished sentences and a single remaining sentence), same search outputs.

One compiled model (post-norm, as every recipe), shared by the tests of this module: each search compiles its own
step (greedy and beam search differ in rows per sentence), 20-40 s each on 2 cores."""

import pytest
import torch

from tests.conftest import random_tokens, tiny_model
from transformer.config import BOS_ID, EOS_ID, PAD_ID, ConfigError
from transformer.decoding import beam_search, greedy_decode
from transformer.model.compiled import CompiledDecoding, StaticDecoderCache

VOCAB = 10  # eos (1 in 10) ends hypotheses of a random model, so that searches prune finished sentences


@pytest.fixture(scope="module")
def pair():
    model = tiny_model(seed=3, tgt_vocab_size=VOCAB)
    return model, CompiledDecoding(model)


def _src(lengths, seed=0):
    src = random_tokens(len(lengths), max(lengths), 23, lengths=lengths, seed=seed)
    for i, n in enumerate(lengths):
        src[i, n - 1] = EOS_ID
    return src, src.eq(PAD_ID)


@torch.no_grad()
def test_step_logits_equal_eager_through_growth_reorders_and_one_sentence(pair):
    """Greedy's layout (one row per sentence; beam search's is covered by the search test below)."""
    model, compiled = pair
    src, mask = _src([6, 4, 5, 2])
    memory = model.encode(src, mask)
    eager_cache, static_cache = model.new_cache(), compiled.new_cache()
    assert isinstance(static_cache, StaticDecoderCache)
    rows, steps = 4, 45  # beyond CompiledDecoding.INITIAL_CAPACITY: the buffers grow once
    assert steps > CompiledDecoding.INITIAL_CAPACITY
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == 10:  # rows reordered and one repeated, the memory with them
            index = torch.tensor([1, 0, 3, 3])
            eager_cache.select(index, index)
            static_cache.select(index, index)
            memory, mask = memory[index], mask[index]
        if step == 20:  # two sentences finished and left
            index = torch.tensor([0, 2])
            eager_cache.select(index, index)
            static_cache.select(index, index)
            memory, mask, rows = memory[index], mask[index], 2
        if step == 30:  # one sentence left
            index = torch.tensor([1])
            eager_cache.select(index, index)
            static_cache.select(index, index)
            memory, mask, rows = memory[index], mask[index], 1
        tokens = torch.full((rows, 1), BOS_ID) if step == 0 else torch.randint(3, VOCAB, (rows, 1), generator=g)
        expected = model.decode(tokens, memory, mask, cache=eager_cache)
        got = compiled.decode(tokens, memory, mask, cache=static_cache)
        assert got.shape == expected.shape == (rows, 1, VOCAB)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    assert static_cache.capacity == 2 * CompiledDecoding.INITIAL_CAPACITY


@torch.no_grad()
def test_positions_not_decoded_yet_are_never_read_from_uninitialized_memory(pair, monkeypatch):
    """The step reads at least two positions, the second not decoded at the first two steps (masked: zeros there,
    since NaN + -inf is NaN). Every buffer comes from `new_empty` filled with NaN here, as freed memory can be:
    after the first step, a reorder at one decoded position, and growth (capacity 2, then 4 and 8)."""
    model, compiled = pair
    monkeypatch.setattr(CompiledDecoding, "INITIAL_CAPACITY", 2)
    new_empty = torch.Tensor.new_empty

    def nan_filled(self, *args, **kwargs):  # PyTorch's own calls while it compiles are left alone
        empty = new_empty(self, *args, **kwargs)
        return empty if torch.compiler.is_compiling() else empty.fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", nan_filled)
    src, mask = _src([5, 3, 4])
    memory = model.encode(src, mask)
    eager_cache, static_cache = model.new_cache(), compiled.new_cache()
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        if step == 1:
            index = torch.tensor([2, 0, 0])
            eager_cache.select(index, index)
            static_cache.select(index, index)
            memory, mask = memory[index], mask[index]
        tokens = torch.full((3, 1), BOS_ID) if step == 0 else torch.randint(3, VOCAB, (3, 1), generator=g)
        expected = model.decode(tokens, memory, mask, cache=eager_cache)
        got = compiled.decode(tokens, memory, mask, cache=static_cache)
        assert torch.isfinite(got).all(), f"step {step}"
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    assert static_cache.capacity == 8


@torch.no_grad()
def test_searches_give_the_eager_outputs(pair):
    model, compiled = pair
    src, mask = _src([7, 3, 5, 1, 6])
    for s, m in ((src, mask), (src[:1, :7], mask[:1, :7])):  # a batch, and one sentence alone
        expected = greedy_decode(model, s, m, max_len_a=1.0, max_len_b=8)
        got = greedy_decode(compiled, s, m, max_len_a=1.0, max_len_b=8)
        assert [(h.tokens, h.finished) for h in got] == [(h.tokens, h.finished) for h in expected]
        assert [h.score for h in got] == pytest.approx([h.score for h in expected], abs=1e-4)
        expected = beam_search(model, s, m, beam_size=3, n_best=3, max_len_a=1.0, max_len_b=8)
        got = beam_search(compiled, s, m, beam_size=3, n_best=3, max_len_a=1.0, max_len_b=8)
        assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
        assert ([h.score for hyps in got for h in hyps]
                == pytest.approx([h.score for hyps in expected for h in hyps], abs=1e-4))
    assert any(h.finished for h in greedy_decode(compiled, src, mask, max_len_b=8))  # some sentences ended early


@torch.no_grad()
def test_a_row_of_padding_only_attends_to_nothing_as_in_the_eager_decoder(pair):
    model, compiled = pair
    src, mask = _src([4, 3])
    memory = model.encode(src, mask)
    mask = mask.clone()
    mask[1] = True  # the second sentence's memory is all padding
    tokens = torch.full((2, 1), BOS_ID)
    expected = model.decode(tokens, memory, mask, cache=model.new_cache())
    got = compiled.decode(tokens, memory, mask, cache=compiled.new_cache())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_refuses_what_it_cannot_compile():
    model = tiny_model()
    with pytest.raises(ValueError, match="eval mode"):
        CompiledDecoding(model.train())
    compiled = CompiledDecoding(model.eval())
    src, mask = _src([3])
    with pytest.raises(ValueError, match="one new position"):
        compiled.decode(torch.full((1, 2), BOS_ID), model.encode(src, mask), mask, cache=compiled.new_cache())


def test_translator_refuses_compile_with_int8_or_workers(trained_run):
    from transformer.translate import Translator
    checkpoint = str(trained_run / "checkpoints" / "best.pt")
    with pytest.raises(ConfigError, match="--compile.*int8"):
        Translator.from_checkpoint(checkpoint, quantization="int8", compile=True)
    with pytest.raises(ConfigError, match="--compile.*--workers 2"):
        Translator.from_checkpoint(checkpoint, workers=2, compile=True)
