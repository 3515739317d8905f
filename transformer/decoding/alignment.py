"""Word alignments from encoder-decoder attention: which source word each target word attends to most.

For a (source, translation) pair, the decoder position that produces target piece t attends over the source
pieces with weights A[t, s] (one layer's heads averaged, by default the last layer's: `Translator.align`). Each
target piece is aligned to the source piece of largest weight (the source eos excluded), and piece pairs become
word pairs: a word starts at a piece beginning with "▁" (sentencepiece's word boundary). The result is the set of
(source word, target word) pairs, as Pharaoh "i-j" lines print them (0-based, sorted).
"""

from __future__ import annotations

from torch import Tensor

WORD_START = "\u2581"
"""Sentencepiece's mark of a piece that starts a word."""


def word_index(pieces: list[str]) -> list[int]:
    """The whitespace word of each piece (0-based): a new word at each piece starting with ▁ (and at the first)."""
    words, current = [], -1
    for i, piece in enumerate(pieces):
        if i == 0 or piece.startswith(WORD_START):
            current += 1
        words.append(current)
    return words


def align_words(
    weights: Tensor, src_pieces: list[str], tgt_pieces: list[str]
) -> list[tuple[int, int]]:
    """Pharaoh word pairs (source word i, target word j) from piece-level attention.

    Args:
        weights: `(len(tgt_pieces), len(src_pieces) + 1)` attention of each target piece over the source pieces and
            the source eos (last column, never aligned to).
        src_pieces, tgt_pieces: the pieces, without eos.

    Returns:
        Sorted, distinct (i, j) pairs; every target word gets at least one.
    """
    if not src_pieces or not tgt_pieces:
        return []
    src_words, tgt_words = word_index(src_pieces), word_index(tgt_pieces)
    best = weights[: len(tgt_pieces), : len(src_pieces)].argmax(-1).tolist()  # (tgt pieces,)
    return sorted({(src_words[s], tgt_words[t]) for t, s in enumerate(best)})


def pharaoh(pairs: list[tuple[int, int]]) -> str:
    """ "0-0 1-2 ..." """
    return " ".join(f"{i}-{j}" for i, j in pairs)
