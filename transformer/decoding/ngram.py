"""Restrictions of the next token that every search applies through `rules.NextTokenRules`: n-gram repeat blocking,
runs of one token, and forced prefixes.

N-gram blocking: no output contains the same n-gram of pieces twice. At each step, a hypothesis whose last n - 1
tokens already occurred earlier followed by token t may not produce t again. Eos is never blocked, so a hypothesis
can always end (every other continuation may be blocked).

Runs: no output has one token more than max_repeat times in a row. A model that meets a word it barely knows can
fall into a loop of one subword piece ("Marininininin"): a hypothesis whose last max_repeat tokens are all t may
not produce t again. Eos is never blocked.

Forced prefixes: the first tokens of an output are given (a target prefix per sentence); the search produces them
with the model's own scores, then goes on freely.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..config import EOS_ID


def blocked_tokens(prefix: list[int], n: int) -> set[int]:
    """The tokens that would complete an n-gram already in `prefix` (generated tokens, bos excluded)."""
    if n <= 0 or len(prefix) < n - 1:
        return set()
    if n == 1:
        return set(prefix) - {EOS_ID}
    tail = prefix[len(prefix) - (n - 1) :]
    return {
        prefix[i + n - 1] for i in range(len(prefix) - n + 1) if prefix[i : i + n - 1] == tail
    } - {EOS_ID}


def block_repeated_ngrams_(scores: Tensor, prefixes: list[list[int]], n: int) -> None:
    """Set `scores[row, t]` to -inf for every token t that would repeat an n-gram of row's prefix (in place).

    Args:
        scores: `(rows, vocab)` log-probabilities or logits.
        prefixes: per row, the tokens generated so far (bos excluded).
        n: the n-gram size (0: nothing is blocked).
    """
    if n <= 0:
        return
    for row, prefix in enumerate(prefixes):
        tokens = blocked_tokens(prefix, n)
        if tokens:
            scores[row, list(tokens)] = float("-inf")


def block_long_runs_(scores: Tensor, prefixes: list[list[int]] | Tensor, max_repeat: int) -> None:
    """Set `scores[row, t]` to -inf where row's last max_repeat tokens are all t (in place), so that no output has
    one token more than max_repeat times in a row.

    Args:
        scores: `(rows, vocab)` log-probabilities or logits.
        prefixes: per row, the tokens generated so far (bos excluded): lists (greedy decoding and sampling keep
            them), or a `(rows, steps)` tensor (beam search's), handled on its device without a copy to the host.
        max_repeat: the longest run allowed (0: any).
    """
    if max_repeat <= 0:
        return
    if isinstance(prefixes, Tensor):
        if prefixes.size(1) < max_repeat:
            return
        tail = prefixes[:, -max_repeat:]  # (rows, max_repeat)
        last = tail[:, -1:]  # (rows, 1)
        run = (tail == last).all(1, keepdim=True) & (last != EOS_ID)
        scores.scatter_(1, last, torch.where(run, float("-inf"), scores.gather(1, last)))
        return
    rows, tokens = [], []
    for row, prefix in enumerate(prefixes):
        if (
            len(prefix) >= max_repeat
            and prefix[-1] != EOS_ID
            and prefix[-max_repeat:].count(prefix[-1]) == max_repeat
        ):
            rows.append(row)
            tokens.append(prefix[-1])
    if rows:
        scores[rows, tokens] = float("-inf")


def force_prefix_(
    scores: Tensor, model_scores: Tensor, prefixes: list[Optional[list[int]]], step: int
) -> None:
    """Forced target prefixes: where `step` is inside a row's prefix, only the prefix's token may be produced, with
    the score the model gives it (in place).

    Args:
        scores: `(rows, vocab)` after the other restrictions (pad, bos, min_len, n-gram blocking).
        model_scores: `(rows, vocab)` the model's own log-probabilities (or logits), before them.
        prefixes: per row, the forced tokens, or None.
        step: the position being decoded (0: the first token after bos).
    """
    for row, prefix in enumerate(prefixes):
        if prefix is not None and step < len(prefix):
            token = prefix[step]
            value = model_scores[row, token].clone()
            scores[row] = float("-inf")
            scores[row, token] = value
