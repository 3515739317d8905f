import random

import pytest
import torch

from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.data import make_batch, token_batches


def _lengths(n=2000, seed=0):
    """Source lengths 1-60 and target lengths close to them, as in real parallel text."""
    rng = random.Random(seed)
    src = [rng.randint(1, 60) for _ in range(n)]
    return src, [max(1, s + rng.randint(-3, 3)) for s in src]


def test_every_batch_within_budget_and_every_pair_exactly_once():
    src, tgt = _lengths()
    for epoch in range(3):
        batches = [b.tolist() for b in token_batches(src, tgt, max_tokens=500, seed=1, epoch=epoch, pool_factor=10)]
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(src)))
        for b in batches:
            assert len(b) * max(src[i] for i in b) <= 500
            assert len(b) * max(tgt[i] for i in b) <= 500
        # Batches are cut from length-sorted pools: little padding.
        real = sum(src[i] for i in flat)
        padded = sum(len(b) * max(src[i] for i in b) for b in batches)
        assert real / padded > 0.8


def test_order_is_fixed_by_seed_and_epoch():
    src, tgt = _lengths(500)

    def batches(seed, epoch):
        return [b.tolist() for b in token_batches(src, tgt, 300, seed=seed, epoch=epoch)]

    a = batches(1, 0)
    assert a == batches(1, 0)
    assert a != batches(1, 1)
    assert a != batches(2, 0)


def test_batches_are_full_and_sorted_within_a_batch():
    # Cut from length-sorted pools: each batch takes as many pairs as its longest allows (greedy, no gaps).
    src, tgt = _lengths(3000, seed=3)
    longest = [max(s, t) for s, t in zip(src, tgt)]
    not_full = 0
    for b in token_batches(src, tgt, 400, seed=0, epoch=0, pool_factor=1000):  # one pool
        lengths = [longest[i] for i in b]
        assert lengths == sorted(lengths, reverse=True)
        assert len(b) * lengths[0] <= 400
        not_full += len(b) != 400 // lengths[0]
    assert not_full <= 1  # only the pool's last batch may be short


def test_example_over_budget_is_an_error():
    with pytest.raises(ValueError, match="more than max_tokens=10"):
        token_batches([5, 11], [3, 3], max_tokens=10, seed=0, epoch=0)


def test_make_batch_pads_and_shifts_the_target():
    batch = make_batch([[5, 6, EOS_ID], [7, EOS_ID]], [[8, 9], [10]])
    assert batch.src.tolist() == [[5, 6, EOS_ID], [7, EOS_ID, PAD_ID]]
    assert batch.src_key_padding_mask.tolist() == [[False, False, False], [False, False, True]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 8, 9], [BOS_ID, 10, PAD_ID]]
    assert batch.tgt_out.tolist() == [[8, 9, EOS_ID], [10, EOS_ID, PAD_ID]]
    assert batch.n_tgt_tokens == 5 and batch.n_src_tokens == 5
    assert batch.src.dtype == torch.long
