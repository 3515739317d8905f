"""Fine-tuning: a run that starts from another model's weights and tokenizer (`transformer train --init-from`).

    transformer train --config C --init-from RUN/checkpoints/best.pt     # one of our checkpoints
    transformer train --config C --init-from opus-mt-de-en               # a MarianMT folder (transformer/hf.py)

The weights and the tokenizer come from SOURCE (no sentencepiece model is trained); the data, the optimizer, the
schedule, the counters, the best score, early stopping and the step checkpoints start fresh, so the first
validation of the new run writes its own best.pt. The keys that SOURCE fixes are taken from it: every model key but
the dropouts and max_positions (`FIXED_MODEL_KEYS`), and the tokenizer's data keys (`FIXED_DATA_KEYS`). A recipe or
`--set` that gives one of them another value is refused, naming the key and both values. The run's config records
SOURCE and the SHA-256 of its content (training.init_from, training.init_from_sha256).

`--resume` of a fine-tuning run continues from its own last.pt, like any run: SOURCE is not read again (the keys it
fixed come from the run's checkpoint), so it may have moved or changed since.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint import load_checkpoint
from ..config import Config, ConfigError, TransformerConfig, check_trainable, config_from_dict
from ..config.languages import language_tokens, target_languages
from ..engines import load_model
from ..tokenizer import Tokenizer, TokenizerError

FREE_MODEL_KEYS = ("dropout", "attention_dropout", "max_positions")
"""Model keys a fine-tuning run may set differently from its source (they change no weight)."""
FIXED_MODEL_KEYS = tuple(
    f.name
    for f in dataclasses.fields(TransformerConfig)
    if f.name not in FREE_MODEL_KEYS + ("src_vocab_size", "tgt_vocab_size")
)
"""Model keys taken from the source (sizes, vocabulary sharing, norm placement, activation, output bias)."""
FIXED_DATA_KEYS = ("vocab_size", "joint_vocab", "spm_model_type")
"""Data keys that describe the source's tokenizer."""


@dataclass
class InitSource:
    """What a fine-tuning run starts from.

    Attributes:
        path: the checkpoint file or MarianMT folder, as given.
        sha256: of its content (`content_sha256`).
        config: its config (model section complete).
        model_state: its weights as our state dict, or None when only the config is known (on --resume).
        tokenizer: its tokenizer, or None on --resume.
    """

    path: str
    sha256: str
    config: Config
    model_state: Optional[dict[str, torch.Tensor]] = None
    tokenizer: Optional[Tokenizer] = None


def content_sha256(path: str | Path) -> str:
    """SHA-256 of a file, or of a folder's files (names and bytes, in name order; hidden files skipped)."""
    path = Path(path)
    digest = hashlib.sha256()
    hidden = lambda p: any(part.startswith(".") for part in p.relative_to(path).parts)  # noqa: E731
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.rglob("*") if p.is_file() and not hidden(p))
    )
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def load_source(path: str | Path) -> InitSource:
    """Read SOURCE: our checkpoint (.pt) or a MarianMT folder.

    Raises:
        CheckpointError: missing or unreadable.
        ConfigError: a Marian model ours cannot express.
    """
    config, model, tokenizer = load_model(path)
    return InitSource(str(path), content_sha256(path), config, model.state_dict(), tokenizer)


def source_of_run(last_checkpoint: Path) -> Optional[InitSource]:
    """The source recorded in a run's last.pt (config only), or None if the run was trained from scratch.

    Raises:
        CheckpointError: last.pt missing or unreadable.
    """
    saved = load_checkpoint(last_checkpoint)
    config = config_from_dict(saved["config"], vocab_sizes=tuple(saved["vocab_sizes"]))
    if config.training.init_from is None:
        return None
    return InitSource(config.training.init_from, config.training.init_from_sha256, config)


def fine_tuning_config(raw: dict[str, Any], source: InitSource, where: str) -> Config:
    """The run's config: the recipe `raw` (YAML with overrides applied, unvalidated) with the keys SOURCE fixes
    taken from it and the source recorded.

    Args:
        where: the recipe's name, for messages (e.g. "configs/x.yaml with --set ...").

    Raises:
        ConfigError: every refusal at once (joined by " | "): a key SOURCE fixes set to another value (naming the key
            and both values), training.init_from set otherwise, any invalid key, a language token or tag the
            source's vocabulary lacks.
    """
    raw = copy.deepcopy(raw) if isinstance(raw, dict) else raw
    if not isinstance(raw, dict):
        return config_from_dict(raw)  # its own error
    fixed = {
        "model": (source.config.model, FIXED_MODEL_KEYS),
        "data": (source.config.data, FIXED_DATA_KEYS),
    }
    refused, problems = [], []
    for section, (values, keys) in fixed.items():
        given = raw.get(section) or {}
        raw[section] = given
        for key in keys:
            theirs = getattr(values, key)
            if key in given and given[key] != theirs:
                refused.append(f"{section}.{key}={given[key]!r} (the source has {theirs!r})")
            given[key] = theirs
    if refused:
        problems.append(
            f"it fixes the model and its tokenizer, but the config sets {'; '.join(refused)}: remove these keys "
            "or give the source's values"
        )
    training = raw.get("training") or {}
    raw["training"] = training
    for key, value in (("init_from", source.path), ("init_from_sha256", source.sha256)):
        if training.get(key) not in (None, value):
            problems.append(f"training.{key} is set by --init-from; remove it from the config")
        training[key] = value
    model = source.config.model
    try:  # with the source's values in place: what else is wrong is said in the same message
        config = config_from_dict(raw, vocab_sizes=(model.src_vocab_size, model.tgt_vocab_size))
    except ConfigError as err:
        problems.append(str(err))
    else:
        try:
            check_trainable(config)
        except ConfigError as err:
            problems.append(str(err))
        problems += _language_problems(config, source)
    if problems:
        raise ConfigError(
            f"{where}: --init-from {source.path}: " + " | ".join(problems)
            if len(problems) > 1 or refused
            else f"{where}: {problems[0]}"
        )
    return config


def _language_problems(config: Config, source: InitSource) -> list[str]:
    """A source whose sources carry language tokens (a multilingual model, fine-tuned on one direction or a new mix)
    keeps them: the run's corpora must carry them too (data.directions, not src_lang/tgt_lang alone, which would
    train without the token), and each of the run's tokens and tags must be a piece of the source's vocabulary (a
    new one is not added: the weights have no row for it). Returns every refusal (none: it can start), each naming
    its key."""
    theirs, ours = language_tokens(source.config.data), language_tokens(config.data)
    if theirs and not ours:
        directions = ", ".join(corpus.direction for corpus in source.config.data.corpora)
        return [
            f"data.directions: --init-from {source.path} is a multilingual model ({directions}): set "
            f"data.directions (e.g. [{config.data.src_lang}-{config.data.tgt_lang}]) so that its "
            "sources keep their target-language token"
        ]
    if source.tokenizer is None:  # --resume: the run's own checkpoint was checked when it started
        return []
    problems = []
    for corpus in config.data.corpora:
        try:
            source.tokenizer.source_prefix(corpus)
        except TokenizerError:
            if corpus.tag and corpus.language_token is None or corpus.held_out is False:
                problems.append(
                    f"data.synthetic ({corpus.name}): --init-from {source.path} has no piece {corpus.tag} in its "
                    "vocabulary (a tag is added only to a vocabulary trained with it): set tag: '' for this "
                    "corpus, or train from scratch"
                )
                continue
            have = (
                ", ".join(target_languages(source.config.data))
                if theirs
                else "none (a bilingual model)"
            )
            problems.append(
                f"data.directions: --init-from {source.path} has no {corpus.language_token} "
                f"token in its vocabulary, so it cannot learn to translate into {corpus.tgt_lang}; its "
                f"target languages: {have}"
            )
    return list(dict.fromkeys(problems))


def run_config(
    config_path: str | Path,
    overrides: list[str],
    run_dir: Path,
    init_from: Optional[str],
    resume: bool,
) -> tuple[Config, Optional[InitSource]]:
    """The config of `transformer train` and, for a new fine-tuning run, its source (weights and tokenizer to load).

    Without --init-from this is `load_config`; with it, `fine_tuning_config` on SOURCE. With --resume the source
    recorded in the run's last.pt fixes the keys (SOURCE is not read again; --init-from may then be left out).

    Raises:
        ConfigError, CheckpointError: as `load_config`, `load_source` and `fine_tuning_config`.
    """
    from ..config import load_config, read_raw_config
    from .checkpoint import checkpoint_path

    where = f"{config_path} with --set {' '.join(overrides)}" if overrides else str(config_path)
    last = checkpoint_path(run_dir)
    source = None
    raw = read_raw_config(config_path, overrides)
    if not init_from and isinstance(
        raw, dict
    ):  # the recipe's own training.init_from, as if given by the flag
        init_from = recipe_init_from(raw, where)
    if resume and last.exists():
        recorded = source_of_run(last)
        if recorded is None:
            if init_from:
                raise ConfigError(
                    f"--init-from {init_from} with --resume: the run in {run_dir} was trained from "
                    "scratch; resume it without --init-from, or fine-tune into a new --run-dir"
                )
            config = load_config(config_path, overrides)
        else:
            config = fine_tuning_config(raw, recorded, where)
    elif not init_from:
        config = load_config(config_path, overrides)
    else:
        source = load_source(init_from)
        config = fine_tuning_config(raw, source, where)
    return with_absolute_data_path(config), source


def recipe_init_from(raw: dict[str, Any], where: str) -> Optional[str]:
    """The checkpoint a recipe's own `training.init_from` names, taken out of `raw` (the run records the file it
    read, as `--init-from` does): a checkpoint path as it is, a recipe (X.yaml) as the best.pt of its run
    `runs/X` (`config.loading.model_checkpoint`); None if the recipe names none.

    Raises:
        ConfigError: a recipe whose run has no best.pt yet (`transformer chain` trains it first).
    """
    from ..config.loading import model_checkpoint

    training = raw.get("training")
    if not isinstance(training, dict) or not training.get("init_from"):
        return None
    if training.get("init_from_sha256"):  # a recorded run's config (its source read already)
        return None
    value = training.pop("init_from")
    checkpoint = model_checkpoint(value)
    if not checkpoint.exists():
        raise ConfigError(
            f"{where}: training.init_from: {value}: {checkpoint} not found"
            + (
                f"; `transformer chain --config {value}` trains it"
                if str(value).endswith((".yaml", ".yml"))
                else ""
            )
        )
    return str(checkpoint)


def with_absolute_data_path(config: Config) -> Config:
    """`config` with a relative `data.path` (and synthetic corpora's paths) made absolute against the current
    folder, as the run records it: a checkpoint's `evaluate --split` then reads the same folder from wherever it
    runs."""
    data = config.data
    path = data.path if data.path is None else str(Path(data.path).resolve())
    synthetic = [dataclasses.replace(s, path=str(Path(s.path).resolve())) for s in data.synthetic]
    if path == data.path and synthetic == data.synthetic:
        return config
    return dataclasses.replace(
        config, data=dataclasses.replace(data, path=path, synthetic=synthetic)
    )
