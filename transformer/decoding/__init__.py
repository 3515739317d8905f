"""Decoding: greedy (`greedy.py`) and beam search (`beam.py`), both on the model's key/value cache."""

from .greedy import Hypothesis, greedy_decode, max_output_lengths

__all__ = ["Hypothesis", "greedy_decode", "max_output_lengths"]
