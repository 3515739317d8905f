import math

import pytest

from transformer.training.optim import inverse_sqrt_lr


def test_schedule_follows_the_formula():
    d_model, warmup = 512, 4000
    for step in (1, 10, 3999, 4000, 4001, 10_000, 100_000):
        expected = d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
        assert inverse_sqrt_lr(step, d_model, warmup) == pytest.approx(expected, rel=1e-12)
    # Linear warm-up, peak at warmup_steps, inverse square-root decay after it.
    assert inverse_sqrt_lr(2000, d_model, warmup) == pytest.approx(inverse_sqrt_lr(4000, d_model, warmup) / 2)
    assert inverse_sqrt_lr(4000, d_model, warmup) == pytest.approx((d_model * warmup) ** -0.5)
    assert inverse_sqrt_lr(16_000, d_model, warmup) == pytest.approx(inverse_sqrt_lr(4000, d_model, warmup) / 2)
    assert inverse_sqrt_lr(100, 256, 500, scale=2.0) == pytest.approx(2 * 256 ** -0.5 * 100 * 500 ** -1.5)
    assert math.isclose(inverse_sqrt_lr(4000, 512, 4000), 0.000698771, rel_tol=1e-5)  # the paper's base peak


def test_schedule_rejects_step_zero():
    with pytest.raises(ValueError):
        inverse_sqrt_lr(0, 512, 4000)
