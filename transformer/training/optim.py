"""Adam and the inverse-square-root learning-rate schedule with warm-up (Vaswani et al. 2017, §5.3)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainingConfig


def inverse_sqrt_lr(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """lr = scale · d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5) (§5.3).

    Rises linearly for warmup_steps updates, peaks at scale · (d_model · warmup_steps)^-0.5, then decays
    with the inverse square root of the step.

    Args:
        step: the update about to be made, counted from 1.
        d_model: model width.
        warmup_steps: warm-up length in updates (> 0).
        scale: the constant factor (1.0 in the paper).

    Raises:
        ValueError: if step < 1 or warmup_steps < 1.
    """
    if step < 1 or warmup_steps < 1:
        raise ValueError(f"step ({step}) and warmup_steps ({warmup_steps}) must be >= 1")
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def build_optimizer(model: nn.Module, training: TrainingConfig, device: torch.device) -> torch.optim.Adam:
    """Adam(β1=0.9, β2=0.98, ε=1e-9) by default (§5.3); weight decay (AdamW-style) off by default.

    Uses the fused implementation on CUDA and the multi-tensor (foreach) one elsewhere.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    kwargs = dict(lr=0.0, betas=training.adam_betas, eps=training.adam_eps)
    if training.weight_decay > 0:
        return torch.optim.AdamW(params, weight_decay=training.weight_decay, fused=fused or None,
                                 foreach=None if fused else True, **kwargs)
    return torch.optim.Adam(params, fused=fused or None, foreach=None if fused else True, **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
