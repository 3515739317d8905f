"""What every search returns: `Hypothesis`, one output sequence with its score."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Hypothesis:
    """One output sequence.

    Attributes:
        tokens: target ids without bos and eos.
        score: sum of the token log-probabilities (eos included when finished), divided by the length penalty in
            beam search (see `decoding/beam.py`); NaN when the search was asked for no scores (`scores=False`).
        finished: True if the sequence ended with eos; False if it was cut at the length cap.
    """

    tokens: list[int]
    score: float
    finished: bool
