"""Checkpoint averaging (Vaswani et al. 2017, §6.1: "we used a single model obtained by averaging the last 5
checkpoints, which were written at 10-minute intervals"; the last 20 for big models).

`average_checkpoints(paths)` returns a checkpoint whose floating-point parameters and buffers are the element-wise
mean of the inputs', accumulated in float64 in the order given and stored in each tensor's original dtype. It keeps
the config, vocabulary sizes and tokenizer (identical in every input, or the inputs are refused) and the newest
input's `train_state`, lists its inputs under `averaged_from`, and holds no optimizer or RNG state. It loads with
`torch.load(weights_only=True)` like any checkpoint and works with translate, evaluate and attention.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def step_checkpoints(run_dir: str | Path) -> list[Path]:
    """`run_dir/checkpoints/step_N.pt`, sorted by N (oldest first)."""
    folder = Path(run_dir) / "checkpoints"
    found = [
        (int(m.group(1)), p)
        for p in folder.glob("step_*.pt")
        if (m := re.fullmatch(r"step_(\d+)\.pt", p.name))
    ]
    return [p for _, p in sorted(found)]


def last_checkpoints(run_dir: str | Path, n: int) -> list[Path]:
    """The n most recent step checkpoints of a run (by step, oldest first).

    Raises:
        CheckpointError: fewer than n are there (naming those found and `training.keep_last_checkpoints`).
    """
    if n < 1:
        raise CheckpointError(f"--last must be at least 1, got {n}")
    found = step_checkpoints(run_dir)
    if len(found) < n:
        names = ", ".join(p.name for p in found) or "none"
        raise CheckpointError(
            f"{Path(run_dir) / 'checkpoints'}: {n} step checkpoints asked for, {len(found)} found "
            f"({names}); a run keeps its last training.keep_last_checkpoints step checkpoints, "
            "written every training.save_every_steps updates: ask for fewer, or name files with "
            "--checkpoints"
        )
    return found[-n:]


def average_checkpoints(paths: list[str | Path]) -> dict[str, Any]:
    """The average of several checkpoints of one model (see the module docstring).

    Raises:
        CheckpointError: no path, a missing or corrupt file, or inputs whose model config, vocabulary sizes,
            tokenizer or parameter names/shapes differ from the first's (naming both files).
    """
    if not paths:
        raise CheckpointError("no checkpoint to average")
    paths = [Path(p) for p in paths]
    for path in paths:
        if path.is_dir():
            raise CheckpointError(
                f"{path} is a folder: average takes .pt checkpoints of one run (e.g. "
                "RUN/checkpoints/step_*.pt, or --run-dir RUN); a MarianMT or CTranslate2 folder "
                "cannot be averaged"
            )
    first = load_checkpoint(paths[0])
    sums = {
        name: t.to(torch.float64) for name, t in first["model"].items() if t.is_floating_point()
    }
    newest = first
    for path in paths[1:]:
        state = load_checkpoint(path)
        _check_compatible(paths[0], first, path, state)
        for name in sums:
            sums[name] += state["model"][name].to(torch.float64)
        if state.get("train_state", {}).get("step", -1) > newest.get("train_state", {}).get(
            "step", -1
        ):
            newest = state
    model: dict[str, torch.Tensor] = {}
    shared: dict[
        int, torch.Tensor
    ] = {}  # tied weights (one storage, several names) stay one tensor
    for name, t in first["model"].items():
        if t.data_ptr() not in shared:
            shared[t.data_ptr()] = (
                (sums[name] / len(paths)).to(t.dtype) if name in sums else t.clone()
            )
        model[name] = shared[t.data_ptr()]
    return {
        "model": model,
        "config": first["config"],
        "vocab_sizes": first["vocab_sizes"],
        "tokenizer": first["tokenizer"],
        "train_state": newest.get("train_state", {}),
        "averaged_from": [str(p) for p in paths],
    }


def _check_compatible(
    first_path: Path, first: dict[str, Any], path: Path, state: dict[str, Any]
) -> None:
    def refuse(what: str) -> None:
        raise CheckpointError(f"cannot average {path} with {first_path}: {what}")

    a, b = first["config"]["model"], state["config"]["model"]
    if a != b:
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        refuse(
            "different model configs ("
            + ", ".join(f"model.{k}: {b.get(k)!r} vs {a.get(k)!r}" for k in keys)
            + ")"
        )
    if list(first["vocab_sizes"]) != list(state["vocab_sizes"]):
        refuse(f"different vocabulary sizes ({state['vocab_sizes']} vs {first['vocab_sizes']})")
    if first["tokenizer"] != state["tokenizer"]:
        refuse(
            "different sentencepiece models (trained separately: the same ids mean different pieces)"
        )
    shapes_a = {k: tuple(t.shape) for k, t in first["model"].items()}
    shapes_b = {k: tuple(t.shape) for k, t in state["model"].items()}
    if shapes_a != shapes_b:
        refuse("different parameter names or shapes")


def average_to_file(paths: list[str | Path], output: str | Path) -> dict[str, Any]:
    """Average `paths` and write the result atomically to `output`; returns it.

    Raises:
        CheckpointError: as `average_checkpoints`, and before any work when `output` exists and is not an earlier
            average (a trained checkpoint such as best.pt, or any other file, is never overwritten; an earlier
            average is replaced, so that `make evaluate` can run again).
    """
    output = Path(output)
    if output.exists() and not _is_average(output):
        kind = (
            "a folder"
            if output.is_dir()
            else "a file other than an averaged checkpoint (it would be overwritten)"
        )
        raise CheckpointError(
            f"--output {output}: exists and is {kind}: choose another file, or remove it first"
        )
    averaged = average_checkpoints(paths)
    save_checkpoint(averaged, output)
    return averaged


def _is_average(path: Path) -> bool:
    try:
        return "averaged_from" in load_checkpoint(path)
    except CheckpointError:
        return False
