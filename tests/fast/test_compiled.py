"""The compiled decoding step (`--compile`) against the readable model: same logits step by step (through buffer
growth, beam reorders, finished sentences and a single remaining sentence), same search outputs.

One compiled decoder (post-norm, as every recipe), shared by the tests of this module: each search compiles its
own step (greedy and beam search differ in rows per sentence)."""

import pytest
import torch

from tests.conftest import search_options, tiny_model
from tests.fast.steps import BEAM_SCHEDULE, compare_steps, sources
from transformer.config import OptionError
from transformer.decoding.beam import beam_search
from transformer.decoding.greedy import greedy_decode
from transformer.fast import CompiledDecoder, CPUDecoder
from transformer.fast.compiled import StaticDecoderCache

pytestmark = pytest.mark.slow  # each search compiles once for the module

VOCAB = 10  # eos (1 in 10) ends hypotheses of a random model, so that searches prune finished sentences
# Greedy's layout (one row per sentence), past the first capacity: rows reordered and one repeated, two sentences
# leaving, one left (held twice in the buffers).
SCHEDULE = {10: ([1, 0, 3, 3], [1, 0, 3, 3]), 20: ([0, 2], [0, 2]), 30: ([1], [1])}


@pytest.fixture(scope="module")
def pair():
    model = tiny_model(seed=3, tgt_vocab_size=VOCAB)
    return model, CompiledDecoder(CPUDecoder(model))


def test_step_logits_equal_the_readable_model_through_growth_reorders_and_one_sentence(pair):
    model, compiled = pair
    src, mask = sources([6, 4, 5, 2])
    steps = 45  # beyond CompiledDecoder.INITIAL_CAPACITY: the buffers grow once
    assert steps > CompiledDecoder.INITIAL_CAPACITY
    assert compare_steps(model, compiled, src, mask, 1, SCHEDULE, steps, atol=1e-4) == steps
    cache = compiled.new_cache(model.encode(src, mask), mask)
    assert isinstance(cache, StaticDecoderCache) and cache.capacity == CompiledDecoder.INITIAL_CAPACITY


def test_beam_layout_logits_equal_the_readable_model(pair):
    model, compiled = pair
    src, mask = sources([6, 4, 5])
    assert compare_steps(model, compiled, src, mask, 2, BEAM_SCHEDULE, 12, atol=1e-4) == 12


def test_positions_not_decoded_yet_are_never_read_from_uninitialized_memory(pair, monkeypatch):
    """The step reads at least two positions, the second not decoded at the first two steps (masked: zeros there,
    since NaN + -inf is NaN). Every buffer comes from `new_empty` filled with NaN here, as freed memory can be:
    after the first step, a reorder at one decoded position, and growth (capacity 2, then 4 and 8)."""
    model, compiled = pair
    monkeypatch.setattr(CompiledDecoder, "INITIAL_CAPACITY", 2)
    new_empty = torch.Tensor.new_empty

    def nan_filled(self, *args, **kwargs):  # PyTorch's own calls while it compiles are left alone
        empty = new_empty(self, *args, **kwargs)
        return empty if torch.compiler.is_compiling() else empty.fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", nan_filled)
    src, mask = sources([5, 3, 4])
    assert compare_steps(model, compiled, src, mask, 1, {1: ([2, 0, 0], [2, 0, 0])}, 6, atol=1e-4) == 6
    cache = compiled.new_cache(model.encode(src, mask), mask)
    for _ in range(5):
        compiled.decode_step(torch.full((3,), 5), cache)
    assert cache.capacity == 8


@torch.no_grad()
def test_searches_give_the_readable_outputs(pair):
    model, compiled = pair
    src, mask = sources([7, 3, 5, 1, 6])
    for s, m in ((src, mask), (src[:1, :7], mask[:1, :7])):  # a batch, and one sentence alone
        expected = greedy_decode(model, s, m, search_options(max_len_a=1.0, max_len_b=8))
        got = greedy_decode(compiled, s, m, search_options(max_len_a=1.0, max_len_b=8))
        assert [(h.tokens, h.finished) for h in got] == [(h.tokens, h.finished) for h in expected]
        assert [h.score for h in got] == pytest.approx([h.score for h in expected], abs=1e-4)
        expected = beam_search(model, s, m, search_options(beam_size=3, n_best=3, max_len_a=1.0, max_len_b=8))
        got = beam_search(compiled, s, m, search_options(beam_size=3, n_best=3, max_len_a=1.0, max_len_b=8))
        assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
        assert ([h.score for hyps in got for h in hyps]
                == pytest.approx([h.score for hyps in expected for h in hyps], abs=1e-4))
    ended = greedy_decode(compiled, src, mask, search_options(max_len_b=8))
    assert any(h.finished for h in ended)  # some sentences ended early


def test_a_row_of_padding_only_attends_to_nothing_as_in_the_readable_model(pair):
    model, compiled = pair
    src, mask = sources([4, 3])
    mask = mask.clone()
    mask[1] = True  # the second sentence's memory is all padding
    assert compare_steps(model, compiled, src, mask, 1, {}, 3, atol=1e-4) == 3


def test_refuses_int8():
    with pytest.raises(OptionError, match="compile=True works on float32 models, not with quantization='int8'"):
        CompiledDecoder(CPUDecoder(tiny_model(), "int8"))


def test_translator_refuses_compile_with_int8_or_workers(trained_run):
    from transformer.translate import Translator
    checkpoint = str(trained_run / "checkpoints" / "best.pt")
    with pytest.raises(OptionError, match="compile=True works on float32 models, not with quantization='int8'") as err:
        Translator.from_checkpoint(checkpoint, quantization="int8", compile=True)
    assert err.value.as_flags() == "--compile works on float32 models, not with --quantization int8"
    with pytest.raises(OptionError, match="compile=True decodes with one worker") as err:
        Translator.from_checkpoint(checkpoint, workers=2, compile=True)
    assert err.value.as_flags() == "--compile decodes with one worker (on every thread), not --workers 2"
