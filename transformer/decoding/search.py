"""The one entry to decoding: `search` runs greedy decoding, beam search or sampling, as `DecodingConfig` says.

    hypotheses = search(decoder, src, src_key_padding_mask, options)   # per sentence, options.n_best, best first

Every search decodes one position per step on the key/value cache of an `IncrementalDecoder` (`interface.py`),
applies the same rules on the next token (`rules.NextTokenRules`) and stops at the same length cap
(`rules.max_output_lengths`).
"""

from __future__ import annotations

import math

from torch import Tensor

from ..config import DecodingConfig
from .beam import beam_search
from .greedy import greedy_decode
from .hypothesis import Hypothesis
from .interface import IncrementalDecoder
from .rules import NO_TARGET_RULES, TargetRules
from .sampling import sample_decode


def search(
    decoder: IncrementalDecoder,
    src: Tensor,
    src_key_padding_mask: Tensor,
    options: DecodingConfig,
    targets: TargetRules = NO_TARGET_RULES,
    scores: bool = True,
) -> list[list[Hypothesis]]:
    """Decode a batch of sentences with the search `options` names: sampling (`options.sampling`), greedy decoding
    (beam_size 1) or beam search.

    Args:
        decoder: the Transformer in eval mode, a decoder of `transformer/fast/`, or an ensemble.
        src: `(batch, src_len)` LongTensor padded with pad_id, each sentence ending in eos.
        src_key_padding_mask: `(batch, src_len)` bool, True at padding.
        options: the whole decoding section (validated by `DecodingConfig`).
        targets: per sentence, target tokens every output must start with, and the tokens none holds
            (`rules.TargetRules`; the default: free outputs).
        scores: False when the caller needs no scores: every `Hypothesis.score` is then NaN, and greedy decoding
            skips the per-step log-softmax (the same tokens).

    Returns:
        Per sentence, `options.n_best` hypotheses: beam search's best first, samples in the order drawn.
    """
    if options.sampling:
        found = sample_decode(decoder, src, src_key_padding_mask, options, targets)
    elif options.beam_size == 1:
        found = [
            [h] for h in greedy_decode(decoder, src, src_key_padding_mask, options, targets, scores)
        ]
    else:
        found = beam_search(decoder, src, src_key_padding_mask, options, targets)
    if not scores:
        for hyps in found:
            for h in hyps:
                h.score = math.nan
    return found
