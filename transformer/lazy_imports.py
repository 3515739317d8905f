"""Names a package exports but imports on first use (PEP 562), so that importing a torch-free part of the package
does not import torch through its `__init__`."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, homes: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`, which exports each name of `homes` from the module
    `homes[name]` (relative to `package`), imported when the name is first read and then kept in the package.

    Raises (from `__getattr__`):
        AttributeError: a name the package does not export.
    """

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return __getattr__, __dir__
