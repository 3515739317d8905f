"""A faster dropout for training on the CPU, swapped into the readable model by `use_fast_cpu_dropout`.

The model's layers use `nn.Dropout` (Srivastava et al. 2014; the Transformer's P_drop, Vaswani et al. 2017 §5.4),
whose CPU mask `torch.nn.functional.dropout` draws with `bernoulli_`: one 32-bit Mersenne-Twister number per
element, converted and compared one at a time on one thread, a noticeable share of a CPU training step
(docs/training.md). Here the mask comes from 16 random bits per element instead: one 64-bit draw
gives four elements, and the comparison runs vectorised. Element i is kept when its 16 bits, read as a signed
integer r_i, satisfy r_i >= round(p * 65536) - 32768, i.e. with probability 1 - round(p * 65536) / 65536: the
drop rate is p rounded to a multiple of 1/65,536 (0.1 becomes 0.1000061). Kept elements are scaled by
1 / (1 - p) ("inverted dropout", as in PyTorch). The random bits come from torch's default generator, so
`torch.manual_seed` and the RNG state saved in checkpoints (exact resume) cover them.

On other devices (CUDA, MPS) `F.dropout` is used unchanged: its fused kernels are already fast there, and the
training code swaps this module in on the CPU only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..model.attention import MultiHeadAttention

_INT64_MIN = -(2**63)


def _check_probability(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")


def keep_mask(
    shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str | None = None
) -> Tensor:
    """A random bool mask that is True (keep) with probability 1 - p, from 16 random bits per element.

    Args:
        shape: the mask's shape.
        p: drop probability, in [0, 1); used rounded to a multiple of 1/65,536.
        device: where to draw it.

    Returns:
        bool tensor of `shape`, each element independently True with probability 1 - round(p * 65536) / 65536.
    """
    n = math.prod(shape)
    # random_(INT64_MIN, None) fills all 64 bits uniformly; viewed as int16, four independent 16-bit numbers.
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(_INT64_MIN, None)
    r = bits.view(torch.int16)[:n].view(shape)
    return r >= round(p * 65536) - 32768


class _MaskedScale(torch.autograd.Function):
    """y = x * keep / (1 - p); the gradient goes through the same mask and scale."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, keep: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.where(keep, x * scale, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad * ctx.scale, 0.0), None, None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout: zero each element with probability p and scale the others by 1 / (1 - p).

    Args:
        x: any shape, e.g. `(batch, len, d_model)` or attention weights `(batch, n_heads, q_len, k_len)`.
        p: drop probability in [0, 1).
        training: apply it (False, or p == 0: return x unchanged).

    Returns:
        a tensor like x. On CPU the mask comes from `keep_mask` (module docstring); elsewhere from `F.dropout`.

    Raises:
        ValueError: p outside [0, 1).
    """
    _check_probability(p)
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    return _MaskedScale.apply(x, keep_mask(x.shape, p, x.device), 1.0 / (1.0 - p))


class FastCPUDropout(nn.Dropout):
    """`nn.Dropout` with the faster CPU mask of `dropout` (module docstring); identity in eval mode.

    Args:
        p: drop probability in [0, 1).

    Raises:
        ValueError: p outside [0, 1).
    """

    def __init__(self, p: float) -> None:
        _check_probability(p)
        super().__init__(p)

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


def use_fast_cpu_dropout(model: nn.Module) -> None:
    """Swap the faster CPU dropout into `model`, in place: what the training code calls before training on the CPU.

    Every `nn.Dropout` becomes a `FastCPUDropout` of the same rate (and training mode), and every
    `MultiHeadAttention` takes its explicit path when it drops attention weights (`explicit_dropout`), so that
    they go through this kernel too: `F.scaled_dot_product_attention` draws its CPU dropout mask with `bernoulli_`,
    several times slower. Parameters, buffers and the state_dict are unchanged (dropout has none), and so is
    evaluation (dropout is off there).

    Args:
        model: a module holding `nn.Dropout` and `MultiHeadAttention` modules, e.g. a `Transformer`.
    """
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Dropout:
                setattr(module, name, FastCPUDropout(child.p).train(child.training))
        if isinstance(module, MultiHeadAttention):
            module.explicit_dropout = True
