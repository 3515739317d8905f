import math

import torch

from transformer.training.loss import CHUNK_ROWS, label_smoothed_cross_entropy

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


def test_chunked_rows_match_autograd_of_the_textbook_form_across_chunk_boundaries():
    # More rows than CHUNK_ROWS, so the loss and gradient are assembled from several chunks (one partial).
    torch.manual_seed(3)
    n = 2 * CHUNK_ROWS + 37
    logits = torch.randn(n, 17, dtype=torch.double)
    target = torch.randint(0, 17, (n,))
    target[CHUNK_ROWS - 1:CHUNK_ROWS + 1] = PAD  # pad rows on both sides of a chunk boundary
    eps = 0.1
    ours = logits.clone().requires_grad_(True)
    loss, nll = label_smoothed_cross_entropy(ours, target, eps, PAD)
    (loss * 0.5).backward()
    ref = logits.clone().requires_grad_(True)
    log_p = ref.log_softmax(-1)
    q = torch.full_like(log_p, eps / 16)
    q[:, PAD] = 0.0
    q.scatter_add_(-1, target[:, None], torch.full((n, 1), 1.0 - eps, dtype=torch.double))
    keep = target.ne(PAD).double()
    ref_loss = (-(q * log_p).sum(-1) * keep).sum()
    (ref_loss * 0.5).backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, (-log_p.gather(-1, target[:, None]).squeeze(-1) * keep).sum().detach())
    torch.testing.assert_close(ours.grad, ref.grad)


def test_bf16_logits_are_scored_in_float32_and_get_a_bf16_gradient():
    torch.manual_seed(4)
    logits = torch.randn(300, 50) * 3
    target = torch.randint(1, 50, (300,))
    half = logits.bfloat16().requires_grad_(True)
    loss, _ = label_smoothed_cross_entropy(half, target, 0.1, PAD)
    loss.backward()
    exact = half.detach().float().requires_grad_(True)
    ref_loss, _ = label_smoothed_cross_entropy(exact, target, 0.1, PAD)
    ref_loss.backward()
    assert loss.dtype == torch.float32 and half.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss)  # same bf16 inputs, float32 arithmetic
    torch.testing.assert_close(half.grad.float(), exact.grad, rtol=1e-2, atol=1e-4)


def test_loss_is_the_same_with_and_without_a_gradient():
    # Without requires_grad the forward skips building p - q; the loss terms must not depend on that branch.
    torch.manual_seed(5)
    logits = torch.randn(CHUNK_ROWS + 10, 7)
    target = torch.randint(0, 7, (CHUNK_ROWS + 10,))
    plain = label_smoothed_cross_entropy(logits, target, 0.1, PAD)
    tracked = label_smoothed_cross_entropy(logits.clone().requires_grad_(True), target, 0.1, PAD)
    assert not plain[0].requires_grad and tracked[0].requires_grad
    torch.testing.assert_close(plain[0], tracked[0].detach(), rtol=0, atol=0)
    torch.testing.assert_close(plain[1], tracked[1], rtol=0, atol=0)
