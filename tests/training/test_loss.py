import math

import pytest
import torch

from tests.conftest import random_tokens, tiny_model
from transformer.training.loss import (
    CHUNK_ROWS,
    LossComputation,
    chunk_rows,
    projected_label_smoothed_cross_entropy,
)

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


def _autograd_reference(hidden, weight, target, eps):
    """Loss and NLL of the textbook form through autograd: logits, log_softmax, smoothed targets q."""
    log_p = (hidden @ weight.t()).log_softmax(-1)
    vocab = weight.size(0)
    q = torch.full_like(log_p, eps / (vocab - 1))
    q[:, PAD] = 0.0
    q.scatter_add_(-1, target[:, None], torch.full((len(target), 1), 1.0 - eps, dtype=log_p.dtype))
    keep = target.ne(PAD).to(log_p.dtype)
    return (-(q * log_p).sum(-1) * keep).sum(), (-log_p.gather(-1, target[:, None]).squeeze(-1) * keep).sum()


def test_matches_hand_computation_on_a_small_case():
    # 3 tokens, vocab 4 = {pad, a, b, c}; zero hidden states give zero logits, so p = 1/4 everywhere.
    hidden, weight = torch.zeros(3, 5), torch.randn(4, 5)
    target = torch.tensor([1, 2, PAD])
    loss, nll = projected_label_smoothed_cross_entropy(hidden, weight, target, epsilon=0.1, pad_id=PAD)
    # Each real position: q sums to 1 over {a, b, c}, so loss = -Σ q log(1/4) = log 4; same for nll.
    assert math.isclose(loss.item(), 2 * math.log(4), rel_tol=1e-6)
    assert math.isclose(nll.item(), 2 * math.log(4), rel_tol=1e-6)


def test_matches_textbook_form_and_ignores_padding():
    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 5), torch.randn(11, 5)
    target = torch.tensor([3, 0, 5, 10, 0, 1, 2])
    loss, nll = projected_label_smoothed_cross_entropy(hidden, weight, target, 0.1, PAD)
    ref_loss, ref_nll = _reference(hidden @ weight.t(), target, 0.1)
    assert math.isclose(loss.item(), ref_loss, rel_tol=1e-5)
    assert math.isclose(nll.item(), ref_nll, rel_tol=1e-5)
    # Zero smoothing is plain cross entropy.
    plain, _ = projected_label_smoothed_cross_entropy(hidden, weight, target, 0.0, PAD)
    expected = torch.nn.functional.cross_entropy(hidden @ weight.t(), target, ignore_index=PAD, reduction="sum")
    assert math.isclose(plain.item(), expected.item(), rel_tol=1e-5)


def test_output_bias_is_added_to_the_logits_and_gets_its_gradient():
    torch.manual_seed(4)
    hidden = torch.randn(300, 4, dtype=torch.double, requires_grad=True)  # more rows than one chunk
    weight = torch.randn(9, 4, dtype=torch.double, requires_grad=True)
    bias = torch.randn(9, dtype=torch.double, requires_grad=True)
    target = torch.randint(0, 9, (300,))
    loss, nll = projected_label_smoothed_cross_entropy(hidden, weight, target, 0.1, PAD, bias)
    ref_loss, ref_nll = _reference(hidden @ weight.t() + bias, target, 0.1)
    assert math.isclose(loss.item(), ref_loss, rel_tol=1e-9) and math.isclose(nll.item(), ref_nll, rel_tol=1e-9)
    assert torch.autograd.gradcheck(
        lambda h, w, b: projected_label_smoothed_cross_entropy(h, w, target, 0.1, PAD, b)[0], (hidden, weight, bias))


def test_gradients_are_those_of_p_minus_q():
    torch.manual_seed(1)
    hidden = torch.randn(5, 4, dtype=torch.double, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.double, requires_grad=True)
    target = torch.tensor([1, 4, 0, 8, 2])
    assert torch.autograd.gradcheck(
        lambda h, w: projected_label_smoothed_cross_entropy(h, w, target, 0.1, PAD)[0], (hidden, weight))
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    projected_label_smoothed_cross_entropy(h, w, target, 0.1, PAD)[0].backward()
    assert w.grad[PAD].abs().sum() > 0  # the pad row of W gets gradient (pushed towards zero probability)
    assert (h.grad[2] == 0).all()  # a padded position gets no gradient
    assert h.grad[0].abs().sum() > 0


def test_loss_per_token_unchanged_by_extra_pad_rows():
    torch.manual_seed(2)
    hidden, weight = torch.randn(12, 6), torch.randn(13, 6)
    target = torch.tensor([5, 6, 7, 3, 0, 0, 8, 9, 3, 0, 0, 0])
    base, _ = projected_label_smoothed_cross_entropy(hidden, weight, target, 0.1, PAD)
    padded_hidden = torch.cat([hidden, torch.randn(80, 6)])
    padded_target = torch.cat([target, torch.zeros(80, dtype=torch.long)])
    padded, _ = projected_label_smoothed_cross_entropy(padded_hidden, weight, padded_target, 0.1, PAD)
    n = int(target.ne(PAD).sum())
    assert math.isclose(base.item() / n, padded.item() / n, rel_tol=1e-6)


@pytest.mark.parametrize("rows_per_chunk", [None, 100, 2 * CHUNK_ROWS + 37, 4096])
def test_chunked_rows_match_autograd_of_the_textbook_form_across_chunk_boundaries(rows_per_chunk):
    # More rows than CHUNK_ROWS (the CPU's default), so the loss and both gradients are assembled from several
    # chunks (one partial); and other chunk sizes (a GPU's are larger: one chunk here).
    torch.manual_seed(3)
    n = 2 * CHUNK_ROWS + 37
    hidden, weight = torch.randn(n, 6, dtype=torch.double), torch.randn(17, 6, dtype=torch.double)
    target = torch.randint(0, 17, (n,))
    target[CHUNK_ROWS - 1:CHUNK_ROWS + 1] = PAD  # pad rows on both sides of a chunk boundary
    target[99:101] = PAD
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, nll = projected_label_smoothed_cross_entropy(h, w, target, 0.1, PAD, rows_per_chunk=rows_per_chunk)
    (loss * 0.5).backward()
    ref_h, ref_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref_loss, ref_nll = _autograd_reference(ref_h, ref_w, target, 0.1)
    (ref_loss * 0.5).backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll.detach())
    torch.testing.assert_close(h.grad, ref_h.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)


def test_a_gpu_computes_larger_chunks_than_a_cpu():
    assert chunk_rows("cpu", 8000) == CHUNK_ROWS
    assert chunk_rows("cuda", 8192) == 4096 and chunk_rows("cuda", 37000) == 906
    assert chunk_rows("cuda", 10 ** 6) == CHUNK_ROWS  # never fewer rows than the CPU's


def test_autocast_multiplies_in_bf16_and_scores_in_float32():
    torch.manual_seed(4)
    hidden, weight = torch.randn(300, 16), torch.randn(50, 16) * 0.5
    target = torch.randint(1, 50, (300,))
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = projected_label_smoothed_cross_entropy(h, w, target, 0.1, PAD)
    loss.backward()
    # The reference: the same bf16 product, then everything in float32.
    ref_h, ref_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = (ref_h.bfloat16() @ ref_w.bfloat16().t()).float()
    ref_loss, _ = _autograd_reference(logits, torch.eye(50), target, 0.1)  # logits @ I = logits
    ref_loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=2e-2, atol=2e-2)


def test_loss_is_the_same_with_and_without_a_gradient():
    # Without a gradient (no_grad, or inputs that need none) the forward skips building p - q and its products;
    # the loss terms must not depend on that branch.
    torch.manual_seed(5)
    hidden, weight = torch.randn(CHUNK_ROWS + 10, 4), torch.randn(7, 4)
    target = torch.randint(0, 7, (CHUNK_ROWS + 10,))
    plain = projected_label_smoothed_cross_entropy(hidden, weight, target, 0.1, PAD)
    tracked = projected_label_smoothed_cross_entropy(hidden.clone().requires_grad_(True), weight, target, 0.1, PAD)
    with torch.no_grad():
        untracked = projected_label_smoothed_cross_entropy(hidden.clone().requires_grad_(True), weight, target, 0.1,
                                                           PAD)
    assert not plain[0].requires_grad and tracked[0].requires_grad and not untracked[0].requires_grad
    for other in (tracked, untracked):
        torch.testing.assert_close(plain[0], other[0].detach(), rtol=0, atol=0)
        torch.testing.assert_close(plain[1], other[1], rtol=0, atol=0)


def test_without_a_gradient_no_gradient_product_is_computed(monkeypatch):
    # Validation runs the loss under no_grad: the p - q products (torch.mm into the hidden states' gradient,
    # addmm_ into the weight's) must be skipped there, and run when a gradient is wanted.
    calls = []
    real_mm, real_addmm_ = torch.mm, torch.Tensor.addmm_
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append("mm") or real_mm(*a, **k))
    monkeypatch.setattr(torch.Tensor, "addmm_",
                        lambda self, *a, **k: calls.append("addmm_") or real_addmm_(self, *a, **k))
    hidden, weight = torch.randn(10, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True)
    target = torch.randint(1, 7, (10,))
    with torch.no_grad():
        projected_label_smoothed_cross_entropy(hidden, weight, target, 0.1, PAD)
    assert calls == []
    projected_label_smoothed_cross_entropy(hidden, weight, target, 0.1, PAD)
    assert sorted(calls) == ["addmm_", "mm"]


def test_loss_module_matches_the_model_logits_and_their_autograd():
    # LossComputation never builds the logits; its loss and every parameter's gradient (the tied embedding matrix
    # gets both its embedding and its output-projection part) must equal the textbook loss on model(src, tgt_in).
    model = tiny_model(seed=6, dropout=0.0, attention_dropout=0.0).double()
    src = random_tokens(3, 7, 23, lengths=[7, 5, 2], seed=1)
    tgt = random_tokens(3, 6, 29, lengths=[6, 4, 3], seed=2)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    loss, nll = LossComputation(model, 0.1)(src, src.eq(PAD), tgt_in, tgt_out)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = model(src, tgt_in, src.eq(PAD))  # (batch, tgt_len, vocab)
    ref_loss, ref_nll = _autograd_reference(logits.flatten(0, 1), torch.eye(29, dtype=torch.double),  # logits @ I
                                            tgt_out.flatten(), 0.1)
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll.detach())
    for (name, _), ours, ref in zip(model.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(ours, ref, msg=name)
