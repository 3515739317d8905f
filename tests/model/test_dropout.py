import pytest
import torch

from transformer.model.attention import MultiHeadAttention
from transformer.model.dropout import Dropout, dropout, keep_mask


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p):
    torch.manual_seed(0)
    keep = keep_mask((1000, 1000), p)
    assert keep.dtype == torch.bool and keep.shape == (1000, 1000)
    # 10^6 draws: the rate's standard deviation is at most 0.0005; 0.003 is six of them.
    assert abs(keep.float().mean().item() - (1 - p)) < 0.003


def test_mask_elements_are_independent():
    # Four mask elements come from one 64-bit draw: neighbours must still be independent, and each of the
    # four 16-bit lanes must keep at the same rate (a lane with a fixed top bit would keep at 0.5 or 1.0).
    torch.manual_seed(1)
    keep = keep_mask((4_000_000,), 0.3).float()
    lanes = keep.view(-1, 4)
    for lane in range(4):
        assert abs(lanes[:, lane].mean().item() - 0.7) < 0.003
    both = (keep[:-1] * keep[1:]).mean().item()
    assert abs(both - 0.49) < 0.003


def test_odd_sizes_and_shapes():
    torch.manual_seed(2)
    for shape in [(1,), (3,), (5, 7), (2, 3, 5, 7)]:
        assert keep_mask(shape, 0.5).shape == shape


def test_kept_elements_are_scaled_and_the_gradient_uses_the_same_mask():
    torch.manual_seed(3)
    x = torch.randn(300, 40, requires_grad=True)
    y = dropout(x, 0.25)
    kept = y != 0
    assert 0.6 < kept.float().mean().item() < 0.9
    torch.testing.assert_close(y[kept], x.detach()[kept] / 0.75)
    grad = torch.randn_like(y)
    y.backward(grad)
    torch.testing.assert_close(x.grad, torch.where(kept, grad / 0.75, 0.0))


def test_seeded_masks_repeat_and_successive_masks_differ():
    x = torch.ones(64, 64)
    torch.manual_seed(4)
    a, b = dropout(x, 0.5), dropout(x, 0.5)
    torch.manual_seed(4)
    assert torch.equal(dropout(x, 0.5), a)
    assert not torch.equal(a, b)


def test_identity_in_eval_mode_and_at_zero():
    x = torch.randn(10, 10)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0) is x
    module = Dropout(0.3).eval()
    assert module(x) is x
    assert not torch.equal(module.train()(x), x)


def test_dtype_is_kept():
    x = torch.randn(50, 50, dtype=torch.bfloat16)
    assert dropout(x, 0.1).dtype == torch.bfloat16


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_bad_probability_is_refused(p):
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(p)
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(torch.ones(3), p)


def test_attention_dropout_on_cpu_goes_through_our_dropout_in_training_only(monkeypatch):
    # On CPU, training with attention dropout takes the explicit path with `dropout` on the weights
    # `(batch, n_heads, q_len, k_len)`; in eval mode dropout is off, so two calls agree.
    import transformer.model.attention as attention

    calls = []

    def recording_dropout(x, p, training=True):
        calls.append((tuple(x.shape), p))
        return dropout(x, p, training)

    monkeypatch.setattr(attention, "dropout", recording_dropout)
    torch.manual_seed(5)
    attn = MultiHeadAttention(d_model=16, n_heads=4, attention_dropout=0.5)
    x = torch.randn(3, 6, 16)
    attn.train()
    out_train, _ = attn(x, x, x)
    assert calls == [((3, 4, 6, 6), 0.5)]
    attn.eval()
    out_eval, _ = attn(x, x, x)
    assert not torch.allclose(out_train, out_eval)
    torch.testing.assert_close(attn(x, x, x)[0], out_eval)
    assert all(p == 0.0 for _, p in calls[1:])  # eval mode: the explicit path (if taken) drops nothing
