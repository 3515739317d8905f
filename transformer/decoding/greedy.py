"""Batched greedy decoding on the key/value cache: each sentence stops at its own eos.

The output length cap (`rules.max_output_lengths`) and the rules on the next token (`rules.NextTokenRules`) are
those of beam search and sampling.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import BOS_ID, EOS_ID, DecodingConfig
from ..fast.reductions import row_argmax
from .hypothesis import Hypothesis
from .interface import IncrementalCache, IncrementalDecoder
from .rules import NO_TARGET_RULES, NextTokenRules, TargetRules, max_output_lengths


def keep_unfinished(
    tokens: Tensor,
    alive: list[int],
    outputs: list[list[int]],
    finished: list[bool],
    max_lengths: list[int],
    cache: IncrementalCache,
) -> tuple[list[int], Tensor]:
    """One step's bookkeeping for searches with one row per output (greedy decoding, sampling): append each row's
    token to its output (eos marks it finished instead), then drop the rows that finished or reached their length
    cap from the batch and from the cache.

    Args:
        tokens: `(len(alive),)` this step's token of each row.
        alive: the output index of each row.
        outputs, finished: per output, its tokens and whether it ended with eos; updated in place.
        max_lengths: per output, the most tokens its output may hold (read only): a row stops there.
        cache: the decoder's cache, whose rows are kept with the rows that go on.

    Returns:
        The output indices of the rows that go on and their tokens of this step `(len(kept),)`: the next step's
        input. When every row goes on, or none does, `tokens` is returned as given.
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
def greedy_decode(
    model: IncrementalDecoder,
    src: Tensor,
    src_key_padding_mask: Tensor,
    options: DecodingConfig,
    targets: TargetRules = NO_TARGET_RULES,
    scores: bool = True,
) -> list[Hypothesis]:
    """Pick the most probable next token allowed by `NextTokenRules` until eos or the length cap, for a batch of
    sentences.

    Finished sentences leave the batch, so the work per step shrinks as sentences end, and the loop
    stops as soon as the last one has ended.

    Args:
        model: the Transformer in eval mode, or a decoder of `transformer/fast/`.
        src: `(batch, src_len)` LongTensor, padded with pad_id.
        src_key_padding_mask: `(batch, src_len)` bool, True at padding.
        options: the length cap (max_len_a, max_len_b: `rules.max_output_lengths`) and the rules' options (min_len,
            no_repeat_ngram_size, max_repeat); beam_size and the sampling options are not read.
        targets: per sentence, target tokens that the output must start with (`TargetRules.prefixes`; None:
            free), produced with the model's scores before free decoding goes on, and the tokens it never writes.
        scores: compute each hypothesis' log-probability (a log-softmax over the vocabulary per step). With
            False the most probable token is taken from the logits directly (the same tokens; the normalization
            is skipped, as CTranslate2 does unless asked for scores) and `Hypothesis.score` is NaN.

    Returns:
        One `Hypothesis` per sentence, in input order.
    """
    n = src.size(0)
    memory = model.encode(src, src_key_padding_mask)  # (batch, src_len, d_model)
    max_lengths = max_output_lengths(
        src_key_padding_mask, options, model.config.max_positions, targets.prefixes
    )
    rules = NextTokenRules(options, targets)
    cache = model.new_cache(memory, src_key_padding_mask)
    last = torch.full(
        (n,), BOS_ID, dtype=torch.long, device=src.device
    )  # (alive,): each row's last token
    alive = list(range(n))  # input positions of the rows still decoding
    outputs: list[list[int]] = [[] for _ in range(n)]
    totals, finished = [0.0] * n, [False] * n
    for step in range(max(max_lengths)):
        logits = model.decode_step(last, cache)  # (alive, tgt_vocab_size)
        # log-probabilities, or the logits themselves when no scores are asked for (the argmax is the same before
        # and after the log-softmax)
        candidates = torch.log_softmax(logits.float(), dim=-1) if scores else logits
        rules.apply_(candidates, [outputs[i] for i in alive], alive, step)
        best = row_argmax(candidates)  # (alive,)
        if scores:
            best_lprobs = candidates.gather(1, best[:, None])[:, 0]
            for i, lprob in zip(alive, best_lprobs.tolist()):
                totals[i] += lprob
        alive, last = keep_unfinished(best, alive, outputs, finished, max_lengths, cache)
        if not alive:
            break
    return [
        Hypothesis(outputs[i], totals[i] if scores else float("nan"), finished[i]) for i in range(n)
    ]
