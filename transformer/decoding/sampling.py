"""Random sampling: each next token drawn from the model's distribution, restricted to the top k tokens and/or the
top-p nucleus (Holtzman et al. 2020) and sharpened or flattened by a temperature. The usual way to generate
back-translations (Edunov et al. 2018), where the beam's most probable outputs are too uniform.

Reproducible per sentence: each sample of a sentence draws from its own random stream, seeded by the seed, the
sentence's source tokens and the sample's number, so a line gets the same samples whatever else is in its batch
and whatever the batch size (identical source lines get identical samples). The K samples of a sentence decode as
K rows of their own (the sentence's source repeated K times); each stops at its own eos or length cap.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from ..config import BOS_ID, DecodingConfig
from .greedy import keep_unfinished
from .hypothesis import Hypothesis
from .interface import IncrementalDecoder
from .rules import NO_TARGET_RULES, NextTokenRules, TargetRules, max_output_lengths

FLOAT32_TEMPERATURES = (1e-37, 1e37)
"""The temperatures that float32 divides by as given (its normal range, with a margin); outside them the division is
in float64 (`sampling_distribution`), and the CTranslate2 engine, whose sampling is float32, is given greedy draws or
this upper bound (`engines/ctranslate2.py`)."""


def sampling_distribution(
    logits: Tensor, top_k: int = 0, top_p: float = 1.0, temperature: float = 1.0
) -> Tensor:
    """The probabilities tokens are drawn from: softmax(logits / temperature), then only the top_k most probable
    (0: all; tokens tied with the k-th most probable are kept too, so a row can keep more than top_k) and, of
    those, the fewest most probable whose probabilities sum to at least top_p; renormalised.

    The logits are shifted by their row maximum before the division, so that no temperature overflows: towards 0 the
    distribution tends to the most probable token (greedy) and reaches it once the others' scaled logits underflow;
    towards infinity it tends to the uniform distribution over the tokens allowed. A temperature beyond float32's
    range (below `FLOAT32_TEMPERATURES[0]` or above `[1]`, which float32 would make 0 or inf) is divided in float64, so
    the rule holds for every positive finite temperature.

    Args:
        logits: `(rows, vocab)`; -inf where a token may not be produced.

    Returns:
        `(rows, vocab)` float32 probabilities, each row summing to 1 (0 outside the kept tokens).
    """
    low, high = FLOAT32_TEMPERATURES
    logits = logits.float() if low <= temperature <= high else logits.double()
    probs = torch.softmax(
        (logits - logits.max(-1, keepdim=True).values) / temperature, dim=-1
    ).float()
    if top_k and top_k < probs.size(-1):
        kth = probs.topk(top_k, dim=-1).values[:, -1:]  # (rows, 1)
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more probable tokens
        kept = before < top_p * sorted_probs.sum(
            -1, keepdim=True
        )  # the most probable token is always kept
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * kept)
    return probs / probs.sum(-1, keepdim=True)


def draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draws: row i takes the first token whose cumulative probability exceeds uniforms[i] (a token of
    probability 0 is never taken).

    Args:
        probs: `(rows, vocab)` rows summing to 1.
        uniforms: `(rows,)` in [0, 1).
    """
    cdf = probs.double().cumsum(-1)
    u = (uniforms.double() * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=probs.size(-1) - 1)
    return tokens


@torch.no_grad()
def sample_decode(
    model: IncrementalDecoder,
    src: Tensor,
    src_key_padding_mask: Tensor,
    options: DecodingConfig,
    targets: TargetRules = NO_TARGET_RULES,
) -> list[list[Hypothesis]]:
    """Draw options.n_best outputs per sentence (see the module docstring), each token among those that
    `rules.NextTokenRules` allows.

    Args:
        model: the Transformer in eval mode, or a decoder of `transformer/fast/`.
        src: `(batch, src_len)` LongTensor, padded with pad_id; src_key_padding_mask: True at padding.
        options: n_best (independent samples per sentence), top_k, top_p, temperature (`sampling_distribution`),
            seed (with the source tokens and the sample's number, it fixes each sample's random stream), the length
            cap (max_len_a, max_len_b: `rules.max_output_lengths`) and the rules' options.
        targets: per sentence, target tokens every sample starts with (`TargetRules.prefixes`; None: free; no
            draw is spent on them), and the tokens none holds.

    Returns:
        Per sentence, n_best hypotheses in the order drawn; each score is the sum of the model's own
        log-probabilities (temperature 1, unfiltered, as greedy decoding's) of the drawn tokens, eos included when
        it ended.
    """
    n_samples = options.n_best
    lengths = (~src_key_padding_mask).sum(1).tolist()
    streams = [
        random.Random(f"{options.seed}:{k}:{' '.join(map(str, row[:n].tolist()))}")
        for row, n in zip(src, lengths)
        for k in range(n_samples)
    ]
    src = src.repeat_interleave(
        n_samples, dim=0
    )  # (batch * n_samples, src_len): one row per sample
    mask = src_key_padding_mask.repeat_interleave(n_samples, dim=0)
    rows = src.size(0)
    rules = NextTokenRules(options, targets)
    prefixes = targets.prefixes
    row_prefixes = None if prefixes is None else [p for p in prefixes for _ in range(n_samples)]
    max_lengths = max_output_lengths(mask, options, model.config.max_positions, row_prefixes)
    cache = model.new_cache(model.encode(src, mask), mask)
    last = torch.full((rows,), BOS_ID, dtype=torch.long, device=src.device)
    alive = list(range(rows))
    outputs: list[list[int]] = [[] for _ in range(rows)]
    totals, finished = [0.0] * rows, [False] * rows
    for step in range(max(max_lengths)):
        logits = model.decode_step(last, cache).float()  # (alive, vocab)
        model_lprobs = torch.log_softmax(logits, dim=-1)  # the score: the model's own distribution
        sentences = [i // n_samples for i in alive]
        rules.apply_(logits, [outputs[i] for i in alive], sentences, step)
        probs = sampling_distribution(logits, options.top_k, options.top_p, options.temperature)
        # a forced token is the only one left in its row: drawn with 0, it spends nothing of the row's stream
        uniforms = torch.tensor(
            [
                streams[i].random() if rules.forced_token(s, step) < 0 else 0.0
                for i, s in zip(alive, sentences)
            ],
            dtype=torch.float64,
        )
        tokens = draw(probs, uniforms.to(probs.device))
        for i, lprob in zip(alive, model_lprobs.gather(1, tokens[:, None])[:, 0].tolist()):
            totals[i] += lprob
        alive, last = keep_unfinished(tokens, alive, outputs, finished, max_lengths, cache)
        if not alive:
            break
    hyps = [Hypothesis(outputs[i], totals[i], finished[i]) for i in range(rows)]
    return [hyps[s * n_samples : (s + 1) * n_samples] for s in range(rows // n_samples)]
