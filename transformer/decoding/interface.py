"""What the searches need from a model: `IncrementalDecoder`, one step at a time on a cache.

The readable `model.Transformer` implements it, and so do the CPU speed paths of `transformer/fast/`
(`CPUDecoder`, `CompiledDecoder`) and an ensemble of models (`ensemble.py`); greedy decoding, beam search and
sampling take any of them.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from torch import Tensor

from ..config import TransformerConfig


class IncrementalCache(Protocol):
    """The state an `IncrementalDecoder` keeps between steps (keys and values of the decoded positions, the memory)."""

    def select(self, index: Tensor, memory_index: Optional[Tensor] = None) -> None:
        """Keep, reorder or repeat rows: new row i continues old row `index[i]`.

        Args:
            index: `(new_rows,)` LongTensor. Without memory_index, row i must belong to the same sentence as old
                row `index[i]` (beam search reorders beams within their sentence).
            memory_index: `(new_sentences,)` LongTensor, the sentences that stay (in order) when some leave the
                batch; None when the sentences are unchanged.
        """


class IncrementalDecoder(Protocol):
    """A model that encodes a batch once and then decodes it one position per step (Vaswani et al. 2017, §3).

    Attributes:
        config: the model's sizes; the searches read `max_positions`.
    """

    config: TransformerConfig

    def encode(self, src: Tensor, src_key_padding_mask: Tensor) -> Any:
        """src `(batch, src_len)`, src_key_padding_mask `(batch, src_len)` bool (True at padding) -> the memory that
        `new_cache` takes: a Tensor `(batch, src_len, d_model)` for one model, a list of them (one per member) for
        an ensemble (`decoding/ensemble.py`). The searches only hand it on."""

    def new_cache(
        self, memory: Any, memory_key_padding_mask: Optional[Tensor] = None, beam_size: int = 1
    ) -> IncrementalCache:
        """A cache for decoding `memory` (what `encode` returned), each sentence on beam_size consecutive rows
        (`batch * beam_size` rows in all)."""

    def decode_step(self, tokens: Tensor, cache: IncrementalCache) -> Tensor:
        """tokens `(rows,)`, each row's last token (bos at the first step) -> logits `(rows, tgt_vocab_size)` of
        the next one; the cache grows by one position.

        Raises:
            ValueError: the decoded length would exceed max_positions.
        """
