"""Decoding: greedy (`greedy.py`) and beam search (`beam.py`), both on the model's key/value cache."""

from .beam import beam_search, gnmt_length_penalty
from .greedy import Hypothesis, greedy_decode, max_output_length, max_output_lengths

__all__ = ["Hypothesis", "beam_search", "gnmt_length_penalty", "greedy_decode", "max_output_length",
           "max_output_lengths"]
