"""Ctrl-C and SIGTERM during training: the request is remembered, the current update finishes, and the loop then
saves `last.pt` and stops (`training_loop`), so that `--resume` continues exactly."""

from __future__ import annotations

import signal
from typing import Any, Optional


class StopRequest:
    """SIGINT/SIGTERM handler while training (a context manager): `signal_name` is None until a signal arrives,
    then its name ("SIGINT"). The previous handlers come back on exit. Outside the main thread it does nothing."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not in the main thread
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
