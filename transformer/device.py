"""Choosing the torch device from a config or command-line name, and the training precision for it."""

from __future__ import annotations

import time

import torch


class DeviceError(ValueError):
    """The device asked for is not available on this machine (or not a device name)."""


def resolve_device(name: str) -> torch.device:
    """"auto" picks cuda, then mps, then cpu; any other name is checked to exist here.

    Raises:
        DeviceError: if the named device is not available on this machine, or not a device name.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r}: expected auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} asked for, but CUDA is not available on this machine; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {name!r} asked for, but MPS is not available on this machine; use --device cpu")
    return device


def matmul_seconds(dtype: torch.dtype, device: torch.device, size: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` wall time (seconds) of one size x size x size matrix multiplication in `dtype`."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first call warms up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
    return best


BF16_MIN_SPEEDUP = 1.25
"""`precision: auto` picks bf16 on a CPU only if a bf16 matmul is at least this much faster than an fp32 one."""


def resolve_precision(name: str, device: torch.device) -> tuple[str, str]:
    """The concrete training precision for `name` ("auto", "fp32", "bf16" or "fp16") on `device`.

    "auto" gives bf16 on a CUDA device that supports it and fp32 on MPS. On a CPU it measures: bf16 autocast
    pays only where bf16 matrix multiplications are fast (AMX or AVX-512 BF16 units that the kernels use); on
    others it is slower than fp32 (measured 0.5x on an Intel Xeon with AVX-512 BF16 but no AMX, 1.6x on an
    AMD Zen 4), so bf16 is chosen when a 1024^3 bf16 matmul is at least `BF16_MIN_SPEEDUP` times faster than
    fp32 (about 0.1 s to measure). An explicit "bf16" on a CPU is kept, and measured so that the log can warn when
    it is slower than fp32 there (a GPU recipe run on such a CPU). Any other name is returned as it is.

    Returns:
        (precision, reason): the precision, and a short explanation for the log.
    """
    if name == "bf16" and device.type == "cpu":
        speedup = matmul_seconds(torch.float32, device) / matmul_seconds(torch.bfloat16, device)
        if speedup < 1:
            return name, (f"as configured, but a bf16 matmul runs at {speedup:.2f}x fp32 on this CPU: "
                          "training.precision: auto or fp32 would be faster")
        return name, f"as configured (bf16 matmul {speedup:.2f}x fp32 on this CPU)"
    if name != "auto":
        return name, "as configured"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "CUDA device with bf16 support"
        return "fp32", "CUDA device without bf16 support"
    if device.type != "cpu":
        return "fp32", f"{device.type} device"
    speedup = matmul_seconds(torch.float32, device) / matmul_seconds(torch.bfloat16, device)
    choice = "bf16" if speedup >= BF16_MIN_SPEEDUP else "fp32"
    return choice, f"bf16 matmul {speedup:.2f}x fp32 on this CPU (bf16 needs >= {BF16_MIN_SPEEDUP}x)"
