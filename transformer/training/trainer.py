"""The training loop: `train(config, run_dir)`.

Order of one update (the familiar one): set the learning rate → forward and backward over
`accumulate_steps` batches → clip → optimizer step → log → validate → checkpoint.

The run directory holds:
    config.yaml                 the resolved config
    spm.model (or spm.{lang}.model)   the sentencepiece model(s)
    checkpoints/last.pt, best.pt, step_N.pt (the last `keep_last_checkpoints`, written at validations and every
                                `save_every_steps`)
    metrics.jsonl               one JSON line per logged step ("train") and per validation ("valid")
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ..config import PAD_ID, Config, ConfigError, save_config
from ..data import Batch, EncodedPairs
from ..device import resolve_device
from ..evaluate import corpus_scores
from ..model import Transformer
from ..tokenizer import Tokenizer
from ..translate import Translator
from .checkpoint import load_checkpoint, save_checkpoint
from .data import ValidationSet, epoch_batches, prepare_data
from .distributed import Distributed, init_distributed
from .loss import label_smoothed_cross_entropy
from .optim import build_optimizer, learning_rate, set_lr

logger = logging.getLogger(__name__)


class TrainingInterrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving `checkpoints/last.pt`."""


class NonFiniteLossError(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


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
    n_skipped_updates: int = 0
    elapsed_s: float = 0.0
    """Training wall time so far, across resumes (seconds)."""
    window_loss: Any = 0.0
    """Summed loss, NLL and token counts since the last log line (kept so that a resumed run logs the same)."""
    window_nll: Any = 0.0
    window_tokens: int = 0
    window_src_tokens: int = 0


# --------------------------------------------------------------------------------------------------
# One update
# --------------------------------------------------------------------------------------------------


class LossComputation(nn.Module):
    """The Transformer and its training loss as one module: what DistributedDataParallel and torch.compile wrap.

    Logits are computed at every target position and the loss masks padding (selecting the real positions
    first saves about as much as the selection costs, and needs a device sync on CUDA).

    Args:
        model: the Transformer.
        label_smoothing: ε_ls.
    """

    def __init__(self, model: Transformer, label_smoothing: float) -> None:
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing

    def forward(self, src: torch.Tensor, src_key_padding_mask: torch.Tensor, tgt_in: torch.Tensor,
                tgt_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: src, src_key_padding_mask `(batch, src_len)`; tgt_in, tgt_out `(batch, tgt_len)`.

        Returns:
            Summed label-smoothed loss and summed NLL over the non-pad targets (scalars).
        """
        logits = self.model(src, tgt_in, src_key_padding_mask)  # (batch, tgt_len, tgt_vocab_size)
        return label_smoothed_cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), self.label_smoothing, PAD_ID)


def batch_loss(module: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss and NLL of one batch through a `LossComputation` (or its DDP/compiled wrapper)."""
    return module(batch.src, batch.src_key_padding_mask, batch.tgt_in, batch.tgt_out)


_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def train_step(module: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Batch], config: Config,
               n_tokens: Optional[int] = None, world_size: int = 1,
               scaler: Optional[torch.amp.GradScaler] = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
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
        (summed loss, summed nll) of this process's batches as tensors, or None if the gradient was not
        finite (the update is skipped; the same decision on every process, as gradients are all-reduced).
    """
    optimizer.zero_grad(set_to_none=True)
    n_tokens = n_tokens or sum(b.n_tgt_tokens for b in batches)
    total_loss = total_nll = 0.0
    device_type = batches[0].src.device.type
    dtype = _AUTOCAST_DTYPES.get(config.training.precision)
    is_ddp = isinstance(module, DistributedDataParallel)
    for i, batch in enumerate(batches):
        skip_sync = is_ddp and i < len(batches) - 1  # no all-reduce on the accumulation steps
        with module.no_sync() if skip_sync else contextlib.nullcontext():
            with torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
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
    return total_loss, total_nll


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def validate(model: Transformer, tokenizer: Tokenizer, valid: ValidationSet, config: Config,
             device: torch.device) -> dict[str, Any]:
    """Validation loss and perplexity (teacher forcing) and BLEU/chrF of greedy decodes.

    Returns:
        {"loss", "nll", "ppl", "bleu", "chrf", "bleu_signature", "n_sentences"}: loss and nll per target token.
    """
    model.eval()
    total_loss = total_nll = 0.0
    n_tokens = 0
    loss_module = LossComputation(model, config.training.label_smoothing)
    pairs = valid.pairs
    for indices in epoch_batches(pairs, config, epoch=0):
        batch = pairs.batch(indices).to(device)
        loss, nll = batch_loss(loss_module, batch)
        total_loss, total_nll = total_loss + loss.item(), total_nll + nll.item()
        n_tokens += batch.n_tgt_tokens
    limit = config.data.valid_max_sentences or len(pairs)
    translator = Translator(model, tokenizer, config, device)
    greedy = dataclasses.replace(config.decoding, beam_size=1, n_best=1)
    hyps = translator.decode_ids([pairs.src(i).tolist() for i in range(limit)], greedy)
    texts = [tokenizer.decode_tgt(h[0].tokens) for h in hyps]
    scores = corpus_scores(texts, valid.references[:limit], config.data.tgt_lang)
    model.train()
    return {"loss": total_loss / n_tokens, "nll": total_nll / n_tokens, "ppl": math.exp(min(total_nll / n_tokens, 50)),
            "bleu": scores.bleu, "chrf": scores.chrf, "bleu_signature": scores.bleu_signature,
            "n_sentences": limit}


# --------------------------------------------------------------------------------------------------
# Checkpoints and metrics
# --------------------------------------------------------------------------------------------------


def _checkpoint_state(model: Transformer, optimizer: Optional[torch.optim.Optimizer], tokenizer: Tokenizer,
                      config: Config, state: TrainState) -> dict[str, Any]:
    out = {"model": model.state_dict(), "config": config.to_dict(),
           "vocab_sizes": [config.model.src_vocab_size, config.model.tgt_vocab_size],
           "tokenizer": tokenizer.to_dict(),
           "train_state": {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in asdict(state).items()}}
    if optimizer is not None:
        out["optimizer"] = optimizer.state_dict()
        out["rng"] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                      "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    return out


def save_training_checkpoint(run_dir: Path, model: Transformer, optimizer: torch.optim.Optimizer,
                             tokenizer: Tokenizer, config: Config, state: TrainState, is_best: bool = False,
                             keep_step_checkpoint: bool = False) -> None:
    """Write last.pt (and best.pt, step_N.pt), pruning step checkpoints beyond keep_last_checkpoints."""
    folder = run_dir / "checkpoints"
    full = _checkpoint_state(model, optimizer, tokenizer, config, state)
    save_checkpoint(full, folder / "last.pt")
    if is_best:
        save_checkpoint(_checkpoint_state(model, None, tokenizer, config, state), folder / "best.pt")
    keep = config.training.keep_last_checkpoints
    if keep_step_checkpoint and keep > 0:
        save_checkpoint(full, folder / f"step_{state.step}.pt")
        steps = sorted(folder.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
        for old in steps[:-keep]:
            old.unlink()


def _restore(run_dir: Path, model: Transformer, optimizer: torch.optim.Optimizer, config: Config,
             device: torch.device, dist: Distributed) -> TrainState:
    path = run_dir / "checkpoints" / "last.pt"
    saved = load_checkpoint(path, map_location=device)
    if saved["config"]["model"] != config.to_dict()["model"]:
        raise ConfigError(f"{path}: the model section of the config differs from the checkpoint's; "
                          "resume with the same model settings or start a new --run-dir")
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state = TrainState(**saved["train_state"])
    if dist.is_distributed:  # one saved RNG state, several processes: derive one stream per process
        torch.manual_seed(config.training.seed + 1_000_003 * state.step + dist.rank)
        random.seed(config.training.seed + 1_000_003 * state.step + dist.rank)
    else:
        torch.set_rng_state(saved["rng"]["torch"].cpu())
        random.setstate(_as_tuple(saved["rng"]["python"]))
        if saved["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in saved["rng"]["cuda"]])
    logger.info("resumed from %s at step %d (epoch %d, batch %d)", path, state.step, state.epoch,
                state.batch_in_epoch)
    return state


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


class MetricsLog:
    """Appends JSON lines to run_dir/metrics.jsonl; on resume, drops lines past the resumed step."""

    def __init__(self, path: Path, resume_step: Optional[int]) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        elif resume_step is None:
            path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


class _StopRequest:
    """SIGINT/SIGTERM handler: remember the request, finish the current update, then stop."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopRequest":
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


def _setup(config: Config, dist: Distributed) -> torch.device:
    random.seed(config.training.seed + dist.rank)
    torch.manual_seed(config.training.seed + dist.rank)  # dropout differs per process; DDP syncs the weights
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    device = resolve_device(config.training.device)
    if device.type == "cuda" and dist.is_distributed:
        device = torch.device("cuda", dist.local_rank)
    if config.training.precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"training.precision: fp16 needs a CUDA device (this run is on {device}); "
                          "use bf16 or fp32")
    return device


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
    train_data: EncodedPairs
    valid_data: Optional[ValidationSet]
    """None on every process but rank 0."""
    config: Config
    run_dir: Path
    device: torch.device
    dist: Distributed
    metrics: Optional["MetricsLog"]
    """None on every process but rank 0."""


def train(config: Config, run_dir: str | Path, resume: bool = False,
          stop_at_step: Optional[int] = None) -> TrainState:
    """Train a Transformer as the config says, writing everything into run_dir.

    Under torchrun (WORLD_SIZE > 1) every process runs this; they split each update's batches, DDP averages
    the gradients, and only rank 0 validates, writes checkpoints, metrics and the progress bar.

    Args:
        config: the validated config.
        run_dir: the run directory (created if needed).
        resume: continue from `run_dir/checkpoints/last.pt` with the same schedule, optimizer moments,
            batch order position and RNG state (any number of processes).
        stop_at_step: stop (with a checkpoint, as on SIGINT) after this update; for tests of resuming.

    Returns:
        The final `TrainState`.

    Raises:
        ConfigError, DataError, TokenizerError: bad settings or data, before any long work.
        CheckpointError: `resume` with a missing or corrupt last.pt.
        TrainingInterrupted: after SIGINT/SIGTERM (or stop_at_step), once last.pt is saved.
        NonFiniteLossError: after `max_nonfinite_steps` non-finite updates in a row.
    """
    run_dir = Path(run_dir)
    if resume and not (run_dir / "checkpoints" / "last.pt").exists():
        raise ConfigError(f"--resume: no checkpoint {run_dir / 'checkpoints' / 'last.pt'} to resume from")
    dist = init_distributed()
    device = _setup(config, dist)
    tokenizer, train_data, valid_data = prepare_data(config, run_dir, dist)
    if dist.is_main:
        save_config(config, run_dir / "config.yaml")
    model = Transformer(config.model).to(device)
    optimizer = build_optimizer(model, config.training, device)
    state = _restore(run_dir, model, optimizer, config, device, dist) if resume else TrainState()
    module: nn.Module = LossComputation(model, config.training.label_smoothing)
    if dist.is_distributed:
        module = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    if config.training.compile:
        module = torch.compile(module)
    scaler = torch.amp.GradScaler("cuda") if config.training.precision == "fp16" else None
    logger.info("model: %d parameters; device %s; %d process(es); %d training pairs", model.num_parameters(),
                device, dist.world_size, len(train_data))
    metrics = MetricsLog(run_dir / "metrics.jsonl", state.step if resume else None) if dist.is_main else None
    run = TrainingRun(model, module, optimizer, scaler, tokenizer, train_data, valid_data, config, run_dir, device,
                      dist, metrics)
    with _StopRequest() as stop, tqdm(total=config.training.max_steps, initial=state.step, unit="step",
                                      dynamic_ncols=True, mininterval=1.0, disable=not dist.is_main) as bar:
        _loop(run, state, stop, bar, stop_at_step)
    return state


def _next_update(run: TrainingRun, batches: list[np.ndarray], state: TrainState) -> Optional[list[np.ndarray]]:
    """The batches of the next update over all processes, or None when the epoch's rest cannot give every
    process a batch (that short tail is skipped)."""
    size = run.config.training.accumulate_steps * run.dist.world_size
    group = batches[state.batch_in_epoch:state.batch_in_epoch + size]
    if len(group) < run.dist.world_size:
        state.batch_in_epoch = len(batches)
        return None
    state.batch_in_epoch += len(group)
    return group


def _loop(run: TrainingRun, state: TrainState, stop: _StopRequest, bar: tqdm, stop_at_step: Optional[int]) -> None:
    t, data, dist = run.config.training, run.train_data, run.dist
    run.module.train()
    window_start = time.perf_counter()
    resumed_elapsed, loop_start = state.elapsed_s, time.perf_counter()
    pin = run.device.type == "cuda"
    while state.step < t.max_steps and not (t.max_epochs and state.epoch >= t.max_epochs):
        batches = epoch_batches(data, run.config, state.epoch)
        while state.batch_in_epoch < len(batches) and state.step < t.max_steps:
            group = _next_update(run, batches, state)
            if group is None:
                break
            n_tokens = int(sum(data.tgt_lengths[g].sum() for g in group))  # over all processes
            mine = group[dist.rank::dist.world_size]  # this process's share
            made = [data.batch(g) for g in mine]
            made = [(b.pin_memory() if pin else b).to(run.device) for b in made]
            set_lr(run.optimizer, learning_rate(state.step + 1, t, run.config.model.d_model))
            result = train_step(run.module, run.optimizer, made, run.config, n_tokens, dist.world_size, run.scaler)
            state.step += 1
            state.elapsed_s = resumed_elapsed + time.perf_counter() - loop_start
            if result is None:
                _count_nonfinite(state, run.config, run.run_dir)
            else:
                state.nonfinite_in_a_row = 0
                state.window_loss = state.window_loss + result[0]  # tensors: no device sync until logged
                state.window_nll = state.window_nll + result[1]
                state.window_tokens += sum(b.n_tgt_tokens for b in made)
                state.window_src_tokens += sum(b.n_src_tokens for b in made)
            bar.update(1)
            if state.step % t.log_every_steps == 0:
                _log_window(run, time.perf_counter() - window_start, state, bar)
                window_start = time.perf_counter()
            if state.step % t.eval_every_steps == 0 or state.step >= t.max_steps:
                valid_start = time.perf_counter()
                if _validate_and_save(run, state):
                    return  # early stopping
                window_start += time.perf_counter() - valid_start  # tokens/s counts training time only
            elif t.save_every_steps and state.step % t.save_every_steps == 0 and dist.is_main:
                save_start = time.perf_counter()
                save_training_checkpoint(run.run_dir, run.model, run.optimizer, run.tokenizer, run.config, state,
                                         keep_step_checkpoint=True)
                window_start += time.perf_counter() - save_start
            requested = stop.signal_name or (stop_at_step is not None and state.step >= stop_at_step)
            if dist.any(bool(requested), run.device) if dist.is_distributed else requested:
                if dist.is_main:
                    save_training_checkpoint(run.run_dir, run.model, run.optimizer, run.tokenizer, run.config, state)
                raise TrainingInterrupted(
                    f"{stop.signal_name or 'stop requested'}: stopped at step {state.step}; saved "
                    f"{run.run_dir / 'checkpoints' / 'last.pt'}. Resume with the same command plus --resume")
        if state.batch_in_epoch >= len(batches):
            state.epoch += 1
            state.batch_in_epoch = 0
    if state.step % t.eval_every_steps and state.step < t.max_steps:  # stopped by max_epochs
        _validate_and_save(run, state)


def _count_nonfinite(state: TrainState, config: Config, run_dir: Path) -> None:
    state.nonfinite_in_a_row += 1
    state.n_skipped_updates += 1
    logger.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)", state.step,
                   state.nonfinite_in_a_row)
    if state.nonfinite_in_a_row >= config.training.max_nonfinite_steps:
        raise NonFiniteLossError(
            f"{state.nonfinite_in_a_row} updates in a row had a non-finite loss or gradient (limit "
            f"training.max_nonfinite_steps={config.training.max_nonfinite_steps}); the last good checkpoint is "
            f"{run_dir / 'checkpoints' / 'last.pt'}. Try a lower training.lr_scale or training.clip_grad_norm: 1.0")


def _log_window(run: TrainingRun, elapsed: float, state: TrainState, bar: tqdm) -> None:
    """Sum the window over processes (the one device sync of the log interval) and write a "train" record."""
    loss, nll, tokens, src_tokens = run.dist.all_reduce_sum(
        [float(state.window_loss), float(state.window_nll), state.window_tokens, state.window_src_tokens], run.device)
    state.window_loss = state.window_nll = 0.0
    state.window_tokens = state.window_src_tokens = 0
    if not tokens or run.metrics is None:
        return
    lr = run.optimizer.param_groups[0]["lr"]
    record = {"type": "train", "step": state.step, "epoch": state.epoch, "loss": round(loss / tokens, 4),
              "nll": round(nll / tokens, 4), "ppl": round(math.exp(min(nll / tokens, 50)), 2), "lr": lr,
              "tgt_tokens_per_s": round(tokens / elapsed, 1),
              "src_tgt_tokens_per_s": round((tokens + src_tokens) / elapsed, 1),
              "skipped_updates": state.n_skipped_updates, "elapsed_s": round(state.elapsed_s, 1)}
    run.metrics.write(record)
    bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{record['tgt_tokens_per_s']:.0f}")


def _validate_and_save(run: TrainingRun, state: TrainState) -> bool:
    """Validate and checkpoint on rank 0, share the outcome, and return True when early stopping says stop."""
    stop = False
    if run.dist.is_main:
        start = time.perf_counter()
        result = validate(run.model, run.tokenizer, run.valid_data, run.config, run.device)
        run.module.train()
        is_best = result["bleu"] > state.best_bleu
        if is_best:
            state.best_bleu, state.evals_without_improvement = result["bleu"], 0
        else:
            state.evals_without_improvement += 1
        run.metrics.write({"type": "valid", "step": state.step, "epoch": state.epoch, **result,
                           "best_bleu": state.best_bleu, "valid_s": round(time.perf_counter() - start, 1),
                           "elapsed_s": round(state.elapsed_s, 1)})
        tqdm.write(f"step {state.step}: valid loss {result['loss']:.3f} ppl {result['ppl']:.2f} "
                   f"BLEU {result['bleu']:.2f} (best {state.best_bleu:.2f})")
        save_training_checkpoint(run.run_dir, run.model, run.optimizer, run.tokenizer, run.config, state,
                                 is_best=is_best, keep_step_checkpoint=True)
        patience = run.config.training.patience
        stop = bool(patience and state.evals_without_improvement >= patience)
        if stop:
            tqdm.write(f"early stopping: no BLEU improvement in {patience} validations")
    state.best_bleu, state.evals_without_improvement, stop = run.dist.broadcast(
        (state.best_bleu, state.evals_without_improvement, stop))
    return stop
