"""The training loop (`training_loop`, first below) and its entry point `train(config, run_dir)`.

Order of one update (the familiar one): set the learning rate → forward and backward over
`accumulate_steps` batches → clip → optimizer step → log → validate → checkpoint.

Where the rest lives: the data of a run (tokenizer, token cache, epoch batches) in `training/data.py`, the loss
module in `training/loss.py`, validation and the metrics log in `training/validate.py`, the checkpoint format and
the resume contract in `training/checkpoint.py`, the learning-rate schedule in `training/optim.py`, Ctrl-C
handling and the skipped-update limit in `training/stop.py`.

The run directory holds:
    config.yaml                 the resolved config
    spm.model (or spm.{lang}.model)   the sentencepiece model(s)
    checkpoints/last.pt, best.pt, step_N.pt (the last `keep_last_checkpoints`, written at validations and every
                                `save_every_steps`)
    metrics.jsonl               one JSON line per logged step ("train") and per validation ("valid")
    tensorboard/                the same figures, sample translations and an attention image for TensorBoard
                                (`training.tensorboard`; `training/tensorboard.py`)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ..checkpoint import load_checkpoint
from ..config import Config, ConfigError, save_config
from ..data import Batch
from ..device import resolve_device, resolve_precision
from ..fast.compiled import uncompiled
from ..fast.dropout import use_fast_cpu_dropout
from ..model import Transformer
from ..tokenizer import Tokenizer
from .checkpoint import (
    TrainState,
    check_no_earlier_run,
    check_resume_config,
    checkpoint_path,
    finished,
    restore,
    save_training_checkpoint,
)
from .data import MixedEpochs, ValidationSet, epoch_batches, prepare_data, training_epochs
from .distributed import Distributed, data_parallel, init_distributed
from .init_from import InitSource
from .loss import LossComputation, batch_loss
from .optim import build_optimizer, learning_rate, set_lr
from .stop import StopRequest, TrainingInterrupted, count_skipped_update
from .tensorboard import TensorBoardLog, wants_tensorboard
from .validate import MetricsLog, validate

logger = logging.getLogger(__name__)


def training_loop(run: TrainingRun, state: TrainState, stop: StopRequest, bar: tqdm) -> None:
    """Updates until max_steps (or max_epochs, or early stopping): learning rate, forward/backward, step, log,
    validate and checkpoint, step checkpoint; on SIGINT/SIGTERM save last.pt and raise `TrainingInterrupted`."""
    training, data, dist = run.config.training, run.train_data, run.dist
    run.module.train()
    window_start = time.perf_counter()
    carried = (
        state.window_tokens,
        state.window_src_tokens,
    )  # resumed mid-window: counted before window_start
    resumed_elapsed, loop_start = state.elapsed_s, time.perf_counter()
    while state.step < training.max_steps and not (
        training.max_epochs and state.epoch >= training.max_epochs
    ):
        pairs = data.epoch(state.epoch)  # the token cache, or this epoch's subword sample
        batches = epoch_batches(pairs, run.config, state.epoch)
        if _goes_past(run, state, len(batches)):
            data.prefetch(
                state.epoch + 1
            )  # the next epoch's subword sample, built while this one trains
        while state.batch_in_epoch < len(batches) and state.step < training.max_steps:
            update = _next_update(
                run, batches, state
            )  # the batches of one update, over all processes
            if update is None:
                break
            n_tokens = int(
                sum(pairs.tgt_lengths[indices].sum() for indices in update)
            )  # over all processes
            my_share = [pairs.batch(indices) for indices in update[dist.rank :: dist.world_size]]
            my_share = [b.to(run.device) for b in my_share]  # pinned and non-blocking to a GPU
            set_lr(run.optimizer, learning_rate(state.step + 1, training, run.config.model.d_model))
            result = train_step(
                run.module,
                run.optimizer,
                my_share,
                run.config,
                n_tokens,
                dist.world_size,
                run.scaler,
            )
            state.elapsed_s = resumed_elapsed + time.perf_counter() - loop_start
            # not applied, not a step: the schedule and the intervals count applied updates
            if result is None:
                count_skipped_update(
                    state, training.max_nonfinite_steps, run.scaler, checkpoint_path(run.run_dir)
                )
            else:
                state.step += 1
                state.nonfinite_in_a_row = state.skipped_in_a_row = 0
                # tensors: no device sync until logged
                state.window_loss = state.window_loss + result[0]
                state.window_nll = state.window_nll + result[1]
                state.window_tokens += sum(b.n_tgt_tokens for b in my_share)
                state.window_src_tokens += sum(b.n_src_tokens for b in my_share)
                state.window_grad_norm = state.window_grad_norm + result[2]
                state.window_updates += 1
                bar.update(1)
                if state.step % training.log_every_steps == 0:
                    _log_window(run, time.perf_counter() - window_start, state, bar, carried)
                    window_start, carried = time.perf_counter(), (0, 0)
                if state.step % training.eval_every_steps == 0 or state.step >= training.max_steps:
                    valid_start = time.perf_counter()
                    if _validate_and_save(run, state):
                        return  # early stopping
                    # tokens/s counts training time only
                    window_start += time.perf_counter() - valid_start
                elif (
                    training.save_every_steps
                    and state.step % training.save_every_steps == 0
                    and dist.is_main
                ):
                    save_start = time.perf_counter()
                    run.save(state, keep_step_checkpoint=True)
                    window_start += time.perf_counter() - save_start
            requested = stop.signal_name is not None
            if dist.any(requested, run.device) if dist.is_distributed else requested:
                if dist.is_main:
                    run.save(state)
                raise TrainingInterrupted(
                    f"{stop.signal_name or 'another process was stopped'}: stopped at step {state.step}; saved "
                    f"{checkpoint_path(run.run_dir)}. Resume with the same command and --resume (make train RESUME=1)"
                )
        if state.batch_in_epoch >= len(batches):
            state.epoch += 1
            state.batch_in_epoch = 0
    # stopped by max_epochs
    if state.step % training.eval_every_steps and state.step < training.max_steps:
        _validate_and_save(run, state)


def train(
    config: Config, run_dir: str | Path, resume: bool = False, init: Optional[InitSource] = None
) -> TrainState:
    """Train a Transformer as the config says, writing everything into run_dir.

    Under torchrun every process runs this; they split each update's batches, DDP averages
    the gradients, and only rank 0 validates, writes checkpoints, metrics and the progress bar.

    Args:
        config: the validated config.
        run_dir: the run directory (created if needed).
        resume: continue from `run_dir/checkpoints/last.pt` with the same schedule, optimizer moments,
            batch order position and RNG state (any number of processes); the config may differ from the
            checkpoint's only as `training/checkpoint.py`'s resume contract allows.
        init: fine-tuning (`training/init_from.py`): start from these weights and this tokenizer (`config` from
            `fine_tuning_config`); everything else starts fresh. Not with `resume`.

    Returns:
        The final `TrainState`.

    Raises:
        ConfigError, DataError, TokenizerError: bad settings or data, before any long work; a run_dir that holds
            an earlier run without `resume` (`training.checkpoint.check_no_earlier_run`).
        CheckpointError: `resume` with a missing or corrupt last.pt.
        TrainingInterrupted: after SIGINT/SIGTERM, once last.pt is saved.
        NonFiniteLossError (`training/stop.py`): after `max_nonfinite_steps` non-finite updates in a row (fp16
            overflows count as `count_skipped_update` says).
    """
    run_dir = Path(run_dir)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        return _train(config, run_dir, resume, init)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _finished_run(config: Config, run_dir: Path) -> Optional[TrainState]:
    """The state saved in run_dir's last.pt if the run has no update left under `config` (it is said and nothing
    is built: `--resume` of a finished run returns at once); None if it goes on. A config that could not resume
    the run is refused here as in `restore`."""
    path = checkpoint_path(run_dir)
    saved = load_checkpoint(path)
    check_resume_config(saved, config, path)
    state = TrainState(**saved["train_state"])
    if not finished(state, config.training):
        return None
    logger.info(
        "%s: the run has finished (%d of training.max_steps=%d updates); nothing to resume",
        path,
        state.step,
        config.training.max_steps,
    )
    return state


def _train(config: Config, run_dir: Path, resume: bool, init: Optional[InitSource]) -> TrainState:
    if resume and not checkpoint_path(run_dir).exists():
        raise ConfigError(f"--resume: no checkpoint {checkpoint_path(run_dir)} to resume from")
    if not resume:
        check_no_earlier_run(run_dir)
    elif (state := _finished_run(config, run_dir)) is not None:
        return state
    device = resolve_device(config.training.device)
    dist = init_distributed(device)
    device = _setup(config, dist, device)
    if init is not None and resume:
        raise ConfigError(
            "--init-from starts a new run; --resume continues one from its own last.pt"
        )
    tokenizer, train_cache, valid_data = prepare_data(
        config, run_dir, dist, init.tokenizer if init else None
    )
    train_data = training_epochs(config, run_dir, tokenizer, train_cache, dist)
    if dist.is_main:
        save_config(config, run_dir / "config.yaml")
    model = Transformer(config.model)
    if init is not None:
        model.load_state_dict(init.model_state)
        logger.info(
            "fine-tuning: weights and tokenizer from %s (sha256 %s)", init.path, init.sha256[:16]
        )
    model = model.to(device)
    if device.type == "cpu":
        use_fast_cpu_dropout(
            model
        )  # nn.Dropout -> a faster CPU mask (fast/dropout.py); the same model otherwise
    optimizer = build_optimizer(model, config.training, device)
    # fp16 is never what precision "auto" resolves to: whether the run has a loss scaler is known here.
    scaler = torch.amp.GradScaler("cuda") if config.training.precision == "fp16" else None
    state = (
        restore(run_dir, model, optimizer, config, device, dist, scaler) if resume else TrainState()
    )
    config = _resolve_precision(config, state, device, dist)
    module: nn.Module = LossComputation(model, config.training.label_smoothing)
    if dist.is_distributed:
        module = data_parallel(module, device)
    if config.training.compile:
        module = torch.compile(module)
    logger.info(
        "model: %d parameters; device %s; %d process(es); %d training pairs",
        model.num_parameters(),
        device,
        dist.world_size,
        len(train_data),
    )
    metrics = (
        MetricsLog(run_dir / "metrics.jsonl", state.step if resume else None)
        if dist.is_main
        else None
    )
    board = (
        TensorBoardLog(run_dir / "tensorboard", state.step + 1 if resume else None)
        if dist.is_main and wants_tensorboard(config)
        else None
    )
    run = TrainingRun(
        model,
        module,
        optimizer,
        scaler,
        tokenizer,
        train_data,
        valid_data,
        config,
        run_dir,
        device,
        dist,
        metrics,
        board,
    )
    try:
        # A progress bar on a terminal; redirected to a file, a plain log line per log interval instead (a bar
        # would write thousands of carriage returns into one line).
        on_terminal = sys.stderr.isatty()
        if not on_terminal and dist.is_main:
            first = (
                state.step // config.training.log_every_steps + 1
            ) * config.training.log_every_steps
            logger.info(
                "training: the first log line comes at update %d (training.log_every_steps=%d)",
                min(first, config.training.max_steps),
                config.training.log_every_steps,
            )
        with (
            StopRequest() as stop,
            tqdm(
                total=config.training.max_steps,
                initial=state.step,
                unit="step",
                dynamic_ncols=True,
                mininterval=1.0,
                disable=not dist.is_main or not on_terminal,
            ) as bar,
        ):
            training_loop(run, state, stop, bar)
    finally:
        train_data.close()
        if board is not None:
            board.close()
    return state


def train_step(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    config: Config,
    n_tokens: Optional[int] = None,
    world_size: int = 1,
    scaler: Optional[torch.amp.GradScaler] = None,
) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Forward/backward over `batches` (gradient accumulation), clip, and update.

    Args:
        module: a `LossComputation`, possibly wrapped by DistributedDataParallel (gradients are all-reduced
            only on the last batch) and/or torch.compile.
        batches: this process's batches for this update.
        n_tokens: target tokens of the whole update over all processes (default: those of `batches`); the
            loss is normalised by it.
        world_size: number of processes (DDP averages gradients over them; the loss is scaled to undo that).
        scaler: a GradScaler for fp16.

    Returns:
        (summed loss, summed nll) of this process's batches and the gradient's L2 norm before clipping (of the
        unscaled, all-reduced gradient: the same on every process), as tensors; or None if the gradient was not
        finite (the update is skipped; the same decision on every process).
    """
    optimizer.zero_grad(set_to_none=True)
    n_tokens = n_tokens or sum(b.n_tgt_tokens for b in batches)
    total_loss = total_nll = 0.0
    device_type = batches[0].src.device.type
    dtype = _AUTOCAST_DTYPES.get(config.training.precision)
    ddp = uncompiled(module)  # torch.compile's wrapper holds the DDP module
    is_ddp = isinstance(ddp, DistributedDataParallel)
    for i, batch in enumerate(batches):
        skip_sync = is_ddp and i < len(batches) - 1  # no all-reduce on the accumulation steps
        with ddp.no_sync() if skip_sync else contextlib.nullcontext():
            with torch.autocast(
                device_type, dtype=dtype or torch.float32, enabled=dtype is not None
            ):
                loss, nll = batch_loss(module, batch)
            scaled = loss * (world_size / n_tokens)
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        total_loss, total_nll = total_loss + loss.detach(), total_nll + nll.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)
    max_norm = config.training.clip_grad_norm or float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, foreach=True)
    if not torch.isfinite(grad_norm):
        if scaler is not None:
            scaler.update()  # lowers the loss scale
        optimizer.zero_grad(set_to_none=True)
        return None
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return total_loss, total_nll, grad_norm.detach()


_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainingRun:
    """Everything the loop works with (built once by `train`)."""

    model: Transformer
    """The bare model: validated, checkpointed."""
    module: nn.Module
    """What the update runs: `LossComputation(model)`, wrapped by DDP and/or torch.compile when asked."""
    optimizer: torch.optim.Optimizer
    scaler: Optional[torch.amp.GradScaler]
    tokenizer: Tokenizer
    train_data: MixedEpochs
    """The training pairs of each epoch (`.epoch(e)`): the token cache, or a subword sample per epoch."""
    valid_data: Optional[ValidationSet]
    """None on every process but rank 0."""
    config: Config
    run_dir: Path
    device: torch.device
    dist: Distributed
    metrics: Optional["MetricsLog"]
    """None on every process but rank 0."""
    tensorboard: Optional[TensorBoardLog] = None
    """None on every process but rank 0, and when `training.tensorboard` is off."""

    def save(
        self, state: TrainState, is_best: bool = False, keep_step_checkpoint: bool = False
    ) -> None:
        """Write last.pt (and best.pt, step_N.pt): `save_training_checkpoint` with this run's parts."""
        save_training_checkpoint(
            self.run_dir,
            self.model,
            self.optimizer,
            self.tokenizer,
            self.config,
            state,
            is_best=is_best,
            keep_step_checkpoint=keep_step_checkpoint,
            scaler=self.scaler,
            device=self.device,
        )


def _setup(config: Config, dist: Distributed, device: torch.device) -> torch.device:
    """Seeds, threads and determinism for this process; its device (GPU LOCAL_RANK under torchrun on CUDA)."""
    random.seed(config.training.seed + dist.rank)
    torch.manual_seed(
        config.training.seed + dist.rank
    )  # dropout differs per process; DDP syncs the weights
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    if config.training.deterministic:
        os.environ.setdefault(
            "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
        )  # read at the process's first cuBLAS call
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda" and dist.is_distributed:
        device = torch.device("cuda", dist.local_rank)
    if config.training.precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            f"training.precision: fp16 needs a CUDA device (this run is on {device}); "
            "use bf16 or fp32"
        )
    return device


def _resolve_precision(
    config: Config, state: TrainState, device: torch.device, dist: Distributed
) -> Config:
    """The config with `training.precision: auto` replaced by what it means here (measured by rank 0 and shared,
    or taken from the resumed state so that a resumed run computes as before)."""
    if config.training.precision == "bf16" and device.type in ("cpu", "cuda") and dist.is_main:
        _, reason = resolve_precision("bf16", device)
        (logger.warning if "faster" in reason else logger.info)(
            "training.precision: bf16 %s", reason
        )
    if config.training.precision != "auto":
        return config
    if state.precision:
        precision, reason = state.precision, "kept from the resumed run"
    else:
        precision, reason = dist.broadcast(
            resolve_precision("auto", device) if dist.is_main else None
        )
        state.precision = precision
    logger.info("training.precision: auto -> %s (%s)", precision, reason)
    return dataclasses.replace(
        config, training=dataclasses.replace(config.training, precision=precision)
    )


def _next_update(
    run: TrainingRun, batches: list[np.ndarray], state: TrainState
) -> Optional[list[np.ndarray]]:
    """The batches of the next update over all processes, or None when the epoch's rest cannot give every
    process a batch (that short tail is skipped)."""
    size = run.config.training.accumulate_steps * run.dist.world_size
    update = batches[state.batch_in_epoch : state.batch_in_epoch + size]
    if len(update) < run.dist.world_size:
        state.batch_in_epoch = len(batches)
        return None
    state.batch_in_epoch += len(update)
    return update


def _goes_past(run: TrainingRun, state: TrainState, n_batches: int) -> bool:
    """Whether the run may go on past the current epoch: not when max_steps or max_epochs ends it here. The
    updates left are counted as `_next_update` takes them (a short tail needs a batch for every process), each as a
    step: if skipped updates (non-finite gradients) then carry the run past, the next epoch's sample is built when
    that epoch starts."""
    training, world_size = run.config.training, run.dist.world_size
    full, tail = divmod(n_batches - state.batch_in_epoch, training.accumulate_steps * world_size)
    updates_left = full + (tail >= world_size)
    return state.step + updates_left < training.max_steps and not (
        training.max_epochs and state.epoch + 1 >= training.max_epochs
    )


def _log_window(
    run: TrainingRun,
    elapsed: float,
    state: TrainState,
    bar: tqdm,
    carried: tuple[int, int] = (0, 0),
) -> None:
    """Sum the window over processes (the one device sync of the log interval) and write a "train" record.

    Args:
        elapsed: seconds of training since the window's timing started.
        carried: the window's target and source tokens counted before its timing started (a run resumed in the
            middle of a window): in the loss, not in the tokens/s.
    """
    loss, nll, tokens, src_tokens, carried_tokens, carried_src = run.dist.all_reduce_sum(
        [
            float(state.window_loss),
            float(state.window_nll),
            state.window_tokens,
            state.window_src_tokens,
            *carried,
        ],
        run.device,
    )
    grad_norm = float(state.window_grad_norm) / max(
        state.window_updates, 1
    )  # the same on every process
    state.window_loss = state.window_nll = state.window_grad_norm = 0.0
    state.window_tokens = state.window_src_tokens = state.window_updates = 0
    if not tokens or run.metrics is None:
        return
    lr = run.optimizer.param_groups[0]["lr"]
    record = {
        "type": "train",
        "step": state.step,
        "epoch": state.epoch,
        "loss": round(loss / tokens, 4),
        "nll": round(nll / tokens, 4),
        "ppl": round(math.exp(min(nll / tokens, 50)), 2),
        "lr": lr,
        "grad_norm": round(grad_norm, 4),
        "tgt_tokens_per_s": round((tokens - carried_tokens) / elapsed, 1),
        "src_tgt_tokens_per_s": round(
            (tokens - carried_tokens + src_tokens - carried_src) / elapsed, 1
        ),
        "skipped_updates": state.n_skipped_updates,
        "elapsed_s": round(state.elapsed_s, 1),
    }
    if run.scaler is not None:
        record["loss_scale"] = run.scaler.get_scale()
    run.metrics.write(record)
    if run.tensorboard is not None:
        run.tensorboard.write(record)
    if bar.disable:
        logger.info(
            "step %d/%d: loss %.3f, ppl %.2f, lr %.2e, grad_norm %.3f, %.0f tgt tokens/s",
            state.step,
            run.config.training.max_steps,
            record["loss"],
            record["ppl"],
            lr,
            grad_norm,
            record["tgt_tokens_per_s"],
        )
    else:
        bar.set_postfix(
            loss=f"{record['loss']:.3f}",
            lr=f"{lr:.2e}",
            grad_norm=f"{grad_norm:.3f}",
            tok_s=f"{record['tgt_tokens_per_s']:.0f}",
        )


def _validate_and_save(run: TrainingRun, state: TrainState) -> bool:
    """Validate and checkpoint on rank 0, share the outcome, and return True when early stopping says stop."""
    stop = False
    if run.dist.is_main:
        start = time.perf_counter()
        result = validate(run.model, run.tokenizer, run.valid_data, run.config, run.device)
        hypotheses, hypothesis_ids = result.pop("hypotheses"), result.pop("hypothesis_ids")
        if run.tensorboard is not None:
            run.tensorboard.write_validation(
                state.step,
                run.model,
                run.tokenizer,
                run.valid_data,
                hypotheses,
                hypothesis_ids,
                run.device,
            )
        run.module.train()
        is_best = result["bleu"] > state.best_bleu
        if is_best:
            state.best_bleu, state.evals_without_improvement = result["bleu"], 0
        else:
            state.evals_without_improvement += 1
        record = {
            "type": "valid",
            "step": state.step,
            "epoch": state.epoch,
            **result,
            "best_bleu": state.best_bleu,
            "valid_s": round(time.perf_counter() - start, 1),
            "elapsed_s": round(state.elapsed_s, 1),
        }
        run.metrics.write(record)
        if run.tensorboard is not None:
            run.tensorboard.write(record)
        tqdm.write(
            f"step {state.step}: valid loss {result['loss']:.3f} ppl {result['ppl']:.2f} "
            f"BLEU {result['bleu']:.2f} (best {state.best_bleu:.2f})"
        )
        run.save(state, is_best=is_best, keep_step_checkpoint=True)
        patience = run.config.training.patience
        stop = bool(patience and state.evals_without_improvement >= patience)
        if stop:
            tqdm.write(f"early stopping: no BLEU improvement in {patience} validations")
    state.best_bleu, state.evals_without_improvement, stop = run.dist.broadcast(
        (state.best_bleu, state.evals_without_improvement, stop)
    )
    return stop
