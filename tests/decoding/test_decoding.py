"""Greedy and beam search: equalities that must hold exactly, and the score they report."""

import itertools
import math

import pytest
import torch

from tests.conftest import random_tokens, search_options, tiny_model
from transformer.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer.decoding import gnmt_length_penalty
from transformer.decoding.beam import beam_search
from transformer.decoding.greedy import greedy_decode

VOCAB = 10  # small, so that eos (1 in 10) ends hypotheses of a random model


@pytest.fixture
def model():
    return tiny_model(seed=3, tgt_vocab_size=VOCAB)


def _src(batch=5, seed=0):
    lengths = [7, 3, 5, 1, 6][:batch]
    src = random_tokens(batch, max(lengths), 23, lengths=lengths, seed=seed)
    for i, n in enumerate(lengths):
        src[i, n - 1] = EOS_ID
    return src, src.eq(PAD_ID)


@torch.no_grad()
def forced_score(model, src_row, tokens, finished, alpha):
    """Sum of log-probabilities of `tokens` (+ eos if finished) under the model, over the length penalty."""
    src = src_row[src_row.ne(PAD_ID)][None]
    target = tokens + ([EOS_ID] if finished else [])
    tgt_in = torch.tensor([[BOS_ID] + target[:-1]])
    lprobs = model(src, tgt_in).log_softmax(-1)[0]
    total = sum(lprobs[t, tok].item() for t, tok in enumerate(target))
    return total / gnmt_length_penalty(len(target), alpha)


def test_beam_size_one_equals_greedy(model):
    src, mask = _src()
    greedy = greedy_decode(model, src, mask, search_options(max_len_a=1.0, max_len_b=6))
    beam = beam_search(model, src, mask, search_options(beam_size=1, length_penalty=0.0, max_len_a=1.0, max_len_b=6))
    assert [h.tokens for h in greedy] == [b[0].tokens for b in beam]
    assert [h.finished for h in greedy] == [b[0].finished for b in beam]
    for g, (b,) in zip(greedy, beam):
        assert b.score == pytest.approx(g.score, abs=1e-5)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_batch_decodes_like_each_sentence_alone(model, beam_size):
    src, mask = _src()
    options = search_options(beam_size=beam_size, n_best=beam_size, max_len_b=8)
    batch = beam_search(model, src, mask, options)
    greedy = greedy_decode(model, src, mask, options)
    for i in range(src.size(0)):
        row = src[i:i + 1, : int((~mask[i]).sum())]
        alone = beam_search(model, row, row.eq(PAD_ID), options)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batch[i]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in batch[i]], abs=1e-5)
        assert greedy_decode(model, row, row.eq(PAD_ID), options)[0].tokens == greedy[i].tokens


@pytest.mark.parametrize("min_len", [0, 3])
def test_greedy_without_scores_picks_the_same_tokens(model, min_len):
    """scores=False takes the argmax of the logits (no log-softmax): the same outputs, NaN scores."""
    src, mask = _src()
    options = search_options(max_len_b=8, min_len=min_len)
    with_scores = greedy_decode(model, src, mask, options)
    without = greedy_decode(model, src, mask, options, scores=False)
    assert [(h.tokens, h.finished) for h in without] == [(h.tokens, h.finished) for h in with_scores]
    assert all(math.isnan(h.score) for h in without)
    assert all(math.isfinite(h.score) and h.score < 0 for h in with_scores)
    if min_len:
        assert all(len(h.tokens) >= min_len for h in without)


def test_greedy_picks_the_argmax_of_the_full_forward_pass_at_every_position(model):
    """Decoding on the cache, one position per step, agrees with the model's teacher-forced forward pass over the
    whole output: each token is that pass's most probable one (pad and bos excluded), and the score its sum."""
    src, mask = _src()
    hyps = greedy_decode(model, src, mask, search_options(max_len_b=8))
    assert any(h.finished for h in hyps) and any(len(h.tokens) > 2 for h in hyps)
    for i, h in enumerate(hyps):
        target = h.tokens + ([EOS_ID] if h.finished else [])
        row = src[i:i + 1, : int((~mask[i]).sum())]
        with torch.no_grad():
            logits = model(row, torch.tensor([[BOS_ID] + target[:-1]]))[0]
        logits[:, [PAD_ID, BOS_ID]] = float("-inf")
        assert logits.argmax(-1).tolist() == target
        assert h.score == pytest.approx(forced_score(model, src[i], h.tokens, h.finished, 0.0), abs=1e-4)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_wide_beam_finds_the_exhaustive_best(alpha):
    """Vocabulary {pad, unk, bos, eos, a, b}: at most 3 steps (eos included), so every finished output is
    0-2 tokens from {unk, a, b} then eos. A beam of 18 holds every prefix; it must find the exhaustive best."""
    model = tiny_model(seed=7, tgt_vocab_size=6)
    src = torch.tensor([[5, 9, 4, EOS_ID]])
    best = max((forced_score(model, src[0], list(seq), True, alpha), list(seq))
               for n in range(3) for seq in itertools.product([UNK_ID, 4, 5], repeat=n))
    found = beam_search(model, src, src.eq(PAD_ID), search_options(beam_size=18, length_penalty=alpha, max_len_a=0.0,
                                                                   max_len_b=3))[0][0]
    assert found.finished and found.tokens == best[1]
    assert found.score == pytest.approx(best[0], abs=1e-5)


def test_reported_scores_equal_forced_decoding_and_n_best_is_sorted(model):
    src, mask = _src()
    results = beam_search(model, src, mask, search_options(beam_size=5, n_best=5, length_penalty=0.6, max_len_b=8))
    one_best = beam_search(model, src, mask, search_options(beam_size=5, n_best=1, length_penalty=0.6, max_len_b=8))
    for i, hyps in enumerate(results):
        assert len(hyps) == 5
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert hyps[0].tokens == one_best[i][0].tokens
        for h in hyps:
            assert EOS_ID not in h.tokens and PAD_ID not in h.tokens and BOS_ID not in h.tokens
            assert h.score == pytest.approx(forced_score(model, src[i], h.tokens, h.finished, 0.6), abs=1e-4)


def test_length_cap_gives_unfinished_fallbacks(model):
    src = random_tokens(1, 26, 23)
    src[0, -1] = EOS_ID
    hyps = beam_search(model, src, src.eq(PAD_ID), search_options(beam_size=5, n_best=5, max_len_a=0.0, max_len_b=4,
                                                                  min_len=4))
    assert len(hyps[0]) == 5
    for h in hyps[0]:
        assert not h.finished and len(h.tokens) == 4
    assert len({tuple(h.tokens) for h in hyps[0]}) == 5
    greedy = greedy_decode(model, src, src.eq(PAD_ID), search_options(max_len_a=0.0, max_len_b=4, min_len=4))[0]
    assert not greedy.finished and len(greedy.tokens) == 4


def test_min_len_is_respected(model):
    src, mask = _src()
    for h in greedy_decode(model, src, mask, search_options(max_len_b=12, min_len=5)):
        assert len(h.tokens) >= 5
    for hyps in beam_search(model, src, mask, search_options(beam_size=3, n_best=3, max_len_b=12, min_len=5)):
        assert all(len(h.tokens) >= 5 for h in hyps)


def test_greedy_stops_when_every_sentence_has_ended(model):
    src, mask = _src()
    calls = []
    original = model.decode_step

    def counting_decode_step(tokens, cache):
        calls.append(tokens.size(0))
        logits = original(tokens, cache)
        logits[..., EOS_ID] += 0.4 * len(calls)  # eos grows likelier with each step: every output ends
        return logits

    model.decode_step = counting_decode_step
    hyps = greedy_decode(model, src, mask, search_options(max_len_a=0.0, max_len_b=200))
    longest = max(len(h.tokens) + h.finished for h in hyps)
    assert all(h.finished for h in hyps)
    assert len(calls) == longest  # one step per position of the longest output, no more
    assert calls == sorted(calls, reverse=True) and calls[-1] < calls[0]  # finished rows leave the batch
