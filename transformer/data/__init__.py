"""Data: the text reader (`text.py`), parallel corpora (`datasets.py`), the on-disk token cache of a training
split (`token_cache.py`), and padded, token-budget batches (`batching.py`)."""

from .batching import Batch, make_batch, pad_sequences, token_batches
from .datasets import ParallelCorpus, SplitSource, load_split, open_split
from .text import DataError, LineReader, StreamLineReader, count_lines, read_lines, split_lines
from .token_cache import EncodedPairs, TokenCacheError, get_token_cache

__all__ = ["Batch", "DataError", "EncodedPairs", "LineReader", "ParallelCorpus", "SplitSource", "StreamLineReader",
           "TokenCacheError", "count_lines", "get_token_cache", "load_split", "make_batch", "open_split",
           "pad_sequences", "read_lines", "split_lines", "token_batches"]
