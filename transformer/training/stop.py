"""When training stops early.

- Ctrl-C and SIGTERM: the request is remembered, the current update finishes, and the loop then saves `last.pt`
  and stops (`training_loop`), so that `--resume` continues exactly.
- Skipped updates: an update whose gradient is not finite is not applied (`train_step`); `count_skipped_update`
  logs it and stops the run after `training.max_nonfinite_steps` of them in a row.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any, Optional

import torch

from .checkpoint import TrainState

logger = logging.getLogger(__name__)

MIN_LOSS_SCALE = 1.0
"""Under fp16, overflows count toward `training.max_nonfinite_steps` only once the gradient scaler's loss scale has
fallen below this: above it an overflow is the scaler's search for a scale that fits fp16 (it halves the scale and
the update is retried on the next batch); below it the gradients overflow even unscaled."""

MAX_SCALE_SEARCH = 64
"""Skipped updates in a row after which every further fp16 skip counts, whatever the loss scale: halving 64 times
takes any scale a run reaches below `MIN_LOSS_SCALE`, so a longer series is not the scaler's search (for instance a
gradient whose elements are finite but whose norm is not, which leaves the scale as it is)."""


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


class TrainingInterrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving `checkpoints/last.pt`."""


class NonFiniteLossError(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


def count_skipped_update(
    state: TrainState,
    max_nonfinite_steps: int,
    scaler: Optional[torch.amp.GradScaler],
    last_checkpoint: Path,
) -> None:
    """Record an update that was skipped because its gradient was not finite.

    A skipped update is not a step: `state.step` (and so the learning-rate schedule, `max_steps` and the log,
    validation and save intervals) counts applied updates; `state.n_skipped_updates` counts the skipped ones. Under
    fp16 (`scaler` given, already updated for this skip) an overflow that leaves the loss scale at least
    `MIN_LOSS_SCALE` is logged and not counted toward the limit, unless `MAX_SCALE_SEARCH` updates in a row were
    skipped.

    Raises:
        NonFiniteLossError: after `max_nonfinite_steps` counted skips in a row (a run whose loss became NaN), naming
            the last good checkpoint.
    """
    state.n_skipped_updates += 1
    state.skipped_in_a_row += 1
    if (
        scaler is not None
        and scaler.get_scale() >= MIN_LOSS_SCALE
        and state.skipped_in_a_row <= MAX_SCALE_SEARCH
    ):
        logger.info(
            "step %d: fp16 gradient overflow, update skipped, loss scale lowered to %g",
            state.step + 1,
            scaler.get_scale(),
        )
        return
    state.nonfinite_in_a_row += 1
    logger.warning(
        "step %d: non-finite loss or gradient, update skipped (%d in a row)",
        state.step + 1,
        state.nonfinite_in_a_row,
    )
    if state.nonfinite_in_a_row >= max_nonfinite_steps:
        raise NonFiniteLossError(
            f"{state.nonfinite_in_a_row} updates in a row had a non-finite loss or gradient (limit "
            f"training.max_nonfinite_steps={max_nonfinite_steps}); the last good checkpoint is {last_checkpoint}. "
            "Try a lower training.lr_scale or training.clip_grad_norm: 1.0"
        )
