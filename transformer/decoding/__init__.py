"""Decoding: greedy (`greedy.py`), beam search (`beam.py`) and random sampling (`sampling.py`), all one position
per step on a key/value cache, through the model interface of `interface.py`; n-gram blocking for each in
`ngram.py`; the options of a call and the n-best selection in `options.py`."""

from .beam import beam_search, gnmt_length_penalty
from .greedy import Hypothesis, greedy_decode, max_output_length, max_output_lengths
from .interface import IncrementalCache, IncrementalDecoder

__all__ = ["Hypothesis", "IncrementalCache", "IncrementalDecoder", "beam_search", "gnmt_length_penalty",
           "greedy_decode", "max_output_length", "max_output_lengths"]
