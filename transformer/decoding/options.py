"""The options of one decoding call: overrides of a checkpoint's `decoding` section validated
(`decoding_options`), and how an n-best list is taken from a search's hypotheses (`n_best_search`,
`distinct_first`), for every engine alike.

Options are declared once, as the fields of `DecodingConfig` (with their one-line help). From them come the
command line's decoding flags (`cli.py`: `--beam-size`, ...), the server's request fields (`serve/app.py`) and the
keywords of `Translator.translate`; `tests/test_option_surfaces.py` holds all three to the fields. The exceptions:

- `transformer translate` takes every option; `evaluate` and `attention` all but n_best (they score or draw the
  best translation);
- a server request takes every option but batch_size and max_tokens_per_batch (`SERVER_BATCHING`): the server
  batches concurrent requests together, by its own `--max-batch-sentences`.

Adding an option is: the field (with its default and help), its rule where the searches read it
(`decoding/rules.py` for a rule on the next token), its tests, and its line in docs/decoding.md.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from ..config import ConfigError, DecodingConfig, OptionError

logger = logging.getLogger(__name__)


SERVER_BATCHING = ("batch_size", "max_tokens_per_batch")
"""The options a server request may not set: how requests are batched is the server's."""


def option_fields(exclude: tuple[str, ...] = ()) -> list[dataclasses.Field]:
    """The fields of `DecodingConfig` (each an option), in declaration order, but those named in `exclude`."""
    return [f for f in dataclasses.fields(DecodingConfig) if f.name not in exclude]


def n_best_search(options: DecodingConfig) -> tuple[DecodingConfig, bool]:
    """The options to search with and whether to pick the n-best list from the search's hypotheses with
    `distinct_first`: for beam search asked for more than one hypothesis, every hypothesis of the beam (n_best =
    beam_size; the search itself does not depend on n_best), picked; otherwise (one hypothesis, or sampling's
    independent draws) `options` as they are, taken as they come."""
    if options.n_best > 1 and not options.sampling:
        return dataclasses.replace(options, n_best=options.beam_size), True
    return options, False


def warn_length_cap(n_hit: int, n_outputs: int, options: DecodingConfig) -> None:
    """Log how many of `n_outputs` best outputs were cut at the length cap (nothing when none was)."""
    if n_hit:
        logger.warning(
            "%d of %d outputs reached the length cap max_len_a * src_len + max_len_b (%.3g * src_len + %d "
            "tokens) before eos",
            n_hit,
            n_outputs,
            options.max_len_a,
            options.max_len_b,
        )


def distinct_first(texts: list[str], n: int, finished: Optional[list[bool]] = None) -> list[int]:
    """Which `n` of a search's hypotheses (given by their `texts`, best first) make the n-best list: subword models
    can spell one text with different pieces (after BPE-dropout training they do), so a beam's best hypotheses may
    repeat a text. In order: the finished hypotheses with texts not seen before, the finished repeats, then
    hypotheses cut at the length cap (`finished` False; new texts first), each group best first; so every input
    keeps `n` entries, and a wider beam finds more distinct texts.

    Returns:
        Indices into `texts`.
    """
    done = finished or [True] * len(texts)
    seen: set[str] = set()
    groups: tuple[list[int], ...] = ([], [], [], [])
    for i, text in enumerate(texts):
        groups[(0 if done[i] else 2) + (text in seen)].append(i)
        seen.add(text)
    return [i for group in groups for i in group][:n]


def decoding_options(base: DecodingConfig, **overrides: Any) -> DecodingConfig:
    """`base` with the given (non-None) overrides, validated; a beam_size without n_best caps n_best at it, and
    sampling without a beam_size sets it to 1.

    Raises:
        ConfigError: an option out of range (e.g. n_best > beam_size), or a sampling option (top_k, top_p,
            temperature, seed) set to another value than `base`'s for a search that does not sample (it would be
            ignored; `base`'s own values pass, so that a complete set of options can be given back).
    """
    values = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(DecodingConfig)})
    if unknown:
        raise OptionError(
            f"unknown decoding option {unknown[0]!r}: expected fields of DecodingConfig"
        )
    ignored = [
        k
        for k in ("top_k", "top_p", "temperature", "seed")
        if k in values and values[k] != getattr(base, k)
    ]
    if ignored and not values.get("sampling", base.sampling):
        detail = (
            "used only when sampling (--sampling; sampling: true in a config or request): add it, or leave "
            "this option out"
        )
        raise ConfigError(
            f"decoding.{ignored[0]}: {detail}", key=f"decoding.{ignored[0]}", detail=detail
        )
    if values.get("sampling") and "beam_size" not in values:  # sampling draws one token at a time
        values["beam_size"] = 1
    if "beam_size" in values and "n_best" not in values:
        values["n_best"] = min(base.n_best, values["beam_size"])
    return dataclasses.replace(base, **values)
