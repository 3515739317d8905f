"""Batched beam search on the key/value cache (Vaswani et al. 2017, §6.1: beam 4, length penalty α = 0.6).

All sentences of a batch are searched together as `batch x beam_size` rows. One step:

1. expand: every live hypothesis gets its 2·beam_size most probable next tokens (no other can be selected);
2. select: per sentence, the 2·beam_size best (hypothesis, token) candidates by total log-probability;
3. finish: candidates among the best beam_size that end in eos become finished hypotheses (never extended);
   the best beam_size candidates that do not end in eos are the next live hypotheses;
4. a sentence is done once it has beam_size finished hypotheses, or when its length cap is reached (its
   live hypotheses are then kept as unfinished fall-backs); done sentences leave the batch;
5. the n_best finished hypotheses by score are returned, topped up with the best unfinished ones.

Score (reported and compared): the sum of the token log-probabilities (eos included when finished),
divided by the GNMT length penalty lp(Y) = ((5 + |Y|) / 6)^α (Wu et al. 2016, eq. 14), where |Y| counts
the generated tokens, eos included. α = 0 gives the plain sum. Length cap: `rules.max_output_lengths`,
counted in decoding steps (eos included), and the rules on the next token (`rules.NextTokenRules`) are those of
greedy decoding and sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from ..config import BOS_ID, EOS_ID, DecodingConfig
from ..fast.reductions import row_topk
from .hypothesis import Hypothesis
from .interface import IncrementalCache, IncrementalDecoder
from .rules import NO_TARGET_RULES, NextTokenRules, TargetRules, max_output_lengths


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6)^α; 1.0 when α = 0."""
    return ((5.0 + length) / 6.0) ** alpha


@dataclass
class _Sentence:
    """Search state of one input sentence."""

    max_len: int
    finished: list[Hypothesis] = field(default_factory=list)
    unfinished: list[Hypothesis] = field(default_factory=list)
    is_done: bool = False


@dataclass
class BeamSearchState:
    """Live hypotheses of the sentences still being searched.

    Attributes:
        alive: input positions of those sentences, `n_alive` of them.
        scores: `(n_alive, beam_size)` total log-probability of each live hypothesis.
        tokens: `(n_alive * beam_size, step + 1)` the token ids of each live hypothesis, bos first.
        cache: the decoder's cache, `n_alive * beam_size` rows (the beams of a sentence consecutive).
    """

    alive: list[int]
    scores: Tensor
    tokens: Tensor
    cache: IncrementalCache


def initialise(
    model: IncrementalDecoder, src: Tensor, src_key_padding_mask: Tensor, beam_size: int
) -> BeamSearchState:
    """Encode once, make a cache with beam_size rows per sentence, and start each sentence with one live
    hypothesis."""
    n = src.size(0)
    memory = model.encode(src, src_key_padding_mask)  # (n, src_len, d_model)
    scores = torch.full((n, beam_size), float("-inf"), device=src.device)
    scores[:, 0] = 0.0  # the other beams are copies of it; -inf keeps them out of the first top-k
    tokens = torch.full((n * beam_size, 1), BOS_ID, dtype=torch.long, device=src.device)
    return BeamSearchState(
        list(range(n)), scores, tokens, model.new_cache(memory, src_key_padding_mask, beam_size)
    )


def expand(
    model: IncrementalDecoder, state: BeamSearchState, step: int, rules: NextTokenRules
) -> tuple[Tensor, Tensor]:
    """The best one-token extensions of every live hypothesis, by total log-probability.

    Only each hypothesis' 2·beam_size most probable next tokens can be among its sentence's 2·beam_size best
    candidates (any other has 2·beam_size better ones in its own row), so only they are added to the hypothesis
    scores and compared: `(rows, k)` instead of `(rows, vocab)` numbers.

    Returns:
        scores and tokens, each `(n_alive, beam_size, k)` with k = min(2·beam_size, vocab): total
        log-probabilities of the candidates, only of tokens that `rules` allows.
    """
    logits = model.decode_step(state.tokens[:, -1], state.cache)
    lprobs = torch.log_softmax(logits.float(), dim=-1)  # (n_alive * beam_size, vocab)
    n_alive, beam_size = state.scores.shape
    rules.apply_(
        lprobs, state.tokens[:, 1:], [i for i in state.alive for _ in range(beam_size)], step
    )
    best_lprobs, best_tokens = row_topk(lprobs, min(2 * beam_size, lprobs.size(-1)))  # (rows, k)
    return (
        state.scores[:, :, None] + best_lprobs.view(n_alive, beam_size, -1),
        best_tokens.view(n_alive, beam_size, -1),
    )


class TopCandidates(NamedTuple):
    """The best candidates of each live sentence, best first, each `(n_alive, 2 * beam_size)`: their total
    log-probabilities, the beam each extends, and the token it adds."""

    scores: Tensor
    beams: Tensor
    tokens: Tensor


def select_top_k(
    candidate_scores: Tensor, candidate_tokens: Tensor, beam_size: int
) -> TopCandidates:
    """The 2·beam_size best candidates of each sentence (enough to keep beam_size that do not end in eos).

    Args:
        candidate_scores, candidate_tokens: `(n_alive, beam_size, k)` from `expand`.

    Returns:
        scores, source beams and tokens, each `(n_alive, 2 * beam_size)` (fewer if the vocabulary is smaller),
        best first.
    """
    n_alive, _, k = candidate_scores.shape
    top_scores, top_index = candidate_scores.view(n_alive, -1).topk(
        min(2 * beam_size, k * beam_size), dim=1
    )
    return TopCandidates(
        top_scores, top_index // k, candidate_tokens.view(n_alive, -1).gather(1, top_index)
    )


def finish_hypotheses(
    state: BeamSearchState, sentences: list[_Sentence], top: TopCandidates, step: int, alpha: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Move eos candidates into the finished lists, pick the next live beams, and mark sentences done.

    Args:
        state: the live hypotheses; sentences: every input sentence's search state (updated in place).
        top: `select_top_k`'s candidates; step: the position decoded (0: the first after bos); alpha: the length
            penalty's α.

    Returns:
        next_scores, next_rows and next_tokens, each `(n_alive, beam_size)`: for each next live hypothesis,
        its score, the row of `state.tokens` it extends, and the token it adds.
    """
    top_scores, top_beams, top_tokens = top
    n_alive, beam_size = state.scores.shape
    is_eos = top_tokens.eq(EOS_ID) | top_scores.isneginf()
    # The first beam_size candidates that do not end in eos (stable order: best first).
    rank = is_eos.long() * top_tokens.size(1) + torch.arange(
        top_tokens.size(1), device=top_tokens.device
    )
    keep = rank.argsort(dim=1)[:, :beam_size]
    next_scores, next_beams = top_scores.gather(1, keep), top_beams.gather(1, keep)
    next_tokens = top_tokens.gather(1, keep)
    base = torch.arange(n_alive, device=top_beams.device)[:, None] * beam_size
    next_rows = base + next_beams  # (n_alive, beam_size)
    eos_hits = (
        (top_tokens[:, :beam_size].eq(EOS_ID) & top_scores[:, :beam_size].isfinite())
        .nonzero()
        .tolist()
    )
    if eos_hits:
        scores_list, beams_list = top_scores.tolist(), top_beams.tolist()
        for i, j in eos_hits:
            sentence = sentences[state.alive[i]]
            tokens = state.tokens[i * beam_size + beams_list[i][j], 1:].tolist()
            raw = scores_list[i][j]
            sentence.finished.append(
                Hypothesis(tokens, raw / gnmt_length_penalty(step + 1, alpha), True)
            )
    for i, index in enumerate(state.alive):
        sentence = sentences[index]
        if len(sentence.finished) >= beam_size:
            sentence.is_done = True
        elif step + 1 >= sentence.max_len:  # length cap: keep the live hypotheses as fall-backs
            rows, scores, tokens = (
                next_rows[i].tolist(),
                next_scores[i].tolist(),
                next_tokens[i].tolist(),
            )
            for row, raw, token in zip(rows, scores, tokens):
                if raw != float("-inf"):
                    seq = state.tokens[row, 1:].tolist() + [token]
                    sentence.unfinished.append(
                        Hypothesis(seq, raw / gnmt_length_penalty(step + 1, alpha), False)
                    )
            sentence.is_done = True
    return next_scores, next_rows, next_tokens


def advance(
    state: BeamSearchState,
    sentences: list[_Sentence],
    next_scores: Tensor,
    next_rows: Tensor,
    next_tokens: Tensor,
) -> BeamSearchState:
    """Reorder the hypotheses' tokens and the cache to the next live hypotheses, and drop the sentences that are
    done."""
    beam_size = next_scores.size(1)
    rows = next_rows.view(-1)
    tokens = torch.cat([state.tokens.index_select(0, rows), next_tokens.view(-1, 1)], dim=1)
    state.cache.select(rows)  # beams move within their sentence
    keep = [i for i, index in enumerate(state.alive) if not sentences[index].is_done]
    state = BeamSearchState(state.alive, next_scores, tokens, state.cache)
    if len(keep) < len(state.alive):
        keep_t = torch.tensor(keep, dtype=torch.long, device=tokens.device)
        row_index = (
            keep_t[:, None] * beam_size + torch.arange(beam_size, device=tokens.device)
        ).view(-1)
        state.cache.select(row_index, keep_t)
        state = BeamSearchState(
            [state.alive[i] for i in keep],
            next_scores.index_select(0, keep_t),
            tokens.index_select(0, row_index),
            state.cache,
        )
    return state


def pick_n_best(sentence: _Sentence, n_best: int) -> list[Hypothesis]:
    """The n_best finished hypotheses by score, topped up with the best unfinished ones."""
    finished = sorted(sentence.finished, key=lambda h: -h.score)[:n_best]
    if len(finished) < n_best:
        seen = {tuple(h.tokens) for h in finished}
        for h in sorted(sentence.unfinished, key=lambda h: -h.score):
            if len(finished) == n_best:
                break
            if tuple(h.tokens) not in seen:
                finished.append(h)
                seen.add(tuple(h.tokens))
    return finished


@torch.no_grad()
def beam_search(
    model: IncrementalDecoder,
    src: Tensor,
    src_key_padding_mask: Tensor,
    options: DecodingConfig,
    targets: TargetRules = NO_TARGET_RULES,
) -> list[list[Hypothesis]]:
    """Beam search for a batch of sentences.

    Args:
        model: the Transformer in eval mode, or a decoder of `transformer/fast/`.
        src: `(batch, src_len)` LongTensor padded with pad_id.
        src_key_padding_mask: `(batch, src_len)` bool, True at padding.
        options: beam_size (live hypotheses per sentence), length_penalty (α of the GNMT length penalty, 0
            disables it), n_best (hypotheses returned per sentence, <= beam_size), the length cap (max_len_a,
            max_len_b: `rules.max_output_lengths`) and the rules' options (`rules.NextTokenRules`).
        targets: per sentence, target tokens every hypothesis must start with (`TargetRules.prefixes`; None:
            free), and the tokens none holds.

    Returns:
        Per sentence, n_best hypotheses sorted by score, best first (unfinished ones, cut at the length
        cap, only when fewer than n_best hypotheses finished).
    """
    max_lengths = max_output_lengths(
        src_key_padding_mask, options, model.config.max_positions, targets.prefixes
    )
    rules = NextTokenRules(options, targets)
    sentences = [_Sentence(m) for m in max_lengths]
    state = initialise(model, src, src_key_padding_mask, options.beam_size)
    for step in range(max(max_lengths)):
        candidate_scores, candidate_tokens = expand(model, state, step, rules)
        top = select_top_k(candidate_scores, candidate_tokens, options.beam_size)
        next_scores, next_rows, next_tokens = finish_hypotheses(
            state, sentences, top, step, options.length_penalty
        )
        state = advance(state, sentences, next_scores, next_rows, next_tokens)
        if not state.alive:
            break
    return [pick_n_best(s, options.n_best) for s in sentences]
