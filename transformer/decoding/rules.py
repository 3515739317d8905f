"""What a search may produce: the output length cap, and the rules on the next token that greedy decoding, beam
search and sampling all apply, once per step, through `NextTokenRules`.

At every step, for every row (a hypothesis being extended):

1. pad and bos are never produced;
2. the marks a model's sources carry (language tokens, synthetic-corpus tags: `TargetRules.banned`) are never
   produced;
3. eos is not produced before `min_len` tokens;
4. no token that would repeat an n-gram of `no_repeat_ngram_size` tokens of the row's history (`ngram.py`);
5. no token that would make a run of one token longer than `max_repeat` (`ngram.py`);
6. inside the row's forced prefix, only the prefix's token, with the score the model gives it (before 1-5).

Eos is never blocked by 4 or 5, so a hypothesis can always end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from torch import Tensor

from ..config import BOS_ID, EOS_ID, PAD_ID, DecodingConfig
from .ngram import block_long_runs_, block_repeated_ngrams_, force_prefix_

History = Union[list[list[int]], Tensor]
"""Per row, the tokens generated so far (bos excluded): lists, or a `(rows, steps)` LongTensor (beam search's)."""


def max_output_length(
    src_len: int, max_len_a: float, max_len_b: int, max_positions: int, prefix_len: int = 0
) -> int:
    """The output length cap of one sentence of src_len source tokens (eos included) with a forced prefix of
    prefix_len tokens, in decoding steps; see `max_output_lengths`."""
    return max(1, min(max_positions - 1, prefix_len + int(max_len_a * src_len + max_len_b)))


def max_output_lengths(
    src_key_padding_mask: Tensor,
    options: DecodingConfig,
    max_positions: int,
    prefixes: Optional[list[Optional[list[int]]]] = None,
) -> list[int]:
    """The output length cap of each sentence, in decoding steps (output tokens, eos counted).

    For a sentence of src_len source tokens (eos included), max_len = floor(max_len_a * src_len + max_len_b),
    counted after its forced prefix (if any: the prefix's tokens are added), clipped to [1, max_positions - 1].
    Every search runs at most max_len steps for it: a hypothesis that ends with eos within them has at most
    max_len - 1 tokens before its eos (`Hypothesis.finished` True); one that has produced max_len tokens without eos
    is cut there (`finished` False, counted in `Translation.n_hit_max_len`). A prefix itself is never cut: the
    text layer refuses one of more than max_positions - 2 tokens (`translate.Translator`).

    Args:
        src_key_padding_mask: `(batch, src_len)` bool, True at padding.
        options: max_len_a and max_len_b are read.
        max_positions: the model's longest sequence.
        prefixes: per sentence, its forced target tokens (None: none); None for no prefixes.

    Returns:
        max_len per sentence (steps).
    """
    src_lengths = (~src_key_padding_mask).sum(1).tolist()
    prefix_lengths = (
        [len(p) if p else 0 for p in prefixes] if prefixes is not None else [0] * len(src_lengths)
    )
    if len(prefix_lengths) != len(src_lengths):
        raise ValueError(f"{len(src_lengths)} sentences but {len(prefix_lengths)} prefixes")
    return [
        max_output_length(n, options.max_len_a, options.max_len_b, max_positions, k)
        for n, k in zip(src_lengths, prefix_lengths)
    ]


@dataclass(frozen=True)
class TargetRules:
    """What the outputs of one search call must start with and must never hold, beside the options.

    Attributes:
        prefixes: per sentence, the target tokens its outputs must start with (None: free); None for no prefixes.
        banned: tokens no output may contain: the pieces a model's sources carry as marks (language tokens, tags),
            which are instructions to the model, never text it writes.
    """

    prefixes: Optional[list[Optional[list[int]]]] = None
    banned: tuple[int, ...] = ()


NO_TARGET_RULES = TargetRules()
"""Free outputs: no prefix, nothing banned."""


class NextTokenRules:
    """The rules of the module docstring for one search call.

    Args:
        options: min_len, no_repeat_ngram_size and max_repeat are read.
        targets: the forced prefixes and the banned tokens (`TargetRules`).
    """

    def __init__(self, options: DecodingConfig, targets: TargetRules = NO_TARGET_RULES) -> None:
        self.min_len = options.min_len
        self.no_repeat_ngram_size = options.no_repeat_ngram_size
        self.max_repeat = options.max_repeat
        self.prefixes = targets.prefixes
        self.banned = list(targets.banned)

    def forced_token(self, sentence: int, step: int) -> int:
        """The token sentence `sentence` must produce at `step` (0: the first after bos), or -1 when free."""
        prefix = None if self.prefixes is None else self.prefixes[sentence]
        return prefix[step] if prefix is not None and step < len(prefix) else -1

    def apply_(self, scores: Tensor, history: History, sentences: list[int], step: int) -> None:
        """Set to -inf the score of every token a row may not produce at `step` (in place).

        Args:
            scores: `(rows, vocab)` log-probabilities or logits of the next token.
            history: per row, the tokens generated so far (see `History`).
            sentences: per row, the input sentence it belongs to (for its forced prefix).
            step: the position being decoded (0: the first token after bos).
        """
        model_scores = scores.clone() if self.prefixes is not None else scores
        scores[:, PAD_ID] = float("-inf")
        scores[:, BOS_ID] = float("-inf")
        if self.banned:
            scores[:, self.banned] = float("-inf")
        if step < self.min_len:
            scores[:, EOS_ID] = float("-inf")
        if self.no_repeat_ngram_size:
            block_repeated_ngrams_(
                scores,
                history.tolist() if isinstance(history, Tensor) else history,
                self.no_repeat_ngram_size,
            )
        block_long_runs_(scores, history, self.max_repeat)
        if self.prefixes is not None:
            force_prefix_(scores, model_scores, [self.prefixes[s] for s in sentences], step)
