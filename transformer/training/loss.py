"""Label-smoothed cross entropy that ignores padding (Vaswani et al. 2017, §5.4).

The smoothed target distribution of a position with reference y is q = (1 - ε)·onehot(y) + ε·u, where u is uniform
over the V - 1 tokens that are not pad (the reference included); padding gets probability zero, so the loss
does not depend on how much padding a batch has. The loss is -Σ_k q_k log p_k with p = softmax(z); positions whose
reference is pad contribute nothing.

Written as one autograd function, for speed: the textbook form (log_softmax, gather, sum, then autograd through
each) makes several full passes over the `(n_tokens, vocab_size)` logits, which with an 8k vocabulary took a fifth
of a CPU training step. Here the rows are processed in chunks that stay in cache: one `log_softmax` per chunk gives
the loss terms, and since the loss is the end of the graph, the gradient p - q is built in the same pass and kept
for backward (which only scales it). Padded positions are masked rather than removed, so nothing waits for the
device to count the real tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..config import PAD_ID
from ..data import Batch
from ..model import Transformer

CHUNK_ROWS = 256
"""Rows of logits handled at a time: 256 x 8k vocabulary x 4 bytes = 8 MB of float32, about a CPU's L2 + L3 share."""


class _LabelSmoothedCrossEntropy(torch.autograd.Function):
    """Summed loss and summed NLL over the rows of `logits` whose target is not pad."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, epsilon: float, pad_id: int) -> tuple[Tensor, Tensor]:
        n, vocab_size = logits.shape
        uniform = epsilon / (vocab_size - 1)  # q_k of every token but the reference and pad
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)  # half precision is computed in fp32
        keep = target.ne(pad_id).to(compute_dtype)  # (n,)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        loss = torch.zeros((), dtype=compute_dtype, device=logits.device)
        nll_sum = torch.zeros((), dtype=compute_dtype, device=logits.device)
        for start in range(0, n, CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            y, k = target[rows, None], keep[rows]
            log_p = torch.log_softmax(logits[rows], dim=-1, dtype=compute_dtype)  # (rows, vocab_size)
            nll = -log_p.gather(-1, y).squeeze(-1)  # -log p_y
            smooth = -(log_p.sum(-1) - log_p[:, pad_id]) / (vocab_size - 1)  # -mean_{k != pad} log p_k
            loss += (((1.0 - epsilon) * nll + epsilon * smooth) * k).sum()
            nll_sum += (nll * k).sum()
            if grad is not None:  # dL/dz = p - q on kept rows, 0 on pad rows
                g = log_p.exp_()  # p
                g.sub_(uniform)  # p - ε·u on every token ...
                g[:, pad_id] += uniform  # ... but pad, which has q = 0
                g.scatter_add_(-1, y, torch.full_like(k[:, None], epsilon - 1.0))  # reference: q = 1 - ε + ε·u
                grad[rows] = g.mul_(k[:, None])
        ctx.grad = grad  # an intermediate, not an input or output: kept as an attribute
        ctx.mark_non_differentiable(nll_sum)
        return loss, nll_sum

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Any) -> tuple[Tensor, None, None, None]:
        return ctx.grad * grad_loss.to(ctx.grad.dtype), None, None, None


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
    return _LabelSmoothedCrossEntropy.apply(logits, target, epsilon, pad_id)


class LossComputation(nn.Module):
    """The Transformer and its training loss as one module: what DistributedDataParallel and torch.compile wrap.

    Logits are computed at every target position and the loss masks padding (selecting the real positions
    first saves about as much as the selection costs, and needs a device sync on CUDA).

    Args:
        model: the Transformer.
        label_smoothing: ε_ls.
    """

    def __init__(self, model: Transformer, label_smoothing: float) -> None:
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing

    def forward(self, src: Tensor, src_key_padding_mask: Tensor, tgt_in: Tensor,
                tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        """Args: src, src_key_padding_mask `(batch, src_len)`; tgt_in, tgt_out `(batch, tgt_len)`.

        Returns:
            Summed label-smoothed loss and summed NLL over the non-pad targets (scalars).
        """
        logits = self.model(src, tgt_in, src_key_padding_mask)  # (batch, tgt_len, tgt_vocab_size)
        return label_smoothed_cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), self.label_smoothing, PAD_ID)


def batch_loss(module: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
    """Summed loss and NLL of one batch through a `LossComputation` (or its DDP/compiled wrapper)."""
    return module(batch.src, batch.src_key_padding_mask, batch.tgt_in, batch.tgt_out)
