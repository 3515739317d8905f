"""Batched greedy decoding on the key/value cache: each sentence stops at its own eos.

The output length cap is defined once, by `max_output_lengths` below, and used by greedy and beam search alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..config import BOS_ID, EOS_ID, PAD_ID
from ..fast.reductions import row_argmax
from .interface import IncrementalCache, IncrementalDecoder
from .ngram import block_long_runs_, block_repeated_ngrams_, force_prefix_


@dataclass
class Hypothesis:
    """One output sequence.

    Attributes:
        tokens: target ids without bos and eos.
        score: sum of the token log-probabilities (eos included when finished), divided by the length
            penalty in beam search (see `decoding/beam.py`); NaN from greedy decoding with `scores=False`.
        finished: True if the sequence ended with eos; False if it was cut at the length cap.
    """

    tokens: list[int]
    score: float
    finished: bool


def max_output_length(src_len: int, max_len_a: float, max_len_b: int, max_positions: int) -> int:
    """The output length cap of one sentence of src_len source tokens (eos included), in decoding steps; see
    `max_output_lengths`."""
    return max(1, min(max_positions - 1, int(max_len_a * src_len + max_len_b)))


def max_output_lengths(src_key_padding_mask: Tensor, max_len_a: float, max_len_b: int, max_positions: int) -> list[int]:
    """The output length cap of each sentence, in decoding steps (output tokens, eos counted).

    For a sentence of src_len source tokens (eos included), max_len = floor(max_len_a * src_len + max_len_b),
    clipped to [1, max_positions - 1]. Greedy and beam search run at most max_len steps for it: a hypothesis that
    ends with eos within them has at most max_len - 1 tokens before its eos (`Hypothesis.finished` True); one that
    has produced max_len tokens without eos is cut there (`finished` False, and `Translator.stats.n_hit_max_len`
    counts it).

    Args:
        src_key_padding_mask: `(batch, src_len)` bool, True at padding.

    Returns:
        max_len per sentence (steps).
    """
    src_lengths = (~src_key_padding_mask).sum(1).tolist()
    return [max_output_length(n, max_len_a, max_len_b, max_positions) for n in src_lengths]


def keep_unfinished(tokens: Tensor, alive: list[int], outputs: list[list[int]], finished: list[bool],
                    max_lengths: list[int], cache: IncrementalCache) -> tuple[list[int], Tensor]:
    """One step's bookkeeping for searches with one row per output (greedy decoding, sampling): append each row's
    token to its output (eos marks it finished instead), then drop the rows that finished or reached their length
    cap from the batch and from the cache.

    Args:
        tokens: `(len(alive),)` this step's token of each row.
        alive: the output index of each row; outputs, finished, max_lengths: per output, updated in place.

    Returns:
        The rows still decoding and their last tokens `(len(kept),)`; an empty list when none is left.
    """
    keep = []
    for row, (i, token) in enumerate(zip(alive, tokens.tolist())):
        if token == EOS_ID:
            finished[i] = True
            continue
        outputs[i].append(token)
        if len(outputs[i]) < max_lengths[i]:
            keep.append(row)
    if len(keep) < len(alive) and keep:
        index = torch.tensor(keep, device=tokens.device)
        tokens = tokens.index_select(0, index)
        cache.select(index, index)
    return [alive[row] for row in keep], tokens


@torch.no_grad()
def greedy_decode(model: IncrementalDecoder, src: Tensor, src_key_padding_mask: Tensor, max_len_a: float = 1.5,
                  max_len_b: int = 10, min_len: int = 0, scores: bool = True, no_repeat_ngram_size: int = 0,
                  prefixes: Optional[list[Optional[list[int]]]] = None, max_repeat: int = 0) -> list[Hypothesis]:
    """Pick the most probable next token until eos or the length cap, for a batch of sentences; pad and bos are
    never picked, eos not before min_len tokens, no n-gram of no_repeat_ngram_size tokens twice, and no token more
    than max_repeat times in a row.

    Finished sentences leave the batch, so the work per step shrinks as sentences end, and the loop
    stops as soon as the last one has ended.

    Args:
        model: the Transformer in eval mode, or a decoder of `transformer/fast/`.
        src: `(batch, src_len)` LongTensor, padded with pad_id.
        src_key_padding_mask: `(batch, src_len)` bool, True at padding.
        max_len_a, max_len_b: output length cap, see `max_output_lengths`.
        min_len: eos is not allowed before this many tokens.
        no_repeat_ngram_size: if N > 0, a token that would repeat an N-gram of the output is not picked
            (`decoding/ngram.py`; eos always can be).
        max_repeat: if R > 0, a token that the output's last R tokens all are is not picked (`decoding/ngram.py`).
        prefixes: per sentence, target tokens that the output must start with (None: free), produced with the
            model's scores before free decoding goes on.
        scores: compute each hypothesis' log-probability (a log-softmax over the vocabulary per step). With
            False the most probable token is taken from the logits directly (the same tokens; the normalization
            is skipped, as CTranslate2 does unless asked for scores) and `Hypothesis.score` is NaN.

    Returns:
        One `Hypothesis` per sentence, in input order.
    """
    n = src.size(0)
    memory = model.encode(src, src_key_padding_mask)  # (batch, src_len, d_model)
    max_lengths = max_output_lengths(src_key_padding_mask, max_len_a, max_len_b, model.config.max_positions)
    cache = model.new_cache(memory, src_key_padding_mask)
    last = torch.full((n,), BOS_ID, dtype=torch.long, device=src.device)  # (alive,): each row's last token
    alive = list(range(n))  # input positions of the rows still decoding
    outputs: list[list[int]] = [[] for _ in range(n)]
    totals, finished = [0.0] * n, [False] * n
    for step in range(max(max_lengths)):
        logits = model.decode_step(last, cache)  # (alive, tgt_vocab_size)
        # log-probabilities, or the logits themselves when no scores are asked for (the argmax is the same before
        # and after the log-softmax)
        candidates = torch.log_softmax(logits.float(), dim=-1) if scores else logits
        model_candidates = candidates.clone() if prefixes is not None else candidates
        candidates[:, PAD_ID] = float("-inf")  # never produced, as in beam search (so beam 1 equals greedy)
        candidates[:, BOS_ID] = float("-inf")
        if step < min_len:
            candidates[:, EOS_ID] = float("-inf")
        if no_repeat_ngram_size:
            block_repeated_ngrams_(candidates, [outputs[i] for i in alive], no_repeat_ngram_size)
        if max_repeat:
            block_long_runs_(candidates, [outputs[i] for i in alive], max_repeat)
        if prefixes is not None:
            force_prefix_(candidates, model_candidates, [prefixes[i] for i in alive], step)
        best = row_argmax(candidates)  # (alive,)
        if scores:
            best_lprobs = candidates.gather(1, best[:, None])[:, 0]
            for i, lprob in zip(alive, best_lprobs.tolist()):
                totals[i] += lprob
        alive, last = keep_unfinished(best, alive, outputs, finished, max_lengths, cache)
        if not alive:
            break
    return [Hypothesis(outputs[i], totals[i] if scores else float("nan"), finished[i]) for i in range(n)]
