"""`decoding.search`, the one entry: it runs the search its options name, exactly as calling that search directly;
`scores=False` means NaN scores from every search; and the rules on the next token (`NextTokenRules`) are one piece,
applied alike by greedy decoding, beam search and sampling."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from tests.conftest import longest_run, search_options, tiny_model
from tests.decoding.test_decoding import _src
from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.decoding import NextTokenRules, TargetRules, max_output_lengths, search
from transformer.decoding.beam import beam_search
from transformer.decoding.greedy import greedy_decode
from transformer.decoding.sampling import sample_decode


@pytest.fixture
def model():
    return tiny_model(seed=3, tgt_vocab_size=10)


def _found(hyps):
    """Per sentence, (tokens, finished) of each hypothesis."""
    return [[(h.tokens, h.finished) for h in sentence] for sentence in hyps]


def _scores(hyps):
    return [h.score for sentence in hyps for h in sentence]


PREFIXES = [[5, 6, 7], None, [8], [4, 4, 9, 5], None]


@pytest.mark.parametrize("prefixes", [None, PREFIXES], ids=["free", "prefixes"])
def test_search_runs_the_search_its_options_name(model, prefixes):
    src, mask = _src()
    greedy = search_options(beam_size=1, max_len_b=8, min_len=2, max_repeat=2)
    beam = search_options(beam_size=3, n_best=2, max_len_b=8, min_len=2, max_repeat=2)
    sampling = search_options(sampling=True, n_best=3, top_k=4, seed=9, max_len_b=8, min_len=2, max_repeat=2)
    direct = {
        "greedy": [[h] for h in greedy_decode(model, src, mask, greedy, TargetRules(prefixes))],
        "beam": beam_search(model, src, mask, beam, TargetRules(prefixes)),
        "sampling": sample_decode(model, src, mask, sampling, TargetRules(prefixes)),
    }
    for name, options in (("greedy", greedy), ("beam", beam), ("sampling", sampling)):
        found = search(model, src, mask, options, TargetRules(prefixes))
        assert _found(found) == _found(direct[name]), name
        assert _scores(found) == pytest.approx(_scores(direct[name]), abs=1e-6), name
        assert [len(sentence) for sentence in found] == [options.n_best] * src.size(0), name
    assert _found(direct["beam"]) != [[h] * 2 for h in _found(direct["greedy"])]  # the three differ: the test can fail
    assert len({tuple(h.tokens) for sentence in direct["sampling"] for h in sentence}) > src.size(0)


def test_search_calls_one_search_per_call(model, monkeypatch):
    """Beam size 1 is greedy decoding itself (which skips the log-softmax without scores), not a beam of one."""
    module = importlib.import_module("transformer.decoding.search")  # the package's `search` is the function
    called = []

    def recording(name):
        original = getattr(module, name)

        def run(*args, **kwargs):
            called.append(name)
            return original(*args, **kwargs)
        return run

    for name in ("greedy_decode", "beam_search", "sample_decode"):
        monkeypatch.setattr(module, name, recording(name))
    src, mask = _src()
    for options, expected in ((search_options(beam_size=1), "greedy_decode"),
                              (search_options(beam_size=2), "beam_search"),
                              (search_options(sampling=True, n_best=2), "sample_decode")):
        called.clear()
        search(model, src, mask, options, scores=False)
        assert called == [expected]


@pytest.mark.parametrize("kind", ["greedy", "beam", "sampling"])
def test_without_scores_every_search_gives_nan_and_the_same_outputs(model, kind):
    src, mask = _src()
    options = {"greedy": search_options(beam_size=1, max_len_b=8),
               "beam": search_options(beam_size=3, n_best=3, max_len_b=8),
               "sampling": search_options(sampling=True, n_best=2, seed=4, max_len_b=8)}[kind]
    with_scores = search(model, src, mask, options)
    without = search(model, src, mask, options, scores=False)
    assert _found(without) == _found(with_scores)
    assert all(math.isnan(s) for s in _scores(without))
    assert all(math.isfinite(s) and s < 0 for s in _scores(with_scores))


def test_greedy_beam_one_and_top_k_one_sampling_apply_the_rules_alike():
    """A forced prefix, min_len and max_repeat come from one `NextTokenRules`: greedy decoding, a beam of one and
    sampling from the single most probable token (top_k 1, or a temperature near 0) give the same outputs, which keep
    every rule."""
    model = tiny_model(seed=1, tgt_vocab_size=10)  # two outputs end at once, three loop on one token
    src, mask = _src()
    prefixes = [[6, 6], None, [7, 8, 7], None, [9]]
    rules = dict(max_len_a=0.0, max_len_b=14, min_len=6, max_repeat=2)
    plain = [h.tokens for h in greedy_decode(model, src, mask, search_options(max_len_a=0.0, max_len_b=14))]
    assert max(map(longest_run, plain)) > 2 and min(map(len, plain)) < 6  # the rules change outputs: can fail
    targets = TargetRules(prefixes)
    greedy = search(model, src, mask, search_options(beam_size=1, **rules), targets)
    beam_one = beam_search(model, src, mask, search_options(beam_size=1, length_penalty=0.0, **rules), targets)
    top_1 = search(model, src, mask, search_options(sampling=True, n_best=2, top_k=1, seed=3, **rules), targets)
    cold = search(model, src, mask, search_options(sampling=True, temperature=1e-4, seed=4, **rules), targets)
    expected = [h[0].tokens for h in greedy]
    assert all(tokens != free for tokens, free in zip(expected, plain))
    assert [h[0].tokens for h in beam_one] == expected
    assert [[h.tokens for h in sentence] for sentence in top_1] == [[t, t] for t in expected]
    assert [h[0].tokens for h in cold] == expected
    assert [h[0].score for h in beam_one] == pytest.approx([h[0].score for h in greedy], abs=1e-5)
    assert [h[0].score for h in top_1] == pytest.approx([h[0].score for h in greedy], abs=1e-5)
    for tokens, prefix, h in zip(expected, prefixes, greedy):
        assert tokens[:len(prefix or [])] == (prefix or [])
        assert longest_run(tokens) <= 2
        assert len(tokens) >= 6 or not h[0].finished


def test_next_token_rules():
    vocab = 9
    options = search_options(min_len=2, max_repeat=2, no_repeat_ngram_size=2)
    rules = NextTokenRules(options, TargetRules(prefixes=[[5, 6], None]))

    def blocked(history, sentences, step):
        """The tokens blocked per row, the same whether the history is lists or a tensor (beam search's)."""
        found = []
        for h in (history, torch.tensor(history, dtype=torch.long)):
            scores = torch.zeros(len(history), vocab)
            rules.apply_(scores, h, sentences, step)
            found.append([torch.isinf(row).nonzero().flatten().tolist() for row in scores])
        assert found[0] == found[1]
        return found[0]

    # step 0: sentence 0 is forced to 5; sentence 1 is free but for pad, bos and (min_len 2) eos
    assert blocked([[]], [1], 0) == [[PAD_ID, BOS_ID, EOS_ID]]
    assert blocked([[]], [0], 0) == [[t for t in range(vocab) if t != 5]]
    # step 2 (past the prefix and min_len): pad, bos, the token that repeats the bigram "4 7", the third 4 in a row
    assert blocked([[4, 7]], [0], 2) == [[PAD_ID, BOS_ID]]
    assert blocked([[4, 4]], [1], 2) == [[PAD_ID, BOS_ID, 4]]
    assert blocked([[4, 7, 4]], [1], 3) == [[PAD_ID, BOS_ID, 7]]
    # inside the prefix the forced token keeps the model's score, whatever the other rules would block
    scores = torch.log_softmax(torch.randn(1, vocab), -1)
    forced = scores.clone()
    NextTokenRules(options, TargetRules(prefixes=[[4, 4, 4]])).apply_(forced, [[4, 4]], [0], 2)
    assert forced[0, 4] == scores[0, 4] and torch.isinf(forced[0]).sum() == vocab - 1
    free = NextTokenRules(search_options())  # no rule but pad and bos
    scores = torch.zeros(1, vocab)
    free.apply_(scores, [[4, 4, 4, 4]], [0], 0)
    assert torch.isinf(scores[0]).nonzero().flatten().tolist() == [PAD_ID, BOS_ID]


def test_max_output_lengths_reads_the_options():
    mask = torch.tensor([[False] * 5 + [True] * 3, [False] * 8])
    assert max_output_lengths(mask, search_options(max_len_a=1.5, max_len_b=2), 64) == [9, 14]
    assert max_output_lengths(mask, search_options(max_len_a=0.0, max_len_b=100), 64) == [63, 63]
