"""The corpora of a run mixed into one epoch by temperature sampling (Arivazhagan et al. 2019, "Massively
Multilingual Neural Machine Translation in the Wild", §4.2): a multilingual run's directions, and any run's parallel
and synthetic corpora (back-translated or distilled text, `data.synthetic`).

Corpus c, with n_c training pairs and weight w_c (`data.parallel_weight` for the parallel corpora, each synthetic
corpus's `weight`), is drawn with probability p_c = w_c n_c^(1/T) / sum_k w_k n_k^(1/T)
(`data.direction_temperature` T >= 1): T = 1 is proportional to the weighted sizes (as if the corpora were
concatenated, each w_c times), a larger T gives the small corpora more, and T -> infinity weighs each by w_c only.

An epoch holds as many pairs as all corpora trained on together (N = sum n_c over the corpora of weight w_c > 0),
corpus c's share N * p_c rounded to whole pairs (largest remainders), so that every epoch follows the weights
exactly rather than only on average. The share's pairs are drawn from the corpus's own pairs without replacement,
in a fresh random order every epoch: a corpus sampled below its size sees a different subset each epoch, one sampled
above it every pair once per whole pass and the rest drawn anew. All of it is fixed by the seed and the epoch
number, so a resumed run sees the same epochs. The batches of an epoch (`batching.token_batches`) are then cut from
the mixed pairs as from any corpus: a batch mixes corpora.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from .token_cache import EncodedPairs

if TYPE_CHECKING:
    from .batching import Batch


def direction_probabilities(
    sizes: list[int], temperature: float, weights: Optional[list[float]] = None
) -> np.ndarray:
    """p_d = w_d n_d^(1/T) / sum_k w_k n_k^(1/T), w the corpora's weights (1 each if None): `(len(sizes),)` float64,
    summing to 1."""
    scaled = np.asarray(sizes, dtype=np.float64) ** (1.0 / temperature)
    if weights is not None:
        scaled = scaled * np.asarray(weights, dtype=np.float64)
    return scaled / scaled.sum()


def epoch_size(sizes: list[int], weights: Optional[list[float]] = None) -> int:
    """Pairs in one epoch: those of the directions trained on, sum of n_d over w_d > 0 (a corpus of weight 0, the
    references beside a distilled student's corpora, adds none)."""
    if weights is None:
        return int(sum(sizes))
    return int(sum(n for n, w in zip(sizes, weights) if w > 0))


def direction_shares(
    sizes: list[int], temperature: float, weights: Optional[list[float]] = None
) -> np.ndarray:
    """Pairs of each direction in one epoch of N = `epoch_size(sizes, weights)` pairs: N * p_d rounded by largest
    remainders (they sum to N; ties go to the earlier direction). `(len(sizes),)` int64."""
    total = epoch_size(sizes, weights)
    exact = direction_probabilities(sizes, temperature, weights) * total
    shares = np.floor(exact).astype(np.int64)
    left = int(total - shares.sum())
    order = np.lexsort(
        (np.arange(len(sizes)), -(exact - shares))
    )  # largest remainder first, then earlier
    shares[order[:left]] += 1
    return shares


def draw_indices(n_pairs: int, share: int, rng: np.random.Generator) -> np.ndarray:
    """`share` indices into a direction's `n_pairs` pairs: whole random permutations while the share allows, then
    the first indices of one more (without replacement within each pass)."""
    passes = [rng.permutation(n_pairs) for _ in range(share // n_pairs)]
    rest = rng.permutation(n_pairs)[: share % n_pairs]
    return np.concatenate([*passes, rest]).astype(np.int64)


class MixedPairs:
    """One epoch's pairs of the run's corpora (one or several), as one corpus: what `EncodedPairs` offers the
    training loop (`src_lengths`, `tgt_lengths`, `batch`, `src`, `tgt`, `len`), over the corpora's own pairs.

    Args:
        parts: each direction's pairs (its sources start with its target language's token).
        direction: `(n,)` which part pair i comes from.
        index: `(n,)` pair i's index in that part.
    """

    def __init__(self, parts: list[EncodedPairs], direction: np.ndarray, index: np.ndarray) -> None:
        self.parts, self.direction, self.index = parts, direction, index
        self.src_lengths = np.empty(len(index), dtype=np.int32)
        self.tgt_lengths = np.empty(len(index), dtype=np.int32)
        for d, part in enumerate(parts):
            chosen = direction == d
            self.src_lengths[chosen] = part.src_lengths[index[chosen]]
            self.tgt_lengths[chosen] = part.tgt_lengths[index[chosen]]

    def __len__(self) -> int:
        return len(self.index)

    def src(self, i: int) -> np.ndarray:
        return self.parts[self.direction[i]].src(int(self.index[i]))

    def tgt(self, i: int) -> np.ndarray:
        return self.parts[self.direction[i]].tgt(int(self.index[i]))

    def batch(self, indices: np.ndarray | list[int]) -> Batch:
        """The padded `Batch` of these pairs, in this order."""
        from .batching import make_batch

        return make_batch([self.src(i) for i in indices], [self.tgt(i) for i in indices])


def mix_directions(
    parts: list[EncodedPairs],
    sizes: list[int],
    temperature: float,
    seed: int,
    epoch: int,
    weights: Optional[list[float]] = None,
) -> MixedPairs:
    """The pairs of one epoch: each direction's share (`direction_shares` of `sizes`) drawn from its pairs of this
    epoch (`parts`: the token cache, or this epoch's subword sample, whose size may differ a little from `sizes`),
    fixed by seed and epoch.

    Args:
        parts: each direction's pairs this epoch.
        sizes: each direction's pairs in its token cache (the n_d of the probabilities; the same every epoch).
        temperature: data.direction_temperature.
        seed, epoch: training.seed and the epoch number.
        weights: each part's weight (`Corpus.weight`; None: 1 each).

    A run of one corpus has nothing to mix: its epoch is its pairs as they are, in order (the batches shuffle them).
    """
    if len(parts) == 1:
        return MixedPairs(parts, np.zeros(len(parts[0]), dtype=np.int64), np.arange(len(parts[0])))
    rng = np.random.default_rng(
        [seed, epoch, 0x6D6978]
    )  # a stream apart from the batch order's ([seed, epoch])
    shares = direction_shares(sizes, temperature, weights)
    index = [draw_indices(len(part), int(share), rng) for part, share in zip(parts, shares)]
    direction = np.concatenate([np.full(len(i), d, dtype=np.int64) for d, i in enumerate(index)])
    return MixedPairs(parts, direction, np.concatenate(index))
