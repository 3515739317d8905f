"""The checkpoint format of a training run: what is saved, where, and how a run resumes from it.

Every checkpoint is one dict of plain data and tensors (written atomically by `transformer.checkpoint`):

    model        state_dict of the Transformer
    config       the run's config as a plain dict (`Config.to_dict()`; `training.precision: auto` resolved)
    vocab_sizes  [src_vocab_size, tgt_vocab_size]
    tokenizer    {"src": bytes, "tgt": bytes or None}: serialized sentencepiece models; an imported vocabulary
                 adds "vocab" (the piece of each id, see `Tokenizer`)
    train_state  `TrainState` as a dict: the position (step, epoch, batch_in_epoch), best_bleu, counters
    optimizer    optimizer state_dict                                  (last.pt and step_N.pt, not best.pt)
    rng          {"torch", "python", "cuda"}: RNG states; "cuda" is the  (last.pt and step_N.pt, not best.pt)
                 training GPU's generator state, None off CUDA
    grad_scaler  fp16 runs: the GradScaler's state_dict (loss scale)   (last.pt and step_N.pt, not best.pt)

Files in `run_dir/checkpoints/`: `last.pt` (after every validation, every `save_every_steps`, and on SIGINT),
`best.pt` (best validation BLEU so far; no optimizer or RNG state), `step_N.pt` (the last `keep_last_checkpoints`).

The resume contract (`restore`): the keys in `RESUME_MAY_CHANGE` may differ between the checkpoint's config and the
config given with --resume, each with the behaviour stated there (logged when it happens); any other difference is
refused with the key and both values, because it would change the model, the data, the batch order or the
optimisation that the run has followed so far.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint import load_checkpoint, save_checkpoint
from ..config import Config, ConfigError, config_from_dict
from ..model import Transformer
from ..tokenizer import Tokenizer
from .average import step_checkpoints
from .distributed import Distributed

logger = logging.getLogger(__name__)

CHECKPOINT_KEYS = ("model", "config", "vocab_sizes", "tokenizer", "train_state", "optimizer", "rng")
"""Top-level keys of last.pt and step_N.pt (best.pt has the first five)."""
FP16_CHECKPOINT_KEYS = ("grad_scaler",)
"""Keys that fp16 runs add to last.pt and step_N.pt."""


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint so that `--resume` continues exactly."""

    step: int = 0
    """Optimizer updates done."""
    epoch: int = 0
    """Passes over the training data completed."""
    batch_in_epoch: int = 0
    """Batches of the current epoch's order already used."""
    best_bleu: float = -1.0
    evals_without_improvement: int = 0
    nonfinite_in_a_row: int = 0
    """Skipped updates in a row that count toward training.max_nonfinite_steps (`training/stop.py`)."""
    skipped_in_a_row: int = 0
    """Skipped updates in a row, counted or not."""
    n_skipped_updates: int = 0
    elapsed_s: float = 0.0
    """Training wall time so far, across resumes (seconds)."""
    window_loss: Any = 0.0
    """Summed loss, NLL and token counts since the last log line (kept so that a resumed run logs the same)."""
    window_nll: Any = 0.0
    window_tokens: int = 0
    window_src_tokens: int = 0
    window_grad_norm: Any = 0.0
    """Summed gradient norms (before clipping) of the window's finite updates, and how many there were."""
    window_updates: int = 0
    precision: str = ""
    """The precision `training.precision: auto` resolved to at the start (kept on --resume; "" otherwise)."""


def finished(state: TrainState, training: Any) -> bool:
    """Whether a run at `state` has no update left under `training` (a `TrainingConfig`): max_steps made,
    max_epochs passed, or early stopping's patience spent."""
    return (
        state.step >= training.max_steps
        or bool(training.max_epochs and state.epoch >= training.max_epochs)
        or bool(training.patience and state.evals_without_improvement >= training.patience)
    )


def run_progress(run_dir: str | Path) -> tuple[int, int, bool]:
    """(updates made, training.max_steps, finished) of the run in `run_dir`, read from its last.pt under the
    config it was saved with: "has this run finished?" for scripts and notebooks.

    Raises:
        CheckpointError: last.pt is missing or corrupt.
    """
    saved = load_checkpoint(checkpoint_path(run_dir), map_location="cpu")
    state, training = TrainState(**saved["train_state"]), config_from_dict(saved["config"]).training
    return state.step, training.max_steps, finished(state, training)


def checkpoint_path(run_dir: str | Path, name: str = "last") -> Path:
    """`run_dir/checkpoints/<name>.pt` (name: "last", "best" or "step_N")."""
    return Path(run_dir) / "checkpoints" / f"{name}.pt"


def checkpoint_state(
    model: Transformer,
    optimizer: Optional[torch.optim.Optimizer],
    tokenizer: Tokenizer,
    config: Config,
    state: TrainState,
    scaler: Optional[torch.amp.GradScaler] = None,
    device: Optional[torch.device] = None,
) -> dict[str, Any]:
    """The checkpoint dict (keys in the module docstring); without optimizer, RNG and loss-scaler state if
    `optimizer` is None. `device`: the training device, whose generator state is saved when it is a GPU."""
    out = {
        "model": model.state_dict(),
        "config": config.to_dict(),
        "vocab_sizes": [config.model.src_vocab_size, config.model.tgt_vocab_size],
        "tokenizer": tokenizer.to_dict(),
        "train_state": {
            k: float(v) if isinstance(v, torch.Tensor) else v for k, v in asdict(state).items()
        },
    }
    if optimizer is not None:
        out["optimizer"] = optimizer.state_dict()
        on_cuda = device is not None and device.type == "cuda"
        out["rng"] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state(device) if on_cuda else None,
        }
        if scaler is not None:
            out["grad_scaler"] = scaler.state_dict()
    return out


def save_training_checkpoint(
    run_dir: Path,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    tokenizer: Tokenizer,
    config: Config,
    state: TrainState,
    is_best: bool = False,
    keep_step_checkpoint: bool = False,
    scaler: Optional[torch.amp.GradScaler] = None,
    device: Optional[torch.device] = None,
) -> None:
    """Write last.pt (and best.pt, step_N.pt), pruning step checkpoints beyond `keep_last_checkpoints`.
    `scaler` (fp16) and `device` as in `checkpoint_state`."""
    full = checkpoint_state(model, optimizer, tokenizer, config, state, scaler, device)
    save_checkpoint(full, checkpoint_path(run_dir, "last"))
    if is_best:
        save_checkpoint(
            checkpoint_state(model, None, tokenizer, config, state),
            checkpoint_path(run_dir, "best"),
        )
    keep = config.training.keep_last_checkpoints
    if keep_step_checkpoint and keep > 0:
        save_checkpoint(full, checkpoint_path(run_dir, f"step_{state.step}"))
        for old in step_checkpoints(run_dir)[:-keep]:
            old.unlink()


RESUME_MAY_CHANGE = {
    "training.max_steps": "the run goes on to the new max_steps; the linear and cosine schedules are recomputed for "
    "it, so the learning rate continues on the new schedule from the resumed step (inverse_sqrt "
    "does not depend on max_steps)",
    "training.max_epochs": "the run stops at the new epoch limit",
    "training.eval_every_steps": "validation (and its checkpoints) at the multiples of the new interval",
    "training.log_every_steps": "log lines at the multiples of the new interval",
    "training.save_every_steps": "step checkpoints at the multiples of the new interval",
    "training.patience": "early stopping compares the new patience with the saved count of validations "
    "without improvement",
    "training.keep_last_checkpoints": "the next step checkpoint prunes step_N.pt files down to the new number",
    "training.max_nonfinite_steps": "the new limit, counted from the saved count",
    "training.threads": "the new number of CPU threads",
    "training.device": "the run continues on the new device (optimizer state is moved there)",
    "training.precision": "the new precision from the resumed step on (auto keeps what it resolved to at the start)",
    "training.compile": "torch.compile on or off from the resumed step on",
    "training.tensorboard": "TensorBoard logs on or off from the resumed step on",
    "training.deterministic": "deterministic kernels on or off from the resumed step on",
    "data.cache_dir": "the token cache is looked for (or rebuilt, with the same contents) in the new folder",
    "data.subword_workers": "the next subword samples are encoded by the new number of processes (to the same ids)",
    "data.valid_max_sentences": "validation BLEU on the new number of sentences (best_bleu so far was measured on "
    "the old number)",
    "decoding.*": "decoding defaults of the checkpoints written from now on (validation decodes greedily)",
}
"""Config keys that may differ on --resume, with what happens then. Any other difference is refused."""


def _flat(config: Config) -> dict[str, Any]:
    return {
        f"{section}.{key}": value
        for section, values in config.to_dict().items()
        for key, value in values.items()
    }


def check_resume_config(saved: dict[str, Any], config: Config, path: Path) -> None:
    """Apply the resume contract: log each allowed change, refuse any other.

    Raises:
        ConfigError: naming every refused key with the checkpoint's and the new value.
    """
    before = _flat(config_from_dict(saved["config"], vocab_sizes=tuple(saved["vocab_sizes"])))
    after = _flat(config)
    refused, allowed = [], []
    for key in sorted(after):
        old, new = before.get(key), after[key]
        if old == new or (key == "training.precision" and new == "auto"):
            continue
        if key == "data.path" and old and new and Path(old).resolve() == Path(new).resolve():
            continue  # the same folder, recorded relative by an older run
        rule = RESUME_MAY_CHANGE.get(key) or RESUME_MAY_CHANGE.get(key.split(".")[0] + ".*")
        if rule is None:
            refused.append(f"{key} (checkpoint: {old!r}, now: {new!r})")
        else:
            allowed.append((key, old, new, rule))
    if refused:
        raise ConfigError(
            f"{path}: --resume cannot change {'; '.join(refused)}: it would change the model, data, "
            "batch order or optimisation the run has followed. Resume with the checkpoint's values or "
            "start a new --run-dir. Keys that may change: "
            f"{', '.join(RESUME_MAY_CHANGE)}"
        )
    for key, old, new, rule in allowed:  # logged once the resume is accepted
        logger.info("resume: %s changed from %r to %r: %s", key, old, new, rule)


def restore(
    run_dir: Path,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    config: Config,
    device: torch.device,
    dist: Distributed,
    scaler: Optional[torch.amp.GradScaler] = None,
) -> TrainState:
    """Load last.pt into model, optimizer and (fp16) the loss scaler, restore the RNG states, and return the saved
    `TrainState`. A scaler that the checkpoint has no state for (the run was not fp16 before) starts afresh.

    Raises:
        CheckpointError: last.pt is missing or corrupt.
        ConfigError: the config differs from the checkpoint's in a key outside `RESUME_MAY_CHANGE`.
    """
    path = checkpoint_path(run_dir)
    saved = load_checkpoint(path, map_location=device)
    check_resume_config(saved, config, path)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state = TrainState(**saved["train_state"])
    if dist.world_size > 1:  # one saved RNG state, several processes: derive one stream per process
        torch.manual_seed(config.training.seed + 1_000_003 * state.step + dist.rank)
        random.seed(config.training.seed + 1_000_003 * state.step + dist.rank)
    else:
        torch.set_rng_state(saved["rng"]["torch"].cpu())
        random.setstate(_as_tuple(saved["rng"]["python"]))
        cuda_state = saved["rng"].get(
            "cuda"
        )  # older checkpoints hold a list (of CPU runs' [] only)
        if isinstance(cuda_state, torch.Tensor) and device.type == "cuda":
            torch.cuda.set_rng_state(cuda_state.cpu(), device)
    if scaler is not None and saved.get("grad_scaler"):
        scaler.load_state_dict(saved["grad_scaler"])
    logger.info(
        "resumed from %s at step %d (epoch %d, batch %d)",
        path,
        state.step,
        state.epoch,
        state.batch_in_epoch,
    )
    return state


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def check_no_earlier_run(run_dir: Path) -> None:
    """Refuse to start a new run in a folder that holds an earlier run's checkpoints or metrics: starting afresh
    there would overwrite last.pt and metrics.jsonl and leave the old best.pt and step_N.pt beside the new run's
    (which `transformer average --last N` would then mix). A folder with only a tokenizer, a config or nothing (what
    `transformer prepare` writes) is fine, and so is one whose run stopped before its first checkpoint and
    validation (its metrics.jsonl holds only training lines, of updates that are lost).

    Raises:
        ConfigError: naming the files found, with the two ways on (--resume, or another or emptied --run-dir).
    """
    found = (
        sorted((run_dir / "checkpoints").glob("*.pt")) if (run_dir / "checkpoints").is_dir() else []
    )
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and '"valid"' in metrics.read_text(encoding="utf-8"):
        found.append(
            metrics
        )  # a validated run (a run stopped before it saved or validated has nothing to keep)
    if found:
        names = ", ".join(str(p.relative_to(run_dir)) for p in found[:4]) + (
            ", ..." if len(found) > 4 else ""
        )
        raise ConfigError(
            f"{run_dir} already holds a training run ({names}): continue it with --resume (make train "
            f"RESUME=1), or start afresh with another --run-dir or after deleting {run_dir}"
        )
