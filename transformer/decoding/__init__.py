"""Decoding: one entry, `search` (`search.py`), over greedy decoding (`greedy.py`), beam search (`beam.py`) and
random sampling (`sampling.py`), all one position per step on a key/value cache through the model interface of
`interface.py`; the length cap and the rules on the next token that all three apply in `rules.py` (n-gram blocking,
runs and forced prefixes in `ngram.py`); the options of a call and the n-best selection in `options.py`."""

from .beam import gnmt_length_penalty
from .hypothesis import Hypothesis
from .interface import IncrementalCache, IncrementalDecoder
from .rules import NextTokenRules, TargetRules, max_output_length, max_output_lengths
from .search import search

__all__ = [
    "Hypothesis",
    "IncrementalCache",
    "IncrementalDecoder",
    "NextTokenRules",
    "TargetRules",
    "gnmt_length_penalty",
    "max_output_length",
    "max_output_lengths",
    "search",
]
