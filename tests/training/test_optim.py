import math

import pytest

from transformer.config import ConfigError, TrainingConfig
from transformer.training.optim import inverse_sqrt_lr, learning_rate


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


def _training(**kw):
    return TrainingConfig(**{"max_steps": 1000, "warmup_steps": 100, "lr_scale": 0.5, **kw})


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decaying_schedules_share_the_warmup_and_reach_zero_at_max_steps(schedule):
    t, d_model = _training(lr_schedule=schedule), 256
    peak = inverse_sqrt_lr(100, d_model, 100, 0.5)
    for step in (1, 50, 100):  # the paper's linear warm-up
        assert learning_rate(step, t, d_model) == pytest.approx(inverse_sqrt_lr(step, d_model, 100, 0.5))
    lrs = [learning_rate(s, t, d_model) for s in range(100, 1001)]
    assert lrs[0] == pytest.approx(peak)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))  # strictly decreasing after the peak
    assert lrs[-1] == 0.0
    halfway = learning_rate(550, t, d_model)
    assert halfway == pytest.approx(peak / 2)  # linear: half-way; cosine: cos(π/2) = 0 -> also half the peak
    quarter = learning_rate(325, t, d_model)
    expected = 0.75 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi / 4))
    assert quarter == pytest.approx(peak * expected)


def test_inverse_sqrt_schedule_ignores_max_steps():
    t = _training()
    assert learning_rate(5000, t, 256) == pytest.approx(inverse_sqrt_lr(5000, 256, 100, 0.5))


def test_decaying_schedule_needs_warmup_below_max_steps():
    with pytest.raises(ConfigError, match="training.warmup_steps"):
        _training(lr_schedule="linear", warmup_steps=1000)
    with pytest.raises(ConfigError, match="training.lr_schedule"):
        _training(lr_schedule="noam")
