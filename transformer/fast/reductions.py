"""Row reductions of the decoding loop, faster on the CPU: `row_argmax` (greedy) and `row_topk` (beam search).

Both give exactly what `argmax` and `topk` give (tests compare them on ties, NaN and infinities).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def reduction_chunk(vocab: int, min_chunks: int = 1) -> Optional[int]:
    """The chunk size of the two-stage row reductions (`row_argmax`, `row_topk`): the largest multiple of 16
    between 32 and 160 that cuts a row of vocab values into at least min_chunks whole chunks (multiples of 16
    vectorize well; an odd size such as 125 does not), or None if there is none."""
    return next(
        (c for c in range(160, 31, -16) if vocab % c == 0 and vocab // c >= min_chunks), None
    )


def row_argmax(x: Tensor) -> Tensor:
    """The index of each row's largest value, the first one on ties: `x.argmax(dim=-1)`, faster on the CPU.

    Index-returning reductions (`argmax`, `max(dim)`, `topk`) run several times slower on the CPU than `amax`,
    so the row is cut into chunks: the largest chunk maximum picks the chunk (the first such chunk), then an
    argmax within it the index: two small argmaxes instead of one over the whole row. NaN is the largest value,
    as for `argmax`. Below 16 rows (where the plain argmax is faster), on other devices, or without a chunk size
    that is a multiple of 16 between 32 and 160 and divides the vocabulary, it is `argmax` itself.

    Args:
        x: `(rows, vocab)`.

    Returns:
        `(rows,)` LongTensor.
    """
    rows, vocab = x.shape
    chunk = reduction_chunk(vocab)
    if x.device.type != "cpu" or chunk is None or rows < 16:
        return x.argmax(dim=-1)
    chunks = x.reshape(rows, vocab // chunk, chunk)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # (rows,)
    within = chunks[torch.arange(rows, device=x.device), best_chunk].argmax(dim=-1)  # (rows,)
    return best_chunk * chunk + within


def row_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest values of each row, largest first, and their indices: `x.topk(k, dim=-1)`, faster on the CPU.

    `topk` costs about as much per row as per element on the CPU, so the row is cut into chunks: the k largest
    values lie in the k chunks with the largest maxima (a chunk outside them has k chunk maxima at least as
    large above its own, each a distinct element), so `amax` per chunk, a top-k over the chunk maxima, and a
    top-k over the k chosen chunks give the same values. Indices of equal values may come in another order than
    `topk`'s (which does not specify it). Below 16 rows, on other devices, or without a chunk size that is a
    multiple of 16 between 32 and 160, divides the vocabulary and leaves at least 4 chunks per selected one, it is
    `topk` itself (see `reduction_chunk`).

    Args:
        x: `(rows, vocab)`.
        k: values per row, at most vocab.

    Returns:
        values and indices (LongTensor), each `(rows, k)`.
    """
    rows, vocab = x.shape
    chunk = reduction_chunk(vocab, min_chunks=4 * k)
    if x.device.type != "cpu" or chunk is None or rows < 16:
        return x.topk(k, dim=-1)
    n_chunks = vocab // chunk
    top_chunks = x.reshape(rows, n_chunks, chunk).amax(dim=-1).topk(k, dim=-1).indices  # (rows, k)
    first_chunk = torch.arange(0, rows * n_chunks, n_chunks, device=x.device)[:, None]  # (rows, 1)
    candidates = x.reshape(rows * n_chunks, chunk).index_select(
        0, (top_chunks + first_chunk).view(-1)
    )
    values, within = candidates.view(rows, k * chunk).topk(
        k, dim=-1
    )  # (rows, k): position among the candidates
    return values, top_chunks.gather(1, within // chunk) * chunk + within % chunk
