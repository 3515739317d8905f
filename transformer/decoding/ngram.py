"""N-gram repeat blocking: no output contains the same n-gram of pieces twice.

At each step, a hypothesis whose last n - 1 tokens already occurred earlier followed by token t may not produce t
again. Eos is never blocked, so a hypothesis can always end (every other continuation may be blocked).
"""

from __future__ import annotations

from torch import Tensor

from ..config import EOS_ID


def blocked_tokens(prefix: list[int], n: int) -> set[int]:
    """The tokens that would complete an n-gram already in `prefix` (generated tokens, bos excluded)."""
    if n <= 0 or len(prefix) < n - 1:
        return set()
    if n == 1:
        return set(prefix) - {EOS_ID}
    tail = prefix[len(prefix) - (n - 1):]
    return {prefix[i + n - 1] for i in range(len(prefix) - n + 1) if prefix[i:i + n - 1] == tail} - {EOS_ID}


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
