"""Random sampling and n-gram blocking: the properties that must hold (top-k 1 and temperature -> 0 are greedy, the
draws follow the filtered distribution, a sentence's samples do not depend on its batch, no output repeats an
n-gram or has a run of one token longer than max_repeat, blocking never empties a beam)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import longest_run, random_tokens, search_options, tiny_model
from tests.decoding.test_decoding import _src
from transformer.config import EOS_ID, PAD_ID
from transformer.decoding import TargetRules
from transformer.decoding.beam import beam_search
from transformer.decoding.greedy import greedy_decode
from transformer.decoding.ngram import block_long_runs_, blocked_tokens
from transformer.decoding.sampling import draw, sample_decode, sampling_distribution

VOCAB = 10


@pytest.fixture
def model():
    return tiny_model(seed=3, tgt_vocab_size=VOCAB)


def _sampling(**changes):
    """Sampling options (n_best: samples per sentence), with the search functions' old keyword defaults."""
    return search_options(sampling=True, **changes)


def _tokens(hyps):
    return [[h.tokens for h in sentence] for sentence in hyps]


def test_top_k_one_and_a_tiny_temperature_are_greedy(model):
    src, mask = _src()
    greedy = [h.tokens for h in greedy_decode(model, src, mask, search_options(max_len_b=8))]
    top1 = sample_decode(model, src, mask, _sampling(n_best=3, top_k=1, seed=5, max_len_b=8))
    assert _tokens(top1) == [[g] * 3 for g in greedy]
    cold = sample_decode(model, src, mask, _sampling(n_best=2, temperature=1e-4, seed=6, max_len_b=8))
    assert _tokens(cold) == [[g] * 2 for g in greedy]
    tiny_p = sample_decode(model, src, mask, _sampling(top_p=1e-6, seed=7, max_len_b=8))
    assert _tokens(tiny_p) == [[g] for g in greedy]


@pytest.mark.parametrize("temperature", [1e-50, 1e-40, 1e-37, 5e-324])
def test_a_temperature_below_float32s_range_still_draws_the_most_probable_token(model, temperature):
    logits = torch.tensor([[0.5, 2.0, -1.0, float("-inf")], [3.0, 3.0 - 1e-3, -2.0, 0.0]])
    probs = sampling_distribution(logits, temperature=temperature)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    src, mask = _src()
    greedy = [h.tokens for h in greedy_decode(model, src, mask, search_options(max_len_b=8))]
    cold = sample_decode(model, src, mask, _sampling(n_best=2, temperature=temperature, seed=6, max_len_b=8))
    assert _tokens(cold) == [[g] * 2 for g in greedy]


@pytest.mark.parametrize("temperature", [1e30, 1e37, 1e39, 1e308, 1.7976931348623157e308])
def test_a_temperature_above_float32s_range_still_draws_uniformly_among_the_allowed_tokens(model, temperature):
    logits = torch.tensor([[0.5, 20.0, -1.0, float("-inf")], [3.0, -30.0, float("-inf"), 0.0]])
    probs = sampling_distribution(logits, temperature=temperature)
    third = torch.tensor(1 / 3)
    assert torch.allclose(probs, torch.tensor([[third, third, third, 0.0], [third, third, 0.0, third]]))
    src, mask = _src()

    def hot(t):
        return _tokens(sample_decode(model, src, mask, _sampling(n_best=4, temperature=t, seed=6, max_len_b=8,
                                                                 max_repeat=0)))
    samples = hot(temperature)
    assert samples == hot(1e30)  # uniform draws, as at a temperature float32 holds
    assert len({t for sentence in samples for tokens in sentence for t in tokens}) > 5  # not one piece repeated
    assert len({tuple(tokens) for sentence in samples for tokens in sentence}) > 4  # distinct samples


def test_draws_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    for top_k, top_p, temperature, expected in [
        (0, 1.0, 1.0, [0.5, 0.2, 0.15, 0.1, 0.05]),
        (2, 1.0, 1.0, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0]),
        (0, 0.8, 1.0, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0]),  # 0.5 + 0.2 < 0.8: the third is needed
        (0, 1.0, 2.0, None),
    ]:
        probs = sampling_distribution(logits, top_k, top_p, temperature)[0]
        if expected is None:  # temperature 2: p_i proportional to sqrt(p_i)
            expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).sqrt()
            expected = (expected / expected.sum()).tolist()
        assert probs.tolist() == pytest.approx(expected, abs=1e-6)
        g = torch.Generator().manual_seed(0)
        n = 40_000
        tokens = draw(probs.expand(n, -1), torch.rand(n, generator=g, dtype=torch.float64))
        frequencies = torch.bincount(tokens, minlength=5).double() / n
        assert frequencies.tolist() == pytest.approx(expected, abs=0.01)  # 4 standard errors at most


def test_a_sentence_gets_the_same_samples_whatever_its_batch(model):
    src, mask = _src()
    together = sample_decode(model, src, mask, _sampling(n_best=4, seed=11, max_len_b=8))
    for i in range(src.size(0)):
        row = src[i:i + 1, : int((~mask[i]).sum())]
        alone = sample_decode(model, row, row.eq(PAD_ID), _sampling(n_best=4, seed=11, max_len_b=8))[0]
        assert [h.tokens for h in alone] == [h.tokens for h in together[i]]
    reordered = sample_decode(model, src.flip(0), mask.flip(0), _sampling(n_best=4, seed=11, max_len_b=8))
    assert _tokens(reordered)[::-1] == _tokens(together)
    other_seed = sample_decode(model, src, mask, _sampling(n_best=4, seed=12, max_len_b=8))
    assert _tokens(other_seed) != _tokens(together)
    assert len({tuple(h.tokens) for sentence in together for h in sentence}) > src.size(0)  # samples differ


def test_sample_scores_are_the_models_log_probabilities(model):
    from tests.decoding.test_decoding import forced_score

    src, mask = _src()
    for i, sentence in enumerate(sample_decode(model, src, mask, _sampling(n_best=2, seed=3, top_k=4, max_len_b=8))):
        for h in sentence:
            assert h.score == pytest.approx(forced_score(model, src[i], h.tokens, h.finished, 0.0), abs=1e-4)


def test_blocked_tokens():
    assert blocked_tokens([5, 6, 7, 5], 2) == {6}  # "5 6" occurred: after 5, 6 is blocked
    assert blocked_tokens([5, 6, 5, 6], 3) == {5}
    assert blocked_tokens([5, 6, 7], 2) == set()
    assert blocked_tokens([5, 6, 7], 1) == {5, 6, 7}
    assert blocked_tokens([EOS_ID, 4, EOS_ID], 2) == {4}  # eos itself is never blocked


def _ngrams(tokens, n):
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_output_repeats_an_ngram(n):
    model = tiny_model(seed=5, tgt_vocab_size=12)
    src = random_tokens(6, 9, 23, lengths=[9, 8, 7, 9, 5, 6], seed=2)
    mask = src.eq(PAD_ID)
    plain = greedy_decode(model, src, mask, search_options(max_len_a=0.0, max_len_b=20))
    assert any(len(set(_ngrams(h.tokens, n))) < len(_ngrams(h.tokens, n)) for h in plain)  # the test can fail
    cap = dict(max_len_a=0.0, max_len_b=20, no_repeat_ngram_size=n)
    outputs = [h.tokens for h in greedy_decode(model, src, mask, search_options(**cap))]
    outputs += [h.tokens for hyps in beam_search(model, src, mask, search_options(beam_size=4, n_best=4, **cap))
                for h in hyps]
    outputs += [h.tokens for hyps in sample_decode(model, src, mask, _sampling(n_best=3, **cap)) for h in hyps]
    for tokens in outputs:
        assert len(set(_ngrams(tokens, n))) == len(_ngrams(tokens, n)), tokens


@pytest.mark.parametrize("max_repeat", [1, 2, 3])
def test_no_output_has_a_run_longer_than_max_repeat(max_repeat):
    model = tiny_model(seed=5, tgt_vocab_size=12)
    src = random_tokens(6, 9, 23, lengths=[9, 8, 7, 9, 5, 6], seed=2)
    mask = src.eq(PAD_ID)
    plain = [h.tokens for h in greedy_decode(model, src, mask, search_options(max_len_a=0.0, max_len_b=20))]
    assert max(map(longest_run, plain)) > 3  # this random model loops: the test can fail
    cap = dict(max_len_a=0.0, max_len_b=20, max_repeat=max_repeat)
    greedy = [h.tokens for h in greedy_decode(model, src, mask, search_options(**cap))]
    beam = [[h.tokens for h in hyps] for hyps in beam_search(model, src, mask, search_options(beam_size=4, n_best=4,
                                                                                              **cap))]
    samples = [h.tokens for hyps in sample_decode(model, src, mask, _sampling(n_best=3, **cap)) for h in hyps]
    for tokens in greedy + [t for hyps in beam for t in hyps] + samples:
        assert longest_run(tokens) <= max_repeat, tokens
    # beam 1 is still greedy, and a limit no output reaches changes nothing
    assert [hyps[0].tokens for hyps in beam_search(model, src, mask, search_options(beam_size=1, **cap))] == greedy
    unreached = search_options(max_len_a=0.0, max_len_b=20, max_repeat=21)
    assert [h.tokens for h in greedy_decode(model, src, mask, unreached)] == plain
    assert _blocked([5, 4, 4], 2) == [4] and _blocked([4, 4, 5], 2) == [] and _blocked([4, 4], 3) == []
    assert _blocked([4, EOS_ID], 1) == []  # eos is never blocked


def _blocked(prefix, max_repeat):
    """The tokens blocked after `prefix`, the same from a list and from a tensor."""
    blocked = []
    for history in ([prefix], torch.tensor([prefix])):
        scores = torch.zeros(1, VOCAB)
        block_long_runs_(scores, history, max_repeat)
        blocked.append(torch.isinf(scores[0]).nonzero().flatten().tolist())
    assert blocked[0] == blocked[1], blocked
    return blocked[0]


def test_blocking_everything_still_ends_the_beam_with_eos():
    # Vocabulary of 6: pad, unk, bos, eos and two tokens; with unigram blocking, after two tokens only eos is left.
    model = tiny_model(seed=1, tgt_vocab_size=6)
    src = random_tokens(3, 5, 23, seed=4)
    mask = src.eq(PAD_ID)
    options = search_options(beam_size=4, n_best=1, max_len_a=0.0, max_len_b=30, no_repeat_ngram_size=1)
    for hyps in beam_search(model, src, mask, options):
        assert hyps and hyps[0].finished and len(set(hyps[0].tokens)) == len(hyps[0].tokens) <= 3
    for h in greedy_decode(model, src, mask, options):
        assert h.finished and len(set(h.tokens)) == len(h.tokens)


@pytest.mark.parametrize("search", ["greedy", "beam", "sampling"])
def test_forced_prefixes_in_a_batch_equal_each_line_alone(model, search):
    src, mask = _src()
    prefixes = [[5, 6, 7], None, [8], [4, 4, 9, 5], []]

    def run(src, mask, prefixes):
        if search == "greedy":
            return [[h] for h in greedy_decode(model, src, mask, search_options(max_len_b=8), TargetRules(prefixes))]
        if search == "beam":
            return beam_search(model, src, mask, search_options(beam_size=3, n_best=2, max_len_b=8),
                               TargetRules(prefixes))
        return sample_decode(model, src, mask, _sampling(n_best=2, seed=1, max_len_b=8), TargetRules(prefixes))

    together = run(src, mask, prefixes)
    for i, prefix in enumerate(prefixes):
        for h in together[i]:
            assert h.tokens[:len(prefix or [])] == (prefix or [])
        row = src[i:i + 1, : int((~mask[i]).sum())]
        alone = run(row, row.eq(PAD_ID), [prefix])[0]
        assert [h.tokens for h in alone] == [h.tokens for h in together[i]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in together[i]], abs=1e-5)
    if search == "greedy":  # the forced part is scored as the model scores it
        from tests.decoding.test_decoding import forced_score

        h = together[0][0]
        assert h.score == pytest.approx(forced_score(model, src[0], h.tokens, h.finished, 0.0), abs=1e-4)
    free = run(src, mask, None)
    assert [h.tokens for h in free[1]] == [h.tokens for h in together[1]]  # no prefix: as without prefixes


def test_word_alignment_from_piece_attention():
    from transformer.decoding.alignment import align_words, pharaoh, word_index

    src = ["\u2581Ein", "\u2581Mann", "\u2581fähr", "t", "."]  # words: Ein Mann fährt.
    tgt = ["\u2581A", "\u2581man", "\u2581ride", "s", "."]
    assert word_index(src) == [0, 1, 2, 2, 2]
    weights = torch.zeros(len(tgt), len(src) + 1)
    for t, s in enumerate([0, 1, 2, 3, 4]):
        weights[t, s] = 1.0
    weights[:, -1] = 5.0  # the source eos is never aligned to
    assert pharaoh(align_words(weights, src, tgt)) == "0-0 1-1 2-2"
    weights[2] = torch.tensor([0.0, 0.9, 0.1, 0.0, 0.0, 0.0])  # "ride" looks at "Mann"
    assert align_words(weights, src, tgt) == [(0, 0), (1, 1), (1, 2), (2, 2)]
    assert align_words(weights, [], tgt) == []


def test_banned_tokens_never_appear_in_any_search(model):
    """`banned` (a model's source marks: language tokens, tags) is a rule of every search: the tokens greedy
    decoding would write first are never written once banned, in greedy, beam and sampled outputs."""
    from transformer.decoding import search

    src, mask = _src()
    free = [h.tokens for h in greedy_decode(model, src, mask, search_options(max_len_b=8))]
    banned = tuple(sorted({tokens[0] for tokens in free if tokens}))
    assert banned
    for options in (search_options(max_len_b=8), search_options(beam_size=4, n_best=4, max_len_b=8),
                    _sampling(n_best=3, seed=2, max_len_b=8)):
        found = search(model, src, mask, options, TargetRules(banned=banned))
        assert all(not set(h.tokens) & set(banned) for hyps in found for h in hyps)
    assert [h.tokens for h in greedy_decode(model, src, mask, search_options(max_len_b=8))] == free
