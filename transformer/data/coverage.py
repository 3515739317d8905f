"""Characters a vocabulary cannot spell: which training pairs hold characters the tokenizer maps to unk, counted
while a token cache is built (`token_cache.py`) and reported at the start of training (`data.unknown_characters`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from ..config import UNK_ID
from ..tokenizer import Tokenizer


class UnknownCharacters:
    """Counts, while a cache is built, the pairs whose text holds characters that the tokenizer maps to unk (a fixed
    vocabulary met with new text when fine-tuning; a fresh one whose `data.spm_character_coverage` left rare
    characters out): the model would learn to produce or drop unk for them.

    Only pairs with an unk id are looked at; a character counts when the tokenizer encodes it alone to unk.
    """

    SHOWN = 20
    """Characters kept in the record, the most frequent first."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pairs = 0
        self.counts: Counter[str] = Counter()
        self._unknown: dict[tuple[str, str], bool] = {}

    def _is_unknown(self, char: str, side: str) -> bool:
        key = (char, side)
        if key not in self._unknown:
            ids = (self.tokenizer.src_ids if side == "src" else self.tokenizer.tgt_ids)([char])[0]
            self._unknown[key] = UNK_ID in ids
        return self._unknown[key]

    def add(
        self,
        src_texts: list[str],
        tgt_texts: list[str],
        src_ids: np.ndarray,
        src_lengths: np.ndarray,
        tgt_ids: np.ndarray,
        tgt_lengths: np.ndarray,
    ) -> None:
        """Count the pairs of one chunk: their texts, and their ids concatenated (eos excluded) with the length of
        each pair's."""
        src_unk, tgt_unk = _with_unk(src_ids, src_lengths), _with_unk(tgt_ids, tgt_lengths)
        for i in sorted(src_unk | tgt_unk):
            sides = [
                (text, side)
                for text, side, found in (
                    (src_texts[i], "src", src_unk),
                    (tgt_texts[i], "tgt", tgt_unk),
                )
                if i in found
            ]
            self.pairs += 1
            self.counts.update(
                {c for text, side in sides for c in set(text) if self._is_unknown(c, side)}
            )

    def to_dict(self) -> dict[str, Any]:
        """{"pairs": pairs with unk, "distinct": characters found, "characters": [[character, pairs], ...]}."""
        return {
            "pairs": self.pairs,
            "distinct": len(self.counts),
            "characters": [[c, n] for c, n in self.counts.most_common(self.SHOWN)],
        }


def _with_unk(ids: np.ndarray, lengths: np.ndarray) -> set[int]:
    """The indices of the sequences (concatenated in `ids`, `lengths` long) that hold an unk id."""
    return set(
        np.searchsorted(np.cumsum(lengths), np.flatnonzero(ids == UNK_ID), side="right").tolist()
    )
