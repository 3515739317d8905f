"""Text the source vocabulary cannot represent (emoji, symbols, other scripts) passes through untranslated.

A subword model maps a character it never saw in training to `unk`. Fed to the model, one `unk` can cost the
translation of a whole clause; decoded, it is lost. So, before encoding, each such span is taken out of the
sentence, the rest is translated, and the span is put back into the translation, once and unchanged:

- a *span* is a run of user-perceived characters (a base character with its combining marks, variation selectors,
  skin-tone modifiers and zero-width-joiner sequences; a pair of regional indicators, i.e. a flag) that the source
  tokenizer encodes to `unk`, with no whitespace inside; a word spelt with a letter the vocabulary lacks ("Zoë"
  when "ë" is unknown) is a span as a whole, where a symbol written onto a word ("Hund🐕") is a span alone;
- it is put back after the target word aligned (`Translator.align`, the encoder-decoder attention) to the source
  word before it, or before the word aligned to the word after it when the span is written onto that word; at the
  start or end of the sentence it goes to the start or end of the translation; without an alignment (a
  CTranslate2 model) or an unaligned word, at the same relative position in the words of the translation;
- whether whitespace separated it from its neighbours is kept ("Hund🐕" gives "dog🐕"); with a target prefix it
  comes after the prefix's words.

`DecodingConfig.copy_unknown` (default true; `--no-copy-unknown`) turns this off: spans then reach the model as
`unk` and are dropped from the output. A tokenizer with byte fallback has no `unk` and nothing is taken out.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from .config import UNK_ID
from .tokenizer import Tokenizer

ZWJ = "\u200d"


@dataclass(frozen=True)
class Span:
    """One span taken out of a sentence.

    Attributes:
        text: the characters, as written.
        n_words_before: whitespace words of the remaining text before it (0: at the start).
        glued_left: no whitespace between it and the character before it.
        glued_right: no whitespace between it and the character after it.
        before_punctuation: see below.
    """

    text: str
    n_words_before: int
    glued_left: bool
    glued_right: bool
    before_punctuation: bool = False
    """The punctuation written after it was translated on the word before it: it goes back before the
    punctuation that ends that word's translation ("Łódź." -> "in Łódź.", not "in. Łódź")."""


@dataclass(frozen=True)
class Protected:
    """A sentence without its spans: `text` (what is translated), its word count and the spans in order."""

    text: str
    n_words: int
    spans: tuple[Span, ...]


def _extends(char: str, previous: str) -> bool:
    """Whether `char` belongs to the character cluster that `previous` ends."""
    code = ord(char)
    return (
        unicodedata.category(char) in ("Mn", "Me")
        or char == ZWJ
        or previous == ZWJ
        or 0xFE00 <= code <= 0xFE0F
        or 0x1F3FB <= code <= 0x1F3FF
        or 0xE0020 <= code <= 0xE007F
    )


_PUNCTUATION_END = ".,;:!?…)]}»\"'"
"""What ends a translated word and goes after a span put back after it."""


def _is_punctuation(cluster: str, unknown: bool) -> bool:
    """A cluster the vocabulary knows that is punctuation (it stays in the text translated)."""
    return not unknown and all(unicodedata.category(c).startswith("P") for c in cluster)


def _is_regional_indicator(char: str) -> bool:
    return 0x1F1E6 <= ord(char) <= 0x1F1FF


def clusters(text: str) -> list[str]:
    """`text` cut into user-perceived characters: a base character with what extends it (combining marks,
    variation selectors, skin tones, tag characters, a zero-width joiner and the character it joins), a flag's
    two regional indicators together. A simplification of Unicode's extended grapheme clusters (UAX #29) that
    keeps emoji sequences and flags whole."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        j = i + 1
        if _is_regional_indicator(text[i]) and j < n and _is_regional_indicator(text[j]):
            j += 1
        while j < n and _extends(text[j], text[j - 1]):
            j += 1
        out.append(text[i:j])
        i = j
    return out


class PassThrough:
    """Takes unknown spans out of sentences and puts them back into translations, for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._unknown: dict[str, bool] = {}

    def is_unknown(self, cluster: str) -> bool:
        """Whether the source tokenizer encodes `cluster` (not whitespace) to a sequence holding `unk`."""
        if cluster not in self._unknown:
            self._unknown[cluster] = (
                not cluster.isspace() and UNK_ID in self.tokenizer.encode_src([cluster])[0]
            )
        return self._unknown[cluster]

    def protect(self, sentences: list[str], ids: list[list[int]]) -> list[Optional[Protected]]:
        """Per sentence, the sentence without its spans, or None when it has none.

        Args:
            sentences: stripped sentences.
            ids: their source ids (`Tokenizer.src_ids`): only a sentence whose ids hold `unk` is looked at
                character by character.
        """
        return [
            self._protect_one(sentence) if UNK_ID in sentence_ids else None
            for sentence, sentence_ids in zip(sentences, ids)
        ]

    def _protect_one(self, sentence: str) -> Optional[Protected]:
        kept: list[str] = []  # the words translated
        spans: list[Span] = []
        for word in sentence.split():
            parts = clusters(word)
            unknown = [self.is_unknown(part) for part in parts]
            if not any(unknown):
                kept.append(word)
                continue
            # a word spelt with a letter the vocabulary lacks: one span, the punctuation around it not
            letters = [
                u and unicodedata.category(p[0]).startswith("L") for p, u in zip(parts, unknown)
            ]
            if not all(unknown) and any(letters):
                lead = next(i for i, p in enumerate(parts) if not _is_punctuation(p, unknown[i]))
                end = len(parts)
                while _is_punctuation(parts[end - 1], unknown[end - 1]):
                    end -= 1
                unknown = [lead <= i < end for i in range(len(parts))]
            rest, i = "", 0
            while i < len(parts):
                if not unknown[i]:
                    rest += parts[i]
                    i += 1
                    continue
                j = i
                while j < len(parts) and unknown[j]:
                    j += 1
                spans.append(
                    Span("".join(parts[i:j]), len(kept) + bool(rest), bool(rest), j < len(parts))
                )
                i = j
            if (
                rest
                and kept
                and not spans[-1].glued_left
                and all(unicodedata.category(c).startswith("P") for c in rest)
            ):
                kept[-1] += rest  # "Strand 👍." is translated as "Strand." and restored "beach 👍."
                if spans[-1].glued_right:
                    spans[-1] = dataclasses.replace(spans[-1], before_punctuation=True)
            elif rest:
                kept.append(rest)
        if not spans:
            return None
        return Protected(" ".join(kept), len(kept), tuple(spans))

    @staticmethod
    def restore(
        translation: str,
        protected: Protected,
        alignment: Optional[list[tuple[int, int]]] = None,
        n_prefix_words: int = 0,
    ) -> str:
        """`translation` of `protected.text` with the spans put back (the rules in the module docstring).

        Args:
            alignment: (source word, target word) pairs over whitespace words, or None (relative positions).
            n_prefix_words: words of a forced target prefix, before which nothing is put.
        """
        words = translation.split()
        n_src, n_tgt = protected.n_words, len(words)
        aligned: dict[int, list[int]] = {}
        for s, t in alignment or ():
            if 0 <= t < n_tgt:
                aligned.setdefault(s, []).append(t)

        def gap(span: Span) -> int:  # insert before target word `gap` (n_tgt: at the end)
            k = span.n_words_before
            if k == 0:
                return 0
            if k >= n_src:
                return n_tgt
            if span.glued_right and not span.glued_left and k in aligned:
                return min(aligned[k])
            if k - 1 in aligned:
                return max(aligned[k - 1]) + 1
            return round(k / n_src * n_tgt)

        inserts: dict[int, list[Span]] = {}
        for span in protected.spans:
            inserts.setdefault(max(gap(span), min(n_prefix_words, n_tgt)), []).append(span)
        out, glue_next, held = "", False, ""
        for g in range(n_tgt + 1):
            for span in inserts.get(g, []):
                out += ("" if not out or glue_next or span.glued_left else " ") + span.text
                glue_next = span.glued_right
            if held:  # the punctuation of the word before, after the spans that came before it
                out, glue_next, held = out + held, False, ""
            if g < n_tgt:
                word = words[g]
                if any(span.before_punctuation for span in inserts.get(g + 1, [])):
                    core = word.rstrip(_PUNCTUATION_END)
                    word, held = (core, word[len(core) :]) if core else (word, "")
                out += ("" if not out or glue_next else " ") + word
                glue_next = False
        return out


NBestFn = Callable[[list[str], list[list[int]]], list[list[tuple[str, float]]]]
"""`(stripped sentences, their source ids) -> per sentence, the (text, score) hypotheses`."""


def with_passthrough(
    passthrough: PassThrough,
    texts: list[str],
    ids: list[list[int]],
    prefixes: Optional[list[Optional[str]]],
    translate_n_best: NBestFn,
    copy_unknown: bool = True,
    align: Optional[Callable[[list[list[int]], list[str]], list[list[tuple[int, int]]]]] = None,
) -> tuple[list[list[tuple[str, float]]], int]:
    """`translate_n_best` of the stripped sentences `texts` and their source ids `ids` (`Tokenizer.src_ids`), with,
    if `copy_unknown`, each sentence's spans taken out before (a sentence with spans is encoded again without them)
    and put back into each of its hypotheses after, aligned with `align` (of source ids and translations; None:
    relative positions).

    Returns:
        (per sentence, the (text, score) hypotheses; the number of sentences that had spans).
    """
    texts, ids = list(texts), list(ids)
    if not copy_unknown:
        return translate_n_best(texts, ids), 0
    protected = passthrough.protect(texts, ids)
    touched = [i for i, p in enumerate(protected) if p is not None]
    if not touched:
        return translate_n_best(texts, ids), 0
    for i, new_ids in zip(
        touched, passthrough.tokenizer.src_ids([protected[i].text for i in touched])
    ):
        texts[i], ids[i] = protected[i].text, new_ids
    results = translate_n_best(texts, ids)
    pairs = [(i, text) for i in touched for text, _ in results[i]]
    alignments = (
        align([ids[i] for i, _ in pairs], [t for _, t in pairs]) if align else [None] * len(pairs)
    )
    it = iter(alignments)
    for i in touched:
        n_prefix = len(prefixes[i].split()) if prefixes and prefixes[i] else 0
        results[i] = [
            (PassThrough.restore(text, protected[i], next(it), n_prefix), score)
            for text, score in results[i]
        ]
    return results, len(touched)


__all__ = ["PassThrough", "Protected", "Span", "clusters", "with_passthrough"]
