"""Reading a recipe: YAML in, validated `Config` out, with `section.key=value` overrides.

`load_config(path, overrides)` validates everything at load time: an unknown key, a wrong type or a bad value
raises `ConfigError` naming the key path, the file (and the overrides) and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import yaml

from .errors import ConfigError, _require
from .sections import (
    _DERIVED_MODEL_KEYS,
    Config,
    DataConfig,
    DecodingConfig,
    TrainingConfig,
    TransformerConfig,
    check_trainable,
)

_SECTIONS = {
    "model": TransformerConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "decoding": DecodingConfig,
}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return str(tp).replace("typing.", "")
    return "null" if tp is type(None) else tp.__name__


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; int is accepted where float is expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is not None and len(options) == 1:  # Optional[X]: X's own message
            return _coerce(value, options[0], key)
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        _require(value is None, key, f"expected null, got {value!r}")
        return None
    if origin is tuple:
        args = typing.get_args(tp)
        _require(
            isinstance(value, (list, tuple)) and len(value) == len(args),
            key,
            f"expected a list of {len(args)} numbers, got {value!r}",
        )
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if origin is list:
        _require(isinstance(value, (list, tuple)), key, f"expected a list, got {value!r}")
        return [_coerce(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _require(isinstance(value, dict), key, f"expected a mapping, got {value!r}")
        return {str(k): _coerce(v, str, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):  # a section's entries of their own (data.synthetic)
        kwargs = _section_kwargs(tp, value, key)
        for f in dataclasses.fields(tp):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            _require(
                not required or f.name in kwargs,
                f"{key}.{f.name}",
                f.metadata.get("required", "required"),
            )
        try:
            return tp(**kwargs)
        except (
            ConfigError
        ) as err:  # its own checks name it by its field ("made_by.model"): name it in full
            first = (err.key or "").split(".")[0]
            if not first or key.rsplit(".", 1)[-1] != first:
                raise
            full = key + err.key[len(first) :]
            raise ConfigError(f"{full}: {err.detail}", key=full, detail=err.detail) from None
    if tp is bool:
        _require(isinstance(value, bool), key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        _require(
            isinstance(value, int) and not isinstance(value, bool),
            key,
            f"expected an integer, got {value!r}",
        )
        return value
    if tp is float:
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool),
            key,
            f"expected a number, got {value!r}",
        )
        return float(value)
    if tp is str:
        _require(isinstance(value, str), key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def _section_kwargs(cls: type, values: Any, section: str) -> dict[str, Any]:
    """Type-check one section's mapping against the fields of `cls`; returns the constructor kwargs."""
    _require(isinstance(values, dict), section, f"expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [
        f.name
        for f in dataclasses.fields(cls)
        if not (section == "model" and f.name in _DERIVED_MODEL_KEYS)
    ]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = (
                f"; did you mean {section}.{close[0]}?"
                if close
                else f"; allowed: {', '.join(names)}"
            )
            raise ConfigError(f"{section}.{key}: unknown key{hint}")
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    return kwargs


def _apply_override(
    raw: dict[str, Any], override: str, sections: tuple[str, ...] = tuple(_SECTIONS)
) -> None:
    """Apply one `section.key=value` override (value parsed as YAML) to the raw mapping."""
    if "=" not in override:
        raise ConfigError(
            f"--set {override!r}: expected the form section.key=value, e.g. {sections[-1]}.KEY=VALUE"
        )
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) > 2 and parts[0] in sections:
        raise ConfigError(
            f"--set {override!r}: --set reaches section.key only, not the entries of "
            f"{parts[0]}.{parts[1]}: give its whole value (e.g. --set '{parts[0]}.{parts[1]}=[...]' in YAML) or "
            "write a recipe that builds on this one (base: FILE) with the entries changed"
        )
    if len(parts) != 2 or parts[0] not in sections:
        close = difflib.get_close_matches(parts[0], sections, n=1) if len(parts) == 2 else []
        hint = f"; did you mean {close[0]}.{parts[1]}?" if close else ""
        raise ConfigError(
            f"--set {override!r}: the key must be section.key with a section among "
            f"{', '.join(sections)}{hint}"
        )
    section = raw.setdefault(parts[0], {})
    if section is None:
        section = raw[parts[0]] = {}
    section[parts[1]] = yaml.safe_load(text) if text.strip() else None


def config_from_dict(raw: dict[str, Any], vocab_sizes: Optional[tuple[int, int]] = None) -> Config:
    """Build and validate a `Config` from a plain mapping (a parsed YAML file or a checkpoint's copy).

    Args:
        raw: mapping with sections `model`, `data`, `training`, `decoding` (each optional but `data`).
        vocab_sizes: (src_vocab_size, tgt_vocab_size); by default both are `data.vocab_size`.

    Raises:
        ConfigError: naming the key path of the first invalid, unknown or missing value.
    """
    _require(
        isinstance(raw, dict),
        "config",
        f"the file must hold a mapping with sections {', '.join(_SECTIONS)}",
    )
    for key in raw:
        if key not in _SECTIONS:
            close = difflib.get_close_matches(str(key), list(_SECTIONS), n=1)
            hint = (
                f"did you mean {close[0]}?"
                if close
                else f"allowed sections: {', '.join(_SECTIONS)}"
            )
            raise ConfigError(f"{key}: unknown section; {hint}")
    kwargs = {
        name: _section_kwargs(cls, raw.get(name) or {}, name) for name, cls in _SECTIONS.items()
    }
    data = DataConfig(**kwargs["data"])
    if vocab_sizes is None:
        vocab_sizes = (data.vocab_size, data.vocab_size)
    if kwargs["model"].get("share_all_embeddings") and not data.joint_vocab:
        raise ConfigError(
            "model.share_all_embeddings: sharing source, target and output embeddings needs one "
            "joint vocabulary; set data.joint_vocab: true, or keep only model.tie_embeddings "
            "(target embedding and output projection)"
        )
    model = TransformerConfig(
        src_vocab_size=vocab_sizes[0], tgt_vocab_size=vocab_sizes[1], **kwargs["model"]
    )
    return Config(
        model=model,
        data=data,
        training=TrainingConfig(**kwargs["training"]),
        decoding=DecodingConfig(**kwargs["decoding"]),
    )


def load_config(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """Read a YAML recipe, apply `section.key=value` overrides and validate the result as a training recipe
    (`check_trainable`).

    Raises:
        ConfigError: the file is missing or not YAML, or a key is unknown, mistyped or out of range;
            the message starts with the file name (and the overrides, if any) and names the key path.
    """
    recipe = read_recipe(path)
    return _with_overrides(
        recipe.raw, overrides, tuple(_SECTIONS), str(path), None, check_trainable, recipe
    )


def read_raw_config(
    path: str | Path, overrides: tuple[str, ...] | list[str] = ()
) -> dict[str, Any]:
    """The YAML recipe as a plain mapping, its `base:` recipes merged in (`read_recipe`) and the overrides applied,
    but nothing validated or filled in: what the files and the command line set (fine-tuning compares it with the
    model it starts from).

    Raises:
        ConfigError: a file is missing or not YAML, `base:` names a missing file or makes a cycle, or an override
            is malformed.
    """
    raw = read_recipe(path).raw
    if overrides and isinstance(raw, dict):  # not a mapping: config_from_dict says so
        try:
            for override in overrides:
                _apply_override(raw, override)
        except ConfigError as err:  # the message names the --set it is about
            raise ConfigError(f"{path}: {err}") from None
    return raw


@dataclasses.dataclass
class Recipe:
    """A recipe read with its bases: `raw` the merged mapping (no `base` key), `origin` the file that set each key
    (dotted key path -> file; a list's entries belong to the file that set the list), `files` the recipe and its
    bases, the recipe first."""

    raw: Any
    origin: dict[str, Path]
    files: list[Path]

    def source_of(self, key: Optional[str]) -> Path:
        """The file that set `key` ("data.synthetic[1].tag", "model.d_model"), or of its closest parent set; the
        recipe itself for a key no file set (a default)."""
        key = re.sub(r"\[\d+\].*$", "", key or "")
        while key:
            if key in self.origin:
                return self.origin[key]
            key = key.rpartition(".")[0]
        return self.files[0]


BASE_KEY = "base"
"""A recipe's first key may name the recipe it builds on, relative to its own folder: `base: multi30k_de_en.yaml`.
The base's mappings are merged with this file's, key by key; a list (`directions`, `synthetic`) or a value this file
gives replaces the base's whole. A base may have a base; a cycle is refused."""


def read_recipe(path: str | Path) -> Recipe:
    """Read a recipe and the chain of recipes it builds on (`base:`), merged (`BASE_KEY`).

    Raises:
        ConfigError: a file is missing or not YAML, `base` is not a file name, or the bases make a cycle (naming
            the files).
    """
    files: list[Path] = []
    layers = []
    path = Path(path)
    while True:
        if any(path.resolve() == f.resolve() for f in files):
            cycle = " -> ".join(str(f) for f in [*files, path])
            raise ConfigError(f"{files[0]}: base: a cycle of recipes: {cycle}")
        files.append(path)
        raw = _read_yaml(path)
        if not isinstance(raw, dict) or BASE_KEY not in raw:
            layers.append((path, raw))
            break
        base = raw.pop(BASE_KEY)
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(
                f"{path}: base: expected the file name of the recipe this one builds on, got {base!r}"
            )
        layers.append((path, raw))
        path = path.parent / base
        if not path.is_file():
            raise ConfigError(f"{files[-1]}: base: {base}: no such recipe ({path})")
    merged: Any = {}
    origin: dict[str, Path] = {}
    for file, raw in reversed(layers):
        if not isinstance(raw, dict):  # config_from_dict says what is wrong
            return Recipe(raw, {}, files)
        _resolve_recipe_paths(raw, file.parent)
        merged = _merge(merged, raw, file, origin, "")
    return Recipe(merged, origin, files)


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None


def _merge(base: Any, over: Any, file: Path, origin: dict[str, Path], prefix: str) -> Any:
    """`over` merged onto `base`: mappings key by key, anything else replaced whole; `origin` records `file` for each
    key `over` sets."""
    if not (isinstance(base, dict) and isinstance(over, dict)):
        for key in [k for k in origin if k.startswith(prefix + ".")] if prefix else list(origin):
            del origin[key]  # what the base set below this key is gone
        if prefix:
            origin[prefix] = file
        if isinstance(over, dict):
            for key, value in over.items():
                _merge(None, value, file, origin, f"{prefix}.{key}" if prefix else str(key))
        return over
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(
            base.get(key), value, file, origin, f"{prefix}.{key}" if prefix else str(key)
        )
    return out


def _resolve_recipe_paths(raw: Any, folder: Path) -> Any:
    """`raw` with every value that names a recipe (`is_recipe`) made relative to `folder`, the file's own, as `base:`
    is (in place)."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            raw[key] = _resolve_recipe_paths(value, folder)
    elif isinstance(raw, list):
        raw[:] = [_resolve_recipe_paths(value, folder) for value in raw]
    elif is_recipe(raw) and not Path(raw).is_absolute():
        return str(folder / raw)
    return raw


RUNS = Path("runs")
"""Where the run of a recipe named in a recipe is written: runs/<recipe name> (`transformer chain`)."""


def run_dir_of(recipe: str | Path) -> Path:
    """The run folder of a recipe named in a recipe: runs/<its file name without .yaml>, as `transformer train`
    names a run by default (relative to the working directory)."""
    return RUNS / Path(recipe).stem


def model_checkpoint(model: str | Path) -> Path:
    """The checkpoint a model reference names (`made_by.model`, `training.init_from`): a recipe (X.yaml) is its
    run's best.pt (runs/X/checkpoints/best.pt), anything else a checkpoint path as given."""
    return run_dir_of(model) / "checkpoints" / "best.pt" if is_recipe(str(model)) else Path(model)


def is_recipe(value: Any) -> bool:
    """Whether a value of a recipe names another recipe (a model trained first: `made_by.model`,
    `training.init_from`): a file name ending in .yaml or .yml."""
    return isinstance(value, str) and value.endswith((".yaml", ".yml"))


def override_config(
    config: Config,
    overrides: tuple[str, ...] | list[str],
    sections: tuple[str, ...] = tuple(_SECTIONS),
    source: str = "config",
) -> Config:
    """`config` with `section.key=value` overrides applied and validated, as `load_config` applies them.

    Args:
        sections: the sections that may be overridden (e.g. ("data",) for evaluating a checkpoint).
        source: where `config` came from, for error messages (e.g. the checkpoint path).

    Raises:
        ConfigError: starting with the source and the overrides, naming the key path.
    """
    vocab_sizes = (config.model.src_vocab_size, config.model.tgt_vocab_size)
    return _with_overrides(config.to_dict(), overrides, sections, source, vocab_sizes)


def _with_overrides(
    raw: dict[str, Any],
    overrides: tuple[str, ...] | list[str],
    sections: tuple[str, ...],
    source: str,
    vocab_sizes: Optional[tuple[int, int]],
    check: Callable[[Config], None] = lambda config: None,
    recipe: Optional[Recipe] = None,
) -> Config:
    try:
        for override in overrides:
            _apply_override(raw, override, sections)
    except ConfigError as err:  # the message names the --set it is about
        raise ConfigError(f"{source}: {err}") from None
    try:
        config = config_from_dict(raw, vocab_sizes)
        check(config)
        return config
    except ConfigError as err:
        key = err.key or _key_of(str(err)) or ""
        overridden = any(key.startswith(o.split("=", 1)[0].strip()) for o in overrides)
        if recipe is not None and len(recipe.files) > 1 and not overridden:
            file = recipe.source_of(key)  # the file that set the key, and the recipe built on it
            if file != recipe.files[0]:
                source = f"{file} (a base of {source})"
        where = f"{source} with --set {' '.join(overrides)}" if overrides else source
        raise ConfigError(f"{where}: {err}") from None


def _key_of(message: str) -> Optional[str]:
    """The key path a message starts with ("data.max_len: ..."), if any."""
    match = re.match(r"([A-Za-z_][\w.\[\]]*): ", message)
    return match.group(1) if match else None


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (what `load_config` reads back)."""
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False), encoding="utf-8")
