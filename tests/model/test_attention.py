import pytest
import torch

from transformer.model.attention import (
    KVCache,
    MultiHeadAttention,
    causal_mask,
    make_key_padding_mask,
)


def _attention(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    attn = MultiHeadAttention(d_model=16, n_heads=4, attention_dropout=dropout).eval()
    with torch.no_grad():  # non-zero biases, so that a test can tell them apart from zero
        attn.in_proj.bias.normal_()
        attn.out_proj.bias.normal_()
    return attn


def test_causal_mask_blocks_future_only():
    mask = causal_mask(4)
    assert mask.dtype == torch.bool and mask.shape == (4, 4)
    assert torch.equal(mask, torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool))
    # With 2 cached positions, the 2 new queries are positions 2 and 3.
    assert torch.equal(causal_mask(2, 4), mask[2:])


def test_key_padding_mask_is_true_at_padding():
    tokens = torch.tensor([[5, 6, 0], [7, 0, 0]])
    assert make_key_padding_mask(tokens, 0).tolist() == [[False, False, True], [False, True, True]]


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_path_equals_fused_path(causal):
    attn = _attention()
    x = torch.randn(3, 5, 16)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    mask = causal_mask(5) if causal else None
    fused, none = attn(x, key_padding_mask=padding, attn_mask=mask)
    explicit, weights = attn(x, key_padding_mask=padding, attn_mask=mask, need_weights=True)
    assert none is None
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    assert weights.shape == (3, 4, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 5))
    assert (weights[1, :, :, 3:] == 0).all() and (weights[2, :, :, 1:] == 0).all()
    if causal:
        assert (weights.triu(1) == 0).all()


def test_is_causal_shortcut_equals_explicit_mask():
    attn = _attention()
    x = torch.randn(2, 6, 16)
    expected, _ = attn(x, attn_mask=causal_mask(6))
    got, _ = attn(x, is_causal=True)
    got_explicit, weights = attn(x, is_causal=True, need_weights=True)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_explicit, expected, atol=1e-5, rtol=1e-5)
    assert (weights.triu(1) == 0).all()


def test_cross_attention_uses_keys_from_memory():
    attn = _attention()
    query, memory = torch.randn(2, 3, 16), torch.randn(2, 7, 16)
    out, weights = attn(query, memory, need_weights=True)
    assert out.shape == (2, 3, 16) and weights.shape == (2, 4, 3, 7)
    changed, _ = attn(query, memory + 1.0, need_weights=True)
    assert not torch.allclose(out, changed)


def test_projections_are_the_papers_per_matrix_products():
    """Self-attention projects x by W^Q, W^K and W^V in one product; encoder-decoder attention x by W^Q and the
    memory by W^K and W^V: each equal to its matrix alone (`in_proj` rows [W^Q; W^K; W^V])."""
    attn = _attention()
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    w, b = attn.in_proj.weight.chunk(3), attn.in_proj.bias.chunk(3)

    def heads(t, i):
        return attn.split_heads(t @ w[i].T + b[i])

    for got, i in zip(attn.project_self(x), range(3)):
        torch.testing.assert_close(got, heads(x, i), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(attn.project_query(x), heads(x, 0), atol=1e-6, rtol=1e-6)
    for got, i in zip(attn.project_memory(memory), (1, 2)):
        torch.testing.assert_close(got, heads(memory, i), atol=1e-6, rtol=1e-6)
    assert attn.project_query(x).shape == (2, 4, 3, 4) and attn.project_memory(memory)[0].shape == (2, 4, 5, 4)


def test_fully_masked_query_gives_zeros_not_nan():
    attn = _attention()
    x = torch.randn(2, 4, 16, requires_grad=True)
    padding = torch.tensor([[True] * 4, [False, False, True, True]])
    fused, _ = attn(x, key_padding_mask=padding)
    explicit, weights = attn(x, key_padding_mask=padding, need_weights=True)
    for out in (fused, explicit):
        assert torch.isfinite(out).all()
        # The fully padded row attends to nothing: its output is the output projection's bias alone.
        torch.testing.assert_close(out[0], attn.out_proj.bias.expand(4, 16))
    assert (weights[0] == 0).all()
    (fused.sum() + explicit.sum()).backward()
    assert torch.isfinite(x.grad).all()


def test_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(d_model=10, n_heads=4)


@pytest.mark.parametrize("fully_padded_row", [False, True], ids=["padding", "an-empty-source"])
def test_attention_on_the_cache_equals_attention_on_the_whole_prefix(fully_padded_row):
    """Self-attention on the cache gives the last position of causal attention over the whole prefix, and
    encoder-decoder attention on the static cache the attention to the memory, across a row selection; a source
    row that is all padding attends to nothing (zeros, not NaN)."""
    self_attn, cross_attn = _attention(seed=1), _attention(seed=2)
    g = torch.Generator().manual_seed(3)
    memory = torch.randn(3, 6, 16, generator=g)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 2 + [True] * 4])
    if fully_padded_row:
        padding[2] = True
    self_cache, cross_cache, prefix = KVCache(), KVCache(), None
    for step in range(5):
        if step == 3:  # rows reordered and repeated, as beam search and finished sentences do
            index = torch.tensor([2, 0, 0])
            self_cache.select(index)
            cross_cache.select(index)
            memory, padding, prefix = memory[index], padding[index], prefix[index]
        x = torch.randn(3, 1, 16, generator=g)
        prefix = x if prefix is None else torch.cat([prefix, x], dim=1)
        got_self, _ = self_attn(x, cache=self_cache, is_causal=step == 0)
        expected_self, _ = self_attn(prefix, need_weights=True,
                                     attn_mask=causal_mask(prefix.size(1)))
        torch.testing.assert_close(got_self, expected_self[:, -1:], atol=1e-6, rtol=1e-6)
        assert self_cache.key.shape == (3, 4, step + 1, 4)
        got, _ = cross_attn(x, memory, key_padding_mask=padding, cache=cross_cache)
        expected, _ = cross_attn(x, memory, key_padding_mask=padding, need_weights=True)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        assert torch.isfinite(got).all()
