"""Label-smoothed cross entropy that ignores padding (Vaswani et al. 2017, §5.4).

The smoothed target distribution of a position with reference y is q = (1 - ε)·onehot(y) + ε·u, where u is uniform
over the V - 1 tokens that are not pad (the reference included); padding gets probability zero, so the loss
does not depend on how much padding a batch has. The loss is -Σ_k q_k log p_k with p = softmax(z); positions whose
reference is pad contribute nothing.

Written as one autograd function together with the output projection, for speed and memory: the textbook form
(logits = hidden Wᵀ, then log_softmax, gather, sum, and autograd through each) writes the whole
`(n_tokens, vocab_size)` logits tensor, its log-probabilities and its gradient, and makes several passes over
each (116 MB per tensor for a 3.6k-token batch with an 8k vocabulary; 3.7 GB for a 25k-token WMT14 batch with 37k).
Here the rows are processed in chunks that stay in cache: per chunk, one matrix product gives the logits, one
`log_softmax` gives the loss terms, and since the loss is the end of the graph, the gradient p - q is built in the
same pass and multiplied out at once into the gradients of the hidden states (`(p - q) W`) and of the weight
(`(p - q)ᵀ hidden`, accumulated over the chunks); backward only scales them. No logits tensor is ever whole.
Padded positions are masked rather than removed, so nothing waits for the device to count the real tokens.
Under autocast the matrix products run in the autocast dtype (bf16, fp16) and the softmax in float32.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..config import PAD_ID
from ..data import Batch
from ..model import Transformer

CHUNK_ROWS = 256
"""Rows handled at a time on a CPU: 256 x 8k vocabulary x 4 bytes = 8 MB of float32 logits, about a CPU's L2 + L3
share."""

GPU_CHUNK_ELEMENTS = 2**25
"""Logits handled at a time on a GPU (128 MB in float32): fewer, larger kernels, where cache size does not matter
and each chunk costs a dozen kernel launches."""


def chunk_rows(device_type: str, vocab_size: int) -> int:
    """Rows of logits computed at a time: `CHUNK_ROWS` on a CPU, `GPU_CHUNK_ELEMENTS / vocab_size` elsewhere (4,096
    rows with an 8k vocabulary, 906 with 37k). The results do not depend on it beyond float rounding."""
    if device_type == "cpu":
        return CHUNK_ROWS
    return max(CHUNK_ROWS, GPU_CHUNK_ELEMENTS // vocab_size)


class _ProjectedLabelSmoothedCrossEntropy(torch.autograd.Function):
    """Summed loss and summed NLL of softmax(hidden Wᵀ + b) over the rows whose target is not pad."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        target: Tensor,
        epsilon: float,
        pad_id: int,
        matmul_dtype: torch.dtype,
        wants_grad: bool,
        rows_per_chunk: int,
    ) -> tuple[Tensor, Tensor]:
        n, vocab_size = hidden.size(0), weight.size(0)
        uniform = epsilon / (vocab_size - 1)  # q_k of every token but the reference and pad
        compute_dtype = torch.promote_types(
            matmul_dtype, torch.float32
        )  # the softmax never in half precision
        h, w = (
            hidden.to(matmul_dtype),
            weight.to(matmul_dtype),
        )  # (n, d_model), (vocab_size, d_model)
        keep = target.ne(pad_id).to(compute_dtype)  # (n,)
        grad_hidden = torch.empty_like(h) if wants_grad and ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=compute_dtype, device=weight.device)
            if wants_grad and ctx.needs_input_grad[1]
            else None
        )
        b = None if bias is None else bias.to(compute_dtype)
        grad_bias = (
            torch.zeros_like(b)
            if b is not None and wants_grad and ctx.needs_input_grad[2]
            else None
        )
        loss = torch.zeros((), dtype=compute_dtype, device=hidden.device)
        nll_sum = torch.zeros((), dtype=compute_dtype, device=hidden.device)
        for start in range(0, n, rows_per_chunk):
            rows = slice(start, start + rows_per_chunk)
            y, k, h_rows = target[rows, None], keep[rows], h[rows]
            logits = h_rows @ w.t()  # (rows, vocab_size)
            logits = logits if b is None else logits + b
            log_p = torch.log_softmax(logits, dim=-1, dtype=compute_dtype)
            nll = -log_p.gather(-1, y).squeeze(-1)  # -log p_y
            smooth = -(log_p.sum(-1) - log_p[:, pad_id]) / (
                vocab_size - 1
            )  # -mean_{k != pad} log p_k
            loss += (((1.0 - epsilon) * nll + epsilon * smooth) * k).sum()
            nll_sum += (nll * k).sum()
            if grad_hidden is None and grad_weight is None and grad_bias is None:
                continue
            g = log_p.exp_()  # dL/dlogits = p - q on kept rows, 0 on pad rows: first p,
            g.sub_(uniform)  # p - ε·u on every token ...
            g[:, pad_id] += uniform  # ... but pad, which has q = 0
            g.scatter_add_(
                -1, y, torch.full_like(k[:, None], epsilon - 1.0)
            )  # reference: q = 1 - ε + ε·u
            g = g.mul_(k[:, None])
            if grad_bias is not None:
                grad_bias += g.sum(0)
            g = g.to(matmul_dtype)
            if grad_hidden is not None:
                torch.mm(g, w, out=grad_hidden[rows])  # (rows, d_model)
            if grad_weight is not None:
                if matmul_dtype == compute_dtype:
                    grad_weight.addmm_(g.t(), h_rows)  # (vocab_size, d_model)
                else:  # summed over the chunks in float32
                    grad_weight += (g.t() @ h_rows).to(compute_dtype)
        # Intermediates, not inputs or outputs: kept as attributes.
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(nll_sum)
        return loss, nll_sum

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Any) -> tuple[Any, ...]:
        grads = [
            None if g is None else g.to(dtype) * grad_loss.to(dtype)
            for g, dtype in zip(ctx.grads, ctx.dtypes)
        ]
        return grads[0], grads[1], grads[2], None, None, None, None, None, None


# torch.compile (training.compile) would recompile the chunk loop for every batch's row count, up to its limit: it
# compiles the model and leaves this function, a few large matrix products per batch, to run as written.
@torch.compiler.disable
def projected_label_smoothed_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    epsilon: float,
    pad_id: int,
    bias: Optional[Tensor] = None,
    rows_per_chunk: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed loss and summed negative log-likelihood of logits = hidden Wᵀ + b over the non-pad
    targets, without building the logits of all rows at once (see the module docstring).

    Args:
        hidden: `(n, d_model)` decoder outputs (float32, or half precision).
        weight: `(vocab_size, d_model)` the output projection W, e.g. the tied embedding matrix.
        target: `(n,)` LongTensor of reference ids; positions equal to pad_id are ignored.
        epsilon: ε_ls in [0, 1).
        pad_id: id of the padding token.
        bias: `(vocab_size,)` the output projection's bias b, or None.
        rows_per_chunk: rows of logits computed at a time (default `chunk_rows` for the device).

    Returns:
        (loss, nll): scalar tensors, sums over the non-pad positions (divide by their number for a
        per-token value); only `loss` carries a gradient (to `hidden`, `weight` and `bias`). The products run in the
        autocast dtype when autocast is on, else in the promoted dtype of the inputs; the softmax and the sums in
        float32 at least.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        matmul_dtype = torch.get_autocast_dtype(device_type)
    else:
        matmul_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    # Grad mode is off inside forward, and needs_input_grad is set even under no_grad: decide here.
    wants_grad = torch.is_grad_enabled()
    with torch.autocast(device_type, enabled=False):  # the function casts by itself
        return _ProjectedLabelSmoothedCrossEntropy.apply(
            hidden,
            weight,
            bias,
            target,
            epsilon,
            pad_id,
            matmul_dtype,
            wants_grad,
            rows_per_chunk or chunk_rows(device_type, weight.size(0)),
        )


class LossComputation(nn.Module):
    """The Transformer and its training loss as one module: what DistributedDataParallel and torch.compile wrap.

    The loss is computed at every target position and masks padding (selecting the real positions
    first saves about as much as the selection costs, and needs a device sync on CUDA).

    Args:
        model: the Transformer.
        label_smoothing: ε_ls.
    """

    def __init__(self, model: Transformer, label_smoothing: float) -> None:
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing

    def forward(
        self, src: Tensor, src_key_padding_mask: Tensor, tgt_in: Tensor, tgt_out: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Args: src, src_key_padding_mask `(batch, src_len)`; tgt_in, tgt_out `(batch, tgt_len)`.

        Returns:
            Summed label-smoothed loss and summed NLL over the non-pad targets (scalars).
        """
        hidden = self.model.hidden_states(
            src, tgt_in, src_key_padding_mask
        )  # (batch, tgt_len, d_model)
        projection = self.model.output_projection
        return projected_label_smoothed_cross_entropy(
            hidden.flatten(0, 1),
            projection.weight,
            tgt_out.flatten(),
            self.label_smoothing,
            PAD_ID,
            projection.bias,
        )


def batch_loss(module: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
    """Summed loss and NLL of one batch through a `LossComputation` (or its DDP/compiled wrapper)."""
    return module(batch.src, batch.src_key_padding_mask, batch.tgt_in, batch.tgt_out)
