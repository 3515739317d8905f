"""`training.precision: auto`: bf16 only where it measures faster, fp32 otherwise; `reuse_freed_memory`."""

import os
import platform
import subprocess
import sys

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


@pytest.mark.parametrize("capability, expected", [((7, 0), "fp32"), ((7, 5), "fp32"), ((8, 0), "bf16"),
                                                  ((9, 0), "bf16")])
def test_auto_on_a_gpu_takes_bf16_where_it_is_native(capability, expected, monkeypatch):
    """V100 (7.0) and T4 (7.5) emulate bf16 (torch.cuda.is_bf16_supported() says True there): fp32; A100 and later
    compute it: bf16. No GPU needed: the capability is what is asked."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    precision, reason = resolve_precision("auto", torch.device("cuda"))
    assert precision == expected and f"{capability[0]}.{capability[1]}" in reason


@pytest.mark.parametrize("capability, warns", [((7, 0), True), ((7, 5), True), ((8, 0), False), ((9, 0), False)])
def test_explicit_bf16_on_a_gpu_is_kept_with_a_warning_where_it_is_emulated(capability, warns, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    precision, reason = resolve_precision("bf16", torch.device("cuda"))
    assert precision == "bf16" and f"{capability[0]}.{capability[1]}" in reason
    assert ("would be faster" in reason) == warns


def test_auto_measures_this_cpu():
    precision, reason = resolve_precision("auto", torch.device("cpu"))
    assert precision in ("fp32", "bf16") and "bf16 matmul" in reason
    assert device_module.matmul_seconds(torch.float32, torch.device("cpu"), size=64, repeats=2) > 0


# --------------------------------------------------------------------------------------------------
# reuse_freed_memory: glibc keeps large freed blocks mapped, so reallocating them does not fault pages in.
# --------------------------------------------------------------------------------------------------

_FAULTS_SCRIPT = """
import resource, torch
from transformer.device import reuse_freed_memory
def step():  # a 40 MB result, freed at once: above glibc's 32 MB mmap ceiling
    return (torch.ones(2560, 4096) * 2.0).sum().item()
def fault_ratio():  # page faults per page allocated, once the heap has settled (a few steps)
    for _ in range(10):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (4 * 2 * 2560 * 4096 * 4 // 4096)
system = fault_ratio()
applied = reuse_freed_memory()
print(system, applied, fault_ratio())
"""


GLIBC_ONLY = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc only (elsewhere reuse_freed_memory does nothing)")


@GLIBC_ONLY
def test_reuse_freed_memory_stops_large_tensors_from_faulting_their_pages_again():
    # A fresh process: this one may already have called it (the CLI tests run `transformer.cli.main` here).
    environment = {k: v for k, v in os.environ.items() if k not in device_module.MALLOC_ENV_VARS}
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], capture_output=True, text=True, check=True,
                         env=dict(environment, OMP_NUM_THREADS="1")).stdout.split()
    system, applied, reused = float(out[0]), out[1] == "True", float(out[2])
    assert system > 0.9  # glibc alone: every page of every 40 MB tensor is faulted in again
    assert applied
    # kept mapped: most are not (an occasional other allocation faults one tensor's pages, 1/8 of the count)
    assert reused < 0.3


@GLIBC_ONLY
def test_reuse_freed_memory_leaves_an_allocator_the_user_tuned(monkeypatch):
    for name in device_module.MALLOC_ENV_VARS:
        with monkeypatch.context() as patch:
            patch.setenv(name, "131072")
            assert device_module.reuse_freed_memory() is False
