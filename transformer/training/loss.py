"""Label-smoothed cross entropy that ignores padding (Vaswani et al. 2017, §5.4).

The smoothed target distribution of a position with reference y is q = (1 - ε)·onehot(y) + ε·u, where u is uniform
over the V - 1 tokens that are not pad (the reference included); padding gets probability zero, so the loss
does not depend on how much padding a batch has. The loss is -Σ_k q_k log p_k with p = softmax(z); positions whose
reference is pad contribute nothing.

Written as one autograd function because the textbook form (log_softmax, gather, sum) materialises several
`(n_tokens, vocab_size)` tensors in the backward pass; here the gradient p - q is built in one buffer. Padded
positions are masked rather than removed, so nothing waits for the device to count the real tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _LabelSmoothedCrossEntropy(torch.autograd.Function):
    """Summed loss and summed NLL over the rows of `logits` whose target is not pad."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, epsilon: float, pad_id: int) -> tuple[Tensor, Tensor]:
        vocab_size = logits.size(-1)
        keep = target.ne(pad_id).to(logits.dtype)  # (n,)
        lse = torch.logsumexp(logits, dim=-1)  # (n,)  log Σ_k exp z_k
        nll = lse - logits.gather(-1, target[:, None]).squeeze(-1)  # (n,)  -log p_y
        mean_non_pad = (logits.sum(-1) - logits[:, pad_id]) / (vocab_size - 1)
        smooth = lse - mean_non_pad  # (n,)  -mean_{k != pad} log p_k
        ctx.save_for_backward(logits, target, lse, keep)
        ctx.epsilon, ctx.pad_id = epsilon, pad_id
        nll_sum = (nll * keep).sum()
        ctx.mark_non_differentiable(nll_sum)
        return (((1.0 - epsilon) * nll + epsilon * smooth) * keep).sum(), nll_sum

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Any) -> tuple[Tensor, None, None, None]:
        logits, target, lse, keep = ctx.saved_tensors
        eps, pad_id = ctx.epsilon, ctx.pad_id
        uniform = eps / (logits.size(-1) - 1)
        grad = torch.exp(logits - lse[:, None])  # p, (n, vocab_size)
        grad.sub_(uniform)  # p - ε·u on every token ...
        grad[:, pad_id] += uniform  # ... but pad, which has q = 0
        grad.scatter_add_(-1, target[:, None], torch.full_like(lse[:, None], eps - 1.0))  # reference: -(1 - ε)
        return grad.mul_((keep * grad_loss)[:, None]), None, None, None


def label_smoothed_cross_entropy(logits: Tensor, target: Tensor, epsilon: float,
                                 pad_id: int) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed loss and summed negative log-likelihood over the non-pad targets.

    Args:
        logits: `(n, vocab_size)` unnormalised scores (half precision is computed in float32).
        target: `(n,)` LongTensor of reference ids; positions equal to pad_id are ignored.
        epsilon: ε_ls in [0, 1).
        pad_id: id of the padding token.

    Returns:
        (loss, nll): scalar tensors, sums over the non-pad positions (divide by their number for a
        per-token value); only `loss` carries a gradient.
    """
    if logits.dtype not in (torch.float32, torch.float64):  # e.g. bf16 logits under autocast
        logits = logits.float()
    return _LabelSmoothedCrossEntropy.apply(logits, target, epsilon, pad_id)
