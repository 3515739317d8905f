"""Adam and the learning-rate schedules: the paper's inverse square root with warm-up (Vaswani et al. 2017, §5.3),
and the same warm-up followed by a linear or cosine decay to zero at `training.max_steps` (for fixed budgets)."""

from __future__ import annotations

import math

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
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def learning_rate(step: int, training: TrainingConfig, d_model: int) -> float:
    """The learning rate of update `step` (counted from 1) under `training.lr_schedule`.

    All schedules warm up linearly for `training.warmup_steps` updates to the same peak,
    lr_scale · (d_model · warmup_steps)^-0.5, then:

    - "inverse_sqrt": decay with step^-0.5 (§5.3; `inverse_sqrt_lr`), never reaching zero;
    - "linear": decay linearly to zero at `training.max_steps`;
    - "cosine": decay along a half cosine to zero at `training.max_steps` (Loshchilov & Hutter 2017, no restarts).

    The decaying schedules anneal the weights over a known budget, which is what a short run needs: the last
    updates are small, so the final checkpoint is not a noisy snapshot of a high-learning-rate walk.

    Raises:
        ValueError: if step < 1.
    """
    warmup = training.warmup_steps
    if training.lr_schedule == "inverse_sqrt" or step <= warmup:
        return inverse_sqrt_lr(step, d_model, warmup, training.lr_scale)
    peak = inverse_sqrt_lr(warmup, d_model, warmup, training.lr_scale)
    progress = min(
        1.0, (step - warmup) / (training.max_steps - warmup)
    )  # in (0, 1]; warmup < max_steps (config)
    if training.lr_schedule == "linear":
        return peak * (1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: nn.Module, training: TrainingConfig, device: torch.device
) -> torch.optim.Adam:
    """Adam(β1=0.9, β2=0.98, ε=1e-9) by default (§5.3); weight decay (AdamW-style) off by default.

    Uses the fused implementation (one vectorised pass over all parameters) on CUDA and on CPUs, and the
    multi-tensor (foreach) one elsewhere; docs/training.md gives its measured effect.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device.type in ("cuda", "cpu")
    kwargs = dict(lr=0.0, betas=training.adam_betas, eps=training.adam_eps)
    if training.weight_decay > 0:
        return torch.optim.AdamW(
            params,
            weight_decay=training.weight_decay,
            fused=fused or None,
            foreach=None if fused else True,
            **kwargs,
        )
    return torch.optim.Adam(params, fused=fused or None, foreach=None if fused else True, **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
