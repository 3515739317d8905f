"""`training.precision: auto`: bf16 only where it measures faster, fp32 otherwise."""

import pytest
import torch

from transformer import device as device_module
from transformer.device import BF16_MIN_SPEEDUP, resolve_precision


@pytest.mark.parametrize("name", ["fp32", "fp16"])
def test_a_concrete_precision_is_kept(name, monkeypatch):
    monkeypatch.setattr(device_module, "matmul_seconds", lambda *a, **k: pytest.fail("measured a fixed precision"))
    assert resolve_precision(name, torch.device("cpu"))[0] == name


@pytest.mark.parametrize("bf16_speedup, warns", [(0.01, True), (0.9, True), (1.6, False)])
def test_explicit_bf16_on_a_cpu_is_kept_with_a_warning_where_it_is_slow(bf16_speedup, warns, monkeypatch):
    seconds = {torch.float32: 1.0, torch.bfloat16: 1.0 / bf16_speedup}
    monkeypatch.setattr(device_module, "matmul_seconds", lambda dtype, device, **k: seconds[dtype])
    precision, reason = resolve_precision("bf16", torch.device("cpu"))
    assert precision == "bf16" and f"{bf16_speedup:.2f}x" in reason
    assert ("would be faster" in reason) == warns


@pytest.mark.parametrize("bf16_speedup, expected", [(0.5, "fp32"), (BF16_MIN_SPEEDUP * 0.95, "fp32"),
                                                    (BF16_MIN_SPEEDUP * 1.05, "bf16"), (4.0, "bf16")])
def test_auto_on_a_cpu_follows_the_measured_bf16_speedup(bf16_speedup, expected, monkeypatch):
    seconds = {torch.float32: 1.0, torch.bfloat16: 1.0 / bf16_speedup}
    monkeypatch.setattr(device_module, "matmul_seconds", lambda dtype, device, **k: seconds[dtype])
    precision, reason = resolve_precision("auto", torch.device("cpu"))
    assert precision == expected
    assert f"{bf16_speedup:.2f}x" in reason


def test_auto_measures_this_cpu():
    precision, reason = resolve_precision("auto", torch.device("cpu"))
    assert precision in ("fp32", "bf16") and "bf16 matmul" in reason
    assert device_module.matmul_seconds(torch.float32, torch.device("cpu"), size=64, repeats=2) > 0
