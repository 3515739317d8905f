import pytest
import torch
from torch import nn

from tests.conftest import tiny_model
from transformer.fast.dropout import FastCPUDropout, dropout, keep_mask, use_fast_cpu_dropout
from transformer.model.attention import MultiHeadAttention


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
    module = FastCPUDropout(0.3).eval()
    assert module(x) is x
    assert not torch.equal(module.train()(x), x)


def test_dtype_is_kept():
    x = torch.randn(50, 50, dtype=torch.bfloat16)
    assert dropout(x, 0.1).dtype == torch.bfloat16


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_bad_probability_is_refused(p):
    with pytest.raises(ValueError, match="dropout probability"):
        FastCPUDropout(p)
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(torch.ones(3), p)


def test_the_swap_replaces_every_dropout_and_keeps_the_state_dict():
    model = tiny_model(seed=0, dropout=0.1, attention_dropout=0.2)
    state = model.state_dict()
    plain = [(name, m.p) for name, m in model.named_modules() if isinstance(m, nn.Dropout)]
    assert plain and not any(isinstance(m, FastCPUDropout) for m in model.modules())
    use_fast_cpu_dropout(model)
    swapped = [(name, m.p) for name, m in model.named_modules() if isinstance(m, FastCPUDropout)]
    assert swapped == plain
    assert all(m.explicit_dropout for m in model.modules() if isinstance(m, MultiHeadAttention))
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_the_swapped_model_is_unchanged_in_eval_mode():
    model = tiny_model(seed=0, dropout=0.1, attention_dropout=0.2).eval()
    src, tgt = torch.randint(4, 23, (3, 7)), torch.randint(4, 29, (3, 5))
    expected = model(src, tgt)
    use_fast_cpu_dropout(model)
    assert not model.training and not any(m.training for m in model.modules())
    assert torch.equal(model(src, tgt), expected)


def test_attention_dropout_goes_through_the_fast_kernel_in_training_only(monkeypatch):
    # After the swap, training with attention dropout takes the explicit path with `dropout` on the weights
    # `(batch, n_heads, q_len, k_len)`; in eval mode dropout is off, so two calls agree.
    import transformer.fast.dropout as fast_dropout

    calls = []

    def recording_dropout(x, p, training=True):
        calls.append((tuple(x.shape), p, training))
        return dropout(x, p, training)

    monkeypatch.setattr(fast_dropout, "dropout", recording_dropout)
    torch.manual_seed(5)
    attn = MultiHeadAttention(d_model=16, n_heads=4, attention_dropout=0.5)
    use_fast_cpu_dropout(attn)
    x = torch.randn(3, 6, 16)
    attn.train()
    out_train, _ = attn(x)
    assert calls == [((3, 4, 6, 6), 0.5, True)]
    attn.eval()
    out_eval, _ = attn(x)
    assert not torch.allclose(out_train, out_eval)
    torch.testing.assert_close(attn(x)[0], out_eval)
    assert len(calls) == 1  # eval mode: the fused path, no dropout drawn


def test_without_the_swap_attention_dropout_stays_in_the_fused_kernel(monkeypatch):
    import torch.nn.functional as F

    import transformer.model.attention as attention

    seen, fused = [], F.scaled_dot_product_attention

    def recording_sdpa(*args, dropout_p=0.0, **kwargs):
        seen.append(dropout_p)
        return fused(*args, dropout_p=dropout_p, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording_sdpa)
    attn = MultiHeadAttention(d_model=16, n_heads=4, attention_dropout=0.5).train()
    attn(torch.randn(3, 6, 16))
    assert seen == [0.5]
