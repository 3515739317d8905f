"""Data: the text reader (`text.py`), parallel corpora (`datasets.py`), the on-disk token cache of a training
split (`token_cache.py`), and padded, token-budget batches (`batching.py`).

The names are imported on first use: only `batching.py` imports torch, and the process that encodes subword samples
imports the rest without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_imports import lazy_exports

__all__ = [
    "Batch",
    "DataError",
    "EncodedPairs",
    "LineReader",
    "ParallelCorpus",
    "SplitSource",
    "StreamLineReader",
    "TokenCacheError",
    "count_lines",
    "get_token_cache",
    "load_split",
    "make_batch",
    "open_split",
    "pad_sequences",
    "read_lines",
    "split_lines",
    "token_batches",
]

_HOMES = {
    **dict.fromkeys(["Batch", "make_batch", "pad_sequences", "token_batches"], ".batching"),
    **dict.fromkeys(["ParallelCorpus", "SplitSource", "load_split", "open_split"], ".datasets"),
    **dict.fromkeys(
        ["DataError", "LineReader", "StreamLineReader", "count_lines", "read_lines", "split_lines"],
        ".text",
    ),
    **dict.fromkeys(["EncodedPairs", "TokenCacheError", "get_token_cache"], ".token_cache"),
}

if TYPE_CHECKING:
    from .batching import Batch, make_batch, pad_sequences, token_batches
    from .datasets import ParallelCorpus, SplitSource, load_split, open_split
    from .text import DataError, LineReader, StreamLineReader, count_lines, read_lines, split_lines
    from .token_cache import EncodedPairs, TokenCacheError, get_token_cache


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
