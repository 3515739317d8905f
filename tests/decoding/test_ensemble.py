"""Ensembles: the mean of the members' log-probabilities per step, each member on its own cache."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import search_options, tiny_model
from tests.decoding.test_decoding import _src
from transformer.config import BOS_ID, EOS_ID
from transformer.decoding.beam import beam_search
from transformer.decoding.ensemble import EnsembleDecoder
from transformer.decoding.greedy import greedy_decode
from transformer.decoding.sampling import sample_decode


def test_an_ensemble_of_one_model_twice_is_that_model():
    model = tiny_model(seed=3, tgt_vocab_size=10)
    src, mask = _src()
    twice = EnsembleDecoder([model, model])
    options = search_options(max_len_b=8)
    for a, b in zip(greedy_decode(model, src, mask, options), greedy_decode(twice, src, mask, options)):
        assert a.tokens == b.tokens and a.score == pytest.approx(b.score, abs=1e-5)
    beam = search_options(beam_size=3, n_best=3, max_len_b=8)
    alone = beam_search(model, src, mask, beam)
    together = beam_search(twice, src, mask, beam)
    assert [[h.tokens for h in s] for s in alone] == [[h.tokens for h in s] for s in together]


@torch.no_grad()
def test_each_step_takes_the_argmax_of_the_mean_log_probabilities():
    # two different models (widths too): the cached ensemble must pick, at every position, the argmax of the mean of
    # the members' full (uncached) forward passes
    a, b = tiny_model(seed=1, tgt_vocab_size=10), tiny_model(seed=2, tgt_vocab_size=10, d_model=16, n_heads=2)
    src, mask = _src()
    ensemble = EnsembleDecoder([a, b])
    options = search_options(max_len_b=8)
    hyps = greedy_decode(ensemble, src, mask, options)
    assert {tuple(h.tokens) for h in hyps} != {tuple(h.tokens) for h in greedy_decode(a, src, mask, options)}
    for i, h in enumerate(hyps):
        row = src[i:i + 1, : int((~mask[i]).sum())]
        target = h.tokens + ([EOS_ID] if h.finished else [])
        tgt_in = torch.tensor([[BOS_ID] + target[:-1]])
        mean = (a(row, tgt_in).log_softmax(-1) + b(row, tgt_in).log_softmax(-1)) / 2  # (1, len, vocab)
        mean[..., 0] = mean[..., BOS_ID] = float("-inf")  # pad, bos: never produced
        assert mean[0].argmax(-1).tolist() == target
    samples = sample_decode(ensemble, src, mask, search_options(sampling=True, n_best=2, top_k=1, max_len_b=8))
    assert [[s.tokens for s in sentence] for sentence in samples] == [[h.tokens] * 2 for h in hyps]


def test_members_with_different_vocabularies_are_refused():
    with pytest.raises(ValueError, match="different sizes"):
        EnsembleDecoder([tiny_model(tgt_vocab_size=10), tiny_model(tgt_vocab_size=12)])
