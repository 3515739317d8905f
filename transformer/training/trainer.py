"""The training loop: `train(config, run_dir)`.

Order of one update (the familiar one): set the learning rate → forward and backward over
`accumulate_steps` batches → clip → optimizer step → log → validate → checkpoint.

The run directory holds:
    config.yaml                 the resolved config
    spm.model (or spm.{lang}.model)   the sentencepiece model(s)
    checkpoints/last.pt, best.pt, step_N.pt (the last `keep_last_checkpoints`)
    metrics.jsonl               one JSON line per logged step ("train") and per validation ("valid")
"""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from ..config import PAD_ID, Config, ConfigError, DecodingConfig, save_config
from ..data import Batch, DataError, load_split, make_batch, token_batches
from ..device import resolve_device
from ..evaluate import corpus_scores
from ..model import Transformer
from ..tokenizer import Tokenizer, train_tokenizer
from ..translate import Translator
from .checkpoint import load_checkpoint, save_checkpoint
from .loss import label_smoothed_cross_entropy
from .optim import build_optimizer, inverse_sqrt_lr, set_lr

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


@dataclass
class EncodedData:
    """Token ids of one split (source with eos; target without bos/eos) and the raw references."""

    src: list[list[int]]
    tgt: list[list[int]]
    references: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Data preparation
# --------------------------------------------------------------------------------------------------


def prepare_data(config: Config, run_dir: Path) -> tuple[Tokenizer, EncodedData, EncodedData]:
    """Load train and validation splits (failing fast on bad data), get the tokenizer, encode once.

    The tokenizer saved in run_dir is reused; otherwise one is trained on the training split and saved.

    Raises:
        DataError: missing/misaligned/empty files or a missing language.
        TokenizerError: vocabulary size unreachable.
    """
    data = config.data
    train_corpus = load_split(data, data.train_split)
    valid_corpus = load_split(data, data.valid_split)
    logger.info("train: %d pairs from %s", len(train_corpus), train_corpus.origin)
    logger.info("valid: %d pairs from %s", len(valid_corpus), valid_corpus.origin)
    for src, tgt in list(zip(train_corpus.src, train_corpus.tgt))[:2]:
        logger.info("example pair  %s: %s  ->  %s: %s", data.src_lang, src, data.tgt_lang, tgt)
    tokenizer = Tokenizer.load(run_dir, data.src_lang, data.tgt_lang, data.joint_vocab)
    if tokenizer is None:
        tokenizer = train_tokenizer(train_corpus.src, train_corpus.tgt, data)
        for path in tokenizer.save(run_dir, data.src_lang, data.tgt_lang):
            logger.info("saved sentencepiece model %s", path)
    else:
        logger.info("reusing the sentencepiece model(s) in %s", run_dir)
    if (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size) != (config.model.src_vocab_size,
                                                                config.model.tgt_vocab_size):
        raise ConfigError(f"data.vocab_size={data.vocab_size} but the sentencepiece model(s) in {run_dir} have "
                          f"{tokenizer.src_vocab_size}/{tokenizer.tgt_vocab_size} pieces; use a new --run-dir")
    train = _encode(tokenizer, train_corpus.src, train_corpus.tgt)
    kept = [i for i in range(len(train.src))
            if 1 < len(train.src[i]) <= data.max_len and 0 < len(train.tgt[i]) < data.max_len]
    n_dropped = len(train.src) - len(kept)
    logger.info("dropped %d of %d training pairs that are empty or longer than data.max_len=%d tokens",
                n_dropped, len(train.src), data.max_len)
    if not kept:
        raise DataError(f"{train_corpus.origin}: no training pair is left after dropping those longer than "
                        f"data.max_len={data.max_len} tokens")
    train = EncodedData([train.src[i] for i in kept], [train.tgt[i] for i in kept])
    valid = _encode(tokenizer, valid_corpus.src, valid_corpus.tgt)
    valid.references = valid_corpus.tgt
    return tokenizer, train, valid


def _encode(tokenizer: Tokenizer, src: list[str], tgt: list[str]) -> EncodedData:
    return EncodedData(tokenizer.encode_src(src), tokenizer.encode_tgt(tgt))


def epoch_batches(data: EncodedData, config: Config, epoch: int) -> list[list[int]]:
    """The batches (lists of example indices) of one epoch, fixed by the seed and the epoch number."""
    return token_batches([len(s) for s in data.src], [len(t) + 1 for t in data.tgt],
                         config.data.max_tokens_per_batch, config.training.seed, epoch, config.data.pool_factor)


# --------------------------------------------------------------------------------------------------
# One update
# --------------------------------------------------------------------------------------------------


def batch_loss(model: Transformer, batch: Batch, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed loss and NLL of a batch; logits are computed only at non-pad targets."""
    memory = model.encode(batch.src, batch.src_key_padding_mask)
    hidden = model.decoder(batch.tgt_in, memory, batch.src_key_padding_mask)  # (batch, tgt_len, d_model)
    keep = batch.tgt_out.ne(PAD_ID)
    logits = model.output_projection(hidden[keep])  # (n_tgt_tokens, tgt_vocab_size)
    return label_smoothed_cross_entropy(logits, batch.tgt_out[keep], label_smoothing, PAD_ID)


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, batches: list[Batch],
               config: Config) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Forward/backward over `batches` (gradient accumulation), clip, and update.

    The loss is normalised by the number of target tokens of all the batches together.

    Returns:
        (summed loss, summed nll) as tensors, or None if the loss or gradient was not finite (the update
        is skipped).
    """
    optimizer.zero_grad(set_to_none=True)
    n_tokens = sum(b.n_tgt_tokens for b in batches)
    total_loss = total_nll = 0.0
    device_type = batches[0].src.device.type
    use_bf16 = config.training.precision == "bf16"
    for batch in batches:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=use_bf16):
            loss, nll = batch_loss(model, batch, config.training.label_smoothing)
        (loss / n_tokens).backward()
        total_loss, total_nll = total_loss + loss.detach(), total_nll + nll.detach()
    max_norm = config.training.clip_grad_norm or float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    if not (torch.isfinite(grad_norm) and torch.isfinite(total_loss)):
        optimizer.zero_grad(set_to_none=True)
        return None
    optimizer.step()
    return total_loss, total_nll


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def validate(model: Transformer, tokenizer: Tokenizer, valid: EncodedData, config: Config,
             device: torch.device) -> dict[str, Any]:
    """Validation loss and perplexity (teacher forcing) and BLEU/chrF of greedy decodes.

    Returns:
        {"loss", "nll", "ppl", "bleu", "chrf", "bleu_signature", "n_sentences"}: loss and nll per target token.
    """
    model.eval()
    total_loss = total_nll = 0.0
    n_tokens = 0
    for indices in epoch_batches(valid, config, epoch=0):
        batch = make_batch([valid.src[i] for i in indices], [valid.tgt[i] for i in indices]).to(device)
        loss, nll = batch_loss(model, batch, config.training.label_smoothing)
        total_loss, total_nll = total_loss + loss.item(), total_nll + nll.item()
        n_tokens += batch.n_tgt_tokens
    limit = config.data.valid_max_sentences or len(valid.src)
    translator = Translator(model, tokenizer, config, device)
    greedy = DecodingConfig(**{**config.decoding.__dict__, "beam_size": 1, "n_best": 1})
    hyps = translator.decode_ids(list(valid.src[:limit]), greedy)
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
             device: torch.device) -> TrainState:
    path = run_dir / "checkpoints" / "last.pt"
    saved = load_checkpoint(path, map_location=device)
    if saved["config"]["model"] != config.to_dict()["model"]:
        raise ConfigError(f"{path}: the model section of the config differs from the checkpoint's; "
                          "resume with the same model settings or start a new --run-dir")
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state = TrainState(**saved["train_state"])
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


def _setup(config: Config) -> torch.device:
    random.seed(config.training.seed)
    torch.manual_seed(config.training.seed)
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    return resolve_device(config.training.device)


def train(config: Config, run_dir: str | Path, resume: bool = False,
          stop_at_step: Optional[int] = None) -> TrainState:
    """Train a Transformer as the config says, writing everything into run_dir.

    Args:
        config: the validated config.
        run_dir: the run directory (created if needed).
        resume: continue from `run_dir/checkpoints/last.pt` with the same schedule, optimizer moments,
            batch order position and RNG state.
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
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume and not (run_dir / "checkpoints" / "last.pt").exists():
        raise ConfigError(f"--resume: no checkpoint {run_dir / 'checkpoints' / 'last.pt'} to resume from")
    device = _setup(config)
    tokenizer, train_data, valid_data = prepare_data(config, run_dir)
    save_config(config, run_dir / "config.yaml")
    model = Transformer(config.model).to(device)
    optimizer = build_optimizer(model, config.training, device)
    state = _restore(run_dir, model, optimizer, config, device) if resume else TrainState()
    logger.info("model: %d parameters; device %s; %d training pairs", model.num_parameters(), device,
                len(train_data.src))
    metrics = MetricsLog(run_dir / "metrics.jsonl", state.step if resume else None)
    with _StopRequest() as stop, tqdm(total=config.training.max_steps, initial=state.step, unit="step",
                                      dynamic_ncols=True, mininterval=1.0) as bar:
        _loop(model, optimizer, tokenizer, train_data, valid_data, config, run_dir, device, state, metrics,
              stop, bar, stop_at_step)
    return state


def _loop(model: Transformer, optimizer: torch.optim.Optimizer, tokenizer: Tokenizer, train_data: EncodedData,
          valid_data: EncodedData, config: Config, run_dir: Path, device: torch.device, state: TrainState,
          metrics: MetricsLog, stop: _StopRequest, bar: tqdm, stop_at_step: Optional[int]) -> None:
    t = config.training
    model.train()
    window_start = time.perf_counter()
    resumed_elapsed, loop_start = state.elapsed_s, time.perf_counter()
    pin = device.type == "cuda"
    while state.step < t.max_steps and not (t.max_epochs and state.epoch >= t.max_epochs):
        batches = epoch_batches(train_data, config, state.epoch)
        while state.batch_in_epoch < len(batches) and state.step < t.max_steps:
            group = batches[state.batch_in_epoch:state.batch_in_epoch + t.accumulate_steps]
            state.batch_in_epoch += len(group)
            made = [make_batch([train_data.src[i] for i in g], [train_data.tgt[i] for i in g], g) for g in group]
            made = [(b.pin_memory() if pin else b).to(device) for b in made]
            set_lr(optimizer, inverse_sqrt_lr(state.step + 1, config.model.d_model, t.warmup_steps, t.lr_scale))
            result = train_step(model, optimizer, made, config)
            state.step += 1
            state.elapsed_s = resumed_elapsed + time.perf_counter() - loop_start
            if result is None:
                _count_nonfinite(state, config, run_dir)
            else:
                state.nonfinite_in_a_row = 0
                state.window_loss = state.window_loss + result[0]  # tensors: no device sync until logged
                state.window_nll = state.window_nll + result[1]
                state.window_tokens += sum(b.n_tgt_tokens for b in made)
                state.window_src_tokens += sum(b.n_src_tokens for b in made)
            bar.update(1)
            if state.step % t.log_every_steps == 0 and state.window_tokens:
                _log_window(time.perf_counter() - window_start, optimizer, state, metrics, bar)
                window_start = time.perf_counter()
            is_last = state.step >= t.max_steps
            if state.step % t.eval_every_steps == 0 or is_last:
                valid_start = time.perf_counter()
                if _validate_and_save(model, optimizer, tokenizer, valid_data, config, run_dir, device, state,
                                      metrics):
                    return  # early stopping
                window_start += time.perf_counter() - valid_start  # tokens/s counts training time only
            if stop.signal_name or (stop_at_step is not None and state.step >= stop_at_step):
                save_training_checkpoint(run_dir, model, optimizer, tokenizer, config, state)
                raise TrainingInterrupted(
                    f"{stop.signal_name or 'stop_at_step'}: stopped at step {state.step}; saved "
                    f"{run_dir / 'checkpoints' / 'last.pt'}. Resume with the same command plus --resume")
        if state.batch_in_epoch >= len(batches):
            state.epoch += 1
            state.batch_in_epoch = 0
    if state.step % t.eval_every_steps and state.step < t.max_steps:  # stopped by max_epochs
        _validate_and_save(model, optimizer, tokenizer, valid_data, config, run_dir, device, state, metrics)


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


def _log_window(elapsed: float, optimizer: torch.optim.Optimizer, state: TrainState, metrics: MetricsLog,
                bar: tqdm) -> None:
    loss = float(state.window_loss) / state.window_tokens
    nll = float(state.window_nll) / state.window_tokens
    lr = optimizer.param_groups[0]["lr"]
    record = {"type": "train", "step": state.step, "epoch": state.epoch, "loss": round(loss, 4),
              "nll": round(nll, 4), "ppl": round(math.exp(min(nll, 50)), 2), "lr": lr,
              "tgt_tokens_per_s": round(state.window_tokens / elapsed, 1),
              "src_tgt_tokens_per_s": round((state.window_tokens + state.window_src_tokens) / elapsed, 1),
              "skipped_updates": state.n_skipped_updates, "elapsed_s": round(state.elapsed_s, 1)}
    metrics.write(record)
    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{record['tgt_tokens_per_s']:.0f}")
    state.window_loss = state.window_nll = 0.0
    state.window_tokens = state.window_src_tokens = 0


def _validate_and_save(model: Transformer, optimizer: torch.optim.Optimizer, tokenizer: Tokenizer,
                       valid_data: EncodedData, config: Config, run_dir: Path, device: torch.device,
                       state: TrainState, metrics: MetricsLog) -> bool:
    """Validate, checkpoint, and return True when early stopping says to stop."""
    start = time.perf_counter()
    result = validate(model, tokenizer, valid_data, config, device)
    is_best = result["bleu"] > state.best_bleu
    if is_best:
        state.best_bleu, state.evals_without_improvement = result["bleu"], 0
    else:
        state.evals_without_improvement += 1
    metrics.write({"type": "valid", "step": state.step, "epoch": state.epoch, **result,
                   "best_bleu": state.best_bleu, "valid_s": round(time.perf_counter() - start, 1),
                   "elapsed_s": round(state.elapsed_s, 1)})
    tqdm.write(f"step {state.step}: valid loss {result['loss']:.3f} ppl {result['ppl']:.2f} "
               f"BLEU {result['bleu']:.2f} (best {state.best_bleu:.2f})")
    save_training_checkpoint(run_dir, model, optimizer, tokenizer, config, state, is_best=is_best,
                             keep_step_checkpoint=True)
    patience = config.training.patience
    if patience and state.evals_without_improvement >= patience:
        tqdm.write(f"early stopping: no BLEU improvement in {patience} validations")
        return True
    return False
