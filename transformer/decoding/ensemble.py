"""Ensembles: several models decoding together, as one `IncrementalDecoder`.

Each member encodes the source and keeps its own key/value cache; at every step the ensemble's score of a next
token is the mean of the members' log-probabilities of it (a geometric mean of their distributions, which the
searches renormalise with their log-softmax). Greedy decoding, beam search and sampling take it like one model. The
members must share one target vocabulary (the same tokenizer: `engines.open_engine` checks it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .interface import IncrementalCache, IncrementalDecoder


@dataclass
class EnsembleCache:
    """One cache per member, reordered together (`IncrementalCache`)."""

    caches: list[IncrementalCache]

    def select(self, index: Tensor, memory_index: Optional[Tensor] = None) -> None:
        for cache in self.caches:
            cache.select(index, memory_index)


class EnsembleDecoder:
    """Several `IncrementalDecoder`s with one target vocabulary, decoding as one (see the module docstring).

    Args:
        members: the members' decoders (readable models or `transformer/fast/` decoders).

    Attributes:
        config: the first member's config with the smallest `max_positions` of all (the searches read it).

    Raises:
        ValueError: fewer than two members, or target vocabularies of different sizes.
    """

    def __init__(self, members: list[IncrementalDecoder]) -> None:
        if len(members) < 2:
            raise ValueError("an ensemble needs at least two models")
        sizes = {m.config.tgt_vocab_size for m in members}
        if len(sizes) > 1:
            raise ValueError(
                f"ensemble members have target vocabularies of different sizes: {sorted(sizes)}"
            )
        self.members = members
        self.config = dataclasses.replace(
            members[0].config, max_positions=min(m.config.max_positions for m in members)
        )

    def encode(self, src: Tensor, src_key_padding_mask: Tensor) -> list[Any]:
        """Each member's memory of `src` (`(batch, src_len, d_model)` each; the widths may differ)."""
        return [m.encode(src, src_key_padding_mask) for m in self.members]

    def new_cache(
        self,
        memory: list[Any],
        memory_key_padding_mask: Optional[Tensor] = None,
        beam_size: int = 1,
    ) -> EnsembleCache:
        return EnsembleCache(
            [
                m.new_cache(mem, memory_key_padding_mask, beam_size)
                for m, mem in zip(self.members, memory)
            ]
        )

    def decode_step(self, tokens: Tensor, cache: EnsembleCache) -> Tensor:
        """The mean of the members' log-probabilities of the next token, `(rows, tgt_vocab_size)`."""
        total = None
        for member, member_cache in zip(self.members, cache.caches):
            lprobs = torch.log_softmax(member.decode_step(tokens, member_cache).float(), dim=-1)
            total = lprobs if total is None else total + lprobs
        return total / len(self.members)
