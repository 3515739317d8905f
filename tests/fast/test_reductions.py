"""`row_argmax` and `row_topk` (`transformer/fast/reductions.py`) equal to `argmax` and `topk`."""

import pytest
import torch

from transformer.fast.reductions import row_argmax, row_topk


def _hard_rows(vocab: int, seed: int) -> torch.Tensor:
    """20 rows of vocab logits with the cases the two-stage reductions must get right."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(20, vocab, generator=g).round(decimals=1)  # many ties at the top of each row
    x[1, vocab // 3] = x[1, 5] = x[1].max() + 1.0  # a tie between two chunks (argmax: the first index wins)
    x[2] = float("-inf")  # every token blocked
    x[3, 7::11] = float("nan")  # NaN counts as the largest value (argmax: the first one wins)
    x[4, -1] = float("inf")
    x[5, :] = 0.25  # all equal
    x[6, :13] = 50.0  # the top values all in the first chunk
    return x


@pytest.mark.parametrize("vocab", [8000, 2048, 37000, 1031])  # chunks of 160 and 128; argmax itself for the others
def test_row_argmax_equals_argmax_with_ties_nan_and_infinities(vocab):
    x = _hard_rows(vocab, seed=vocab)
    expected = x.argmax(dim=-1)
    assert torch.equal(row_argmax(x), expected)
    assert torch.equal(row_argmax(x[:, None, :][:, 0]), expected)  # a strided view, as decode's logits[:, -1]


@pytest.mark.parametrize("vocab, k", [(8000, 10), (8000, 8), (2048, 4), (37000, 10), (300, 10)])  # the last two: topk
def test_row_topk_equals_topk_with_ties_nan_and_infinities(vocab, k):
    x = _hard_rows(vocab, seed=vocab + k)
    expected_values, expected_indices = x.topk(k, dim=-1)
    for rows in (x, x[:, None, :][:, 0]):  # and a strided view, as decode's logits[:, -1]
        values, indices = row_topk(rows, k)
        torch.testing.assert_close(values, expected_values, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(x.gather(1, indices), values, rtol=0, atol=0, equal_nan=True)  # where they are
        assert all(len(set(row)) == k for row in indices.tolist())  # k distinct positions per row
        distinct = (values[:, 1:] != values[:, :-1]).all(dim=1) & ~values.isnan().any(dim=1)
        assert torch.equal(indices[distinct], expected_indices[distinct])  # without ties, the same positions
