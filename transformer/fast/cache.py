"""The key/value cache of `CPUDecoder`: preallocated self-attention buffers and one memory row per sentence.

The readable cache (`model.attention.KVCache`) concatenates a new tensor per step and keeps one memory row per
decoded row. Here:

* self-attention keys and values go into a buffer `(2, rows, n_heads, capacity, d_head)` that doubles when full,
  and beam search's reordering copies the filled positions into a spare buffer of the same size (no allocation
  per step);
* the memory is projected into keys and values once per sentence, and the g rows of a sentence (its beams) read
  the same row: encoder-decoder attention sees them as g query positions of one row (`CPUDecoder`);
* the memory's padding mask is kept as an additive bias (0 at tokens, -inf at padding), folded into the first
  batched product of the attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


@dataclass
class GrowingKVCache:
    """Self-attention keys and values of one layer in a preallocated buffer.

    Attributes:
        key, value: `(rows, n_heads, cached_len, d_head)` views of the buffer, or None before the first step.
    """

    key: Optional[Tensor] = None
    value: Optional[Tensor] = None
    _buffer: Optional[Tensor] = field(
        default=None, repr=False
    )  # [key, value] (2, rows, n_heads, capacity, d_head)
    _spare: Optional[Tensor] = field(
        default=None, repr=False
    )  # the same shape: where `select` writes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store new positions after the cached ones, as `KVCache.append`.

        Args:
            key, value: `(rows, n_heads, new_len, d_head)`.

        Returns:
            every cached key and value, `(rows, n_heads, cached_len + new_len, d_head)` each.
        """
        rows, n_heads, new_len, d_head = key.shape
        length = 0 if self.key is None else self.key.size(2)
        end = length + new_len
        if self._buffer is None or end > self._buffer.size(3) or rows != self._buffer.size(1):
            capacity = max(end, 16, 2 * self._buffer.size(3) if self._buffer is not None else 0)
            buffer = key.new_empty(2, rows, n_heads, capacity, d_head)
            if length:
                buffer[0, :, :, :length], buffer[1, :, :, :length] = self.key, self.value
            self._buffer, self._spare = buffer, None
        self._buffer[0, :, :, length:end], self._buffer[1, :, :, length:end] = key, value
        self.key, self.value = self._buffer[0, :, :, :end], self._buffer[1, :, :, :end]
        return self.key, self.value

    def select(self, index: Tensor) -> None:
        """Keep (and reorder, repeat) rows: row i becomes old row `index[i]`; copies the filled positions only.

        Args:
            index: `(new_rows,)` LongTensor.
        """
        if self.key is None:
            return
        length = self.key.size(2)
        if self._spare is None or self._spare.size(1) != index.numel():
            self._spare = self._buffer.new_empty(2, index.numel(), *self._buffer.shape[2:])
        torch.index_select(self.key, 0, index, out=self._spare[0, :, :, :length])
        torch.index_select(self.value, 0, index, out=self._spare[1, :, :, :length])
        self._buffer, self._spare = self._spare, self._buffer
        self.key, self.value = self._buffer[0, :, :, :length], self._buffer[1, :, :, :length]


@dataclass
class MemoryKV:
    """Encoder-decoder keys and values of one layer, one row per sentence.

    Attributes:
        key, value: `(memory_rows, n_heads, src_len, d_head)`, contiguous (read whole at every step).
    """

    key: Tensor
    value: Tensor

    def select(self, index: Tensor) -> None:
        self.key, self.value = self.key.index_select(0, index), self.value.index_select(0, index)


@dataclass
class CPUDecoderCache:
    """Everything `CPUDecoder.decode_step` keeps between steps.

    Attributes:
        self_attention: one `GrowingKVCache` per decoder layer, `rows` rows.
        cross_attention: one `MemoryKV` per decoder layer, `memory_rows` rows.
        memory_key_padding_mask: `(memory_rows, src_len)` bool, True at padding, or None.
        padding_bias: `(memory_rows, n_heads, 1, src_len)`, 0 at source tokens and -inf at padding (repeated over
            heads, so that rows fold into `memory_rows * n_heads` without a copy); None when there is no mask, or
            when a row is all padding (it must attend to nothing, which a bias cannot express: the explicit
            attention of `model.attention` handles it).
        length: positions decoded so far.
    """

    self_attention: list[GrowingKVCache]
    cross_attention: list[MemoryKV]
    memory_key_padding_mask: Optional[Tensor]
    padding_bias: Optional[Tensor]
    length: int = 0

    @property
    def memory_rows(self) -> int:
        return self.cross_attention[0].key.size(0)

    def select(self, index: Tensor, memory_index: Optional[Tensor] = None) -> None:
        """Keep, reorder or repeat rows, as `DecoderCache.select`.

        Args:
            index: `(new_rows,)`: new row i is old row `index[i]` (it must read the same sentence's memory row
                unless memory_index moves the memory rows too).
            memory_index: `(new_memory_rows,)`, the memory rows to keep (sentences leaving the batch), or None.
        """
        for cache in self.self_attention:
            cache.select(index)
        if memory_index is None:
            return
        for cache in self.cross_attention:
            cache.select(memory_index)
        if self.memory_key_padding_mask is not None:
            self.memory_key_padding_mask = self.memory_key_padding_mask.index_select(
                0, memory_index
            )
        if self.padding_bias is not None:
            self.padding_bias = self.padding_bias.index_select(0, memory_index)


def padding_bias(key_padding_mask: Tensor, n_heads: int, dtype: torch.dtype) -> Optional[Tensor]:
    """The memory's padding mask as an additive bias `(memory_rows, n_heads, 1, src_len)` (see `CPUDecoderCache`);
    None when some row is all padding."""
    if key_padding_mask.all(dim=1).any():
        return None
    bias = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
    bias.masked_fill_(key_padding_mask, float("-inf"))
    # (memory_rows, n_heads, 1, src_len)
    return bias[:, None, None, :].expand(-1, n_heads, 1, -1).contiguous()
