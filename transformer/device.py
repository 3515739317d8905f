"""The torch device from a config or command-line name, the training precision for it (`precision: auto`), and
glibc's allocator set to reuse freed CPU memory (`reuse_freed_memory`, which the CLI calls at start)."""

from __future__ import annotations

import ctypes
import os
import platform
import time

import torch


class DeviceError(ValueError):
    """The device asked for is not available on this machine (or not a device name)."""


def resolve_device(name: str) -> torch.device:
    """ "auto" picks cuda, then mps, then cpu; any other name is checked to exist here.

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
        raise DeviceError(
            f"device {name!r} asked for, but CUDA is not available on this machine; use "
            "--device cpu (train: --set training.device=cpu)"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(
            f"device {name!r} asked for, but MPS is not available on this machine; use "
            "--device cpu (train: --set training.device=cpu)"
        )
    return device


def matmul_seconds(
    dtype: torch.dtype,
    device: torch.device,
    size: int = 1024,
    repeats: int = 5,
    budget_s: float = 0.2,
) -> float:
    """Best wall time (seconds) of one size x size x size matrix multiplication in `dtype`.

    Up to `repeats` timed products, after a warm-up one at size 256 (which loads the kernels); the repeats stop
    once `budget_s` seconds have been spent, so that a dtype this CPU computes slowly costs one product rather
    than six (bf16 without hardware support: about 2 s each at 1024^3 on an AVX2-only CPU).
    """

    def product(a: torch.Tensor, b: torch.Tensor) -> float:
        with torch.no_grad():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - start

    def operands(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(
            dtype
        )

    product(*operands(min(size, 256)))
    a, b = operands(size)
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        seconds = product(a, b)
        best, spent = min(best, seconds), spent + seconds
        if spent > budget_s:
            break
    return best


BF16_MIN_SPEEDUP = 1.25
"""`precision: auto` picks bf16 on a CPU only if a bf16 matmul is at least this much faster than an fp32 one."""


def resolve_precision(name: str, device: torch.device) -> tuple[str, str]:
    """The concrete training precision for `name` ("auto", "fp32", "bf16" or "fp16") on `device`.

    "auto" gives bf16 on a CUDA device that computes it natively (compute capability 8.0 and later: A100, H100, RTX
    30xx and later; older GPUs emulate it slowly) and fp32 on MPS. On a CPU it measures: bf16 autocast
    pays only where bf16 matrix multiplications are fast (AMX or AVX-512 BF16 units that the kernels use) and
    can be slower than fp32 elsewhere, so bf16 is chosen when a 1024^3 bf16 matmul is at least
    `BF16_MIN_SPEEDUP` times faster than fp32 (the measurement stops early where bf16 is emulated and slow).
    An explicit "bf16" on a
    CPU is kept, and measured so that the log can warn when it is slower than fp32 there (a GPU recipe run on such
    a CPU); on a GPU without native bf16 it is kept with a reason that says so. Any other name is returned as it is.

    Returns:
        (precision, reason): the precision, and a short explanation for the log.
    """
    if name == "bf16" and device.type == "cpu":
        speedup = matmul_seconds(torch.float32, device) / matmul_seconds(torch.bfloat16, device)
        if speedup < 1:
            return name, (
                f"as configured, but a bf16 matmul runs at {speedup:.2f}x fp32 on this CPU: "
                "training.precision: auto or fp32 would be faster"
            )
        return name, f"as configured (bf16 matmul {speedup:.2f}x fp32 on this CPU)"
    if name in ("bf16", "auto") and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        # Ampere and later compute bf16 natively; older GPUs only emulate it, slowly
        native = major >= 8
        where = f"CUDA device of compute capability {major}.{minor}"
        if name == "bf16":  # e.g. the WMT14 recipes' bf16 on a V100 or T4
            return name, (
                f"as configured ({where}, native bf16)"
                if native
                else f"as configured, but this {where} emulates bf16: training.precision: fp16 (with its "
                "gradient scaler) or fp32 would be faster"
            )
        return (
            ("bf16", f"{where} (native bf16)") if native else ("fp32", f"{where} (no native bf16)")
        )
    if name != "auto":
        return name, "as configured"
    if device.type != "cpu":
        return "fp32", f"{device.type} device"
    speedup = matmul_seconds(torch.float32, device) / matmul_seconds(torch.bfloat16, device)
    choice = "bf16" if speedup >= BF16_MIN_SPEEDUP else "fp32"
    return (
        choice,
        f"bf16 matmul {speedup:.2f}x fp32 on this CPU (bf16 needs >= {BF16_MIN_SPEEDUP}x)",
    )


MALLOC_ENV_VARS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "GLIBC_TUNABLES",
)
"""Environment variables by which a user tunes glibc's allocator; when one is set, `reuse_freed_memory` leaves it."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers, from glibc's <malloc.h>


def reuse_freed_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Make glibc keep freed CPU tensor memory for reuse instead of handing it back to the kernel.

    glibc serves every allocation above 32 MB (its largest dynamic `M_MMAP_THRESHOLD`) with a fresh `mmap` and
    returns it with `munmap` on free, so the next one faults in every 4 KB page again, zero-filled by the kernel. A
    training step can allocate tensors that large (the big WMT14 model's feed-forward activations: 3,584 tokens x
    4,096 x 4 bytes = 59 MB). With allocations up to `mmap_threshold` bytes (1 GiB) taken from the heap and
    the heap never trimmed, freed blocks are reused once the heap has settled (a few steps) and their pages stay
    mapped; the price is that the process keeps its peak heap until it exits. Outputs do not change (only where
    memory comes from). Measured effect: docs/training.md.

    Does nothing (returns False) off glibc, or when the user tunes the allocator through one of `MALLOC_ENV_VARS`.
    Process-wide: the CLI and the benchmark scripts call it once at start.

    Returns:
        True if the allocator settings were applied.
    """
    if platform.system() != "Linux" or any(name in os.environ for name in MALLOC_ENV_VARS):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc (musl has mallopt stubs that do nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped = mallopt(
        _M_MMAP_THRESHOLD, mmap_threshold
    )  # 1 on success, 0 if this glibc refuses the value
    trimmed = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    return bool(mapped and trimmed)
