"""Choosing the torch device from a config or command-line name."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """"auto" picks cuda, then mps, then cpu; any other name is checked to exist here.

    Raises:
        ValueError: if the named device is not available on this machine.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available on this machine; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r} asked for, but MPS is not available on this machine; use --device cpu")
    return device
