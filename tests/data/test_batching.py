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
        batches = token_batches(src, tgt, max_tokens=500, seed=1, epoch=epoch, pool_factor=10)
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
    a = token_batches(src, tgt, 300, seed=1, epoch=0)
    assert a == token_batches(src, tgt, 300, seed=1, epoch=0)
    assert a != token_batches(src, tgt, 300, seed=1, epoch=1)
    assert a != token_batches(src, tgt, 300, seed=2, epoch=0)


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
