"""Data: parallel corpora (`datasets.py`) and padded, token-budget batches (`batching.py`)."""

from .batching import Batch, make_batch, pad_sequences, token_batches
from .datasets import DataError, ParallelCorpus, load_split, read_lines, split_lines

__all__ = ["Batch", "DataError", "ParallelCorpus", "load_split", "make_batch", "pad_sequences", "read_lines",
           "split_lines",
           "token_batches"]
