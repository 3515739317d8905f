import math

import torch

from transformer.training.loss import label_smoothed_cross_entropy

PAD = 0


def _reference(logits, target, eps):
    """The textbook form, written out: -Σ_k q_k log p_k with q = (1-ε)·onehot + ε·uniform(non-pad)."""
    lprobs = logits.double().log_softmax(-1)
    total_loss = total_nll = 0.0
    vocab = logits.size(-1)
    for row, y in zip(lprobs, target.tolist()):
        if y == PAD:
            continue
        q = torch.full((vocab,), eps / (vocab - 1), dtype=torch.double)
        q[PAD] = 0.0
        q[y] += 1.0 - eps
        total_loss += -(q * row).sum().item()
        total_nll += -row[y].item()
    return total_loss, total_nll


def test_matches_hand_computation_on_a_small_case():
    # 3 tokens, vocab 4 = {pad, a, b, c}; uniform logits give p = 1/4 everywhere.
    logits = torch.zeros(3, 4)
    target = torch.tensor([1, 2, PAD])
    loss, nll = label_smoothed_cross_entropy(logits, target, epsilon=0.1, pad_id=PAD)
    # Each real position: q sums to 1 over {a, b, c}, so loss = -Σ q log(1/4) = log 4; same for nll.
    assert math.isclose(loss.item(), 2 * math.log(4), rel_tol=1e-6)
    assert math.isclose(nll.item(), 2 * math.log(4), rel_tol=1e-6)


def test_matches_textbook_form_and_ignores_padding():
    torch.manual_seed(0)
    logits = torch.randn(7, 11)
    target = torch.tensor([3, 0, 5, 10, 0, 1, 2])
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.1, PAD)
    ref_loss, ref_nll = _reference(logits, target, 0.1)
    assert math.isclose(loss.item(), ref_loss, rel_tol=1e-5)
    assert math.isclose(nll.item(), ref_nll, rel_tol=1e-5)
    # Zero smoothing is plain cross entropy.
    plain, _ = label_smoothed_cross_entropy(logits, target, 0.0, PAD)
    expected = torch.nn.functional.cross_entropy(logits, target, ignore_index=PAD, reduction="sum")
    assert math.isclose(plain.item(), expected.item(), rel_tol=1e-5)


def test_gradient_is_p_minus_q():
    torch.manual_seed(1)
    logits = torch.randn(5, 9, dtype=torch.double, requires_grad=True)
    target = torch.tensor([1, 4, 0, 8, 2])
    assert torch.autograd.gradcheck(lambda z: label_smoothed_cross_entropy(z, target, 0.1, PAD)[0], (logits,))
    z = logits.detach().clone().requires_grad_(True)
    label_smoothed_cross_entropy(z, target, 0.1, PAD)[0].backward()
    assert z.grad[0, PAD].abs() > 0  # the pad token gets gradient p_pad (pushed towards zero probability)
    torch.testing.assert_close(z.grad.sum(-1), torch.zeros(5, dtype=torch.double))  # Σ(p - q) = 0
    assert (z.grad[2] == 0).all()  # a padded position gets no gradient


def test_loss_per_token_unchanged_by_extra_pad_columns():
    torch.manual_seed(2)
    logits = torch.randn(2, 6, 13)
    target = torch.tensor([[5, 6, 7, 3, 0, 0], [8, 9, 3, 0, 0, 0]])
    base, _ = label_smoothed_cross_entropy(logits.flatten(0, 1), target.flatten(), 0.1, PAD)
    padded_logits = torch.cat([logits, torch.randn(2, 40, 13)], dim=1)
    padded_target = torch.cat([target, torch.zeros(2, 40, dtype=torch.long)], dim=1)
    padded, _ = label_smoothed_cross_entropy(padded_logits.flatten(0, 1), padded_target.flatten(), 0.1, PAD)
    n = int(target.ne(PAD).sum())
    assert math.isclose(base.item() / n, padded.item() / n, rel_tol=1e-6)
