"""The building blocks of the Transformer: embeddings, positional encoding, feed-forward, encoder and decoder layers.

Shapes follow the legend in `model/attention.py`; masks follow its convention (True at padding / blocked).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import KVCache, MultiHeadAttention


class TokenEmbedding(nn.Module):
    """Learned token embeddings multiplied by √d_model (Vaswani et al. 2017, §3.4).

    Initialised N(0, d_model^-0.5) so that the scaled embedding has unit variance; the padding row is
    zero. When tied with the output projection (§3.4) the same matrix maps hidden states to logits.

    Args:
        vocab_size: number of token ids.
        d_model: embedding width.
        pad_id: id of the padding token (its embedding stays zero).
    """

    def __init__(self, vocab_size: int, d_model: int, pad_id: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.scale = math.sqrt(d_model)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=d_model ** -0.5)
        with torch.no_grad():
            self.embedding.weight[pad_id].zero_()

    @property
    def weight(self) -> nn.Parameter:
        """The `(vocab_size, d_model)` embedding matrix."""
        return self.embedding.weight

    def forward(self, tokens: Tensor) -> Tensor:
        """Args: tokens `(batch, len)` LongTensor. Returns: `(batch, len, d_model)`."""
        return self.embedding(tokens) * self.scale


class SinusoidalPositionalEncoding(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) (§3.5).

    Args:
        d_model: encoding width (even).
        max_positions: number of positions in the table.

    Raises:
        ValueError: in forward, when a sequence is longer than max_positions.
    """

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        position = torch.arange(max_positions, dtype=torch.float64)[:, None]  # (max_positions, 1)
        inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d_model/2,)
        table = torch.zeros(max_positions, d_model, dtype=torch.float64)
        table[:, 0::2] = torch.sin(position * inv_freq)
        table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
        # Not a parameter and not saved: it is a closed form, rebuilt on load.
        self.register_buffer("table", table.float(), persistent=False)  # (max_positions, d_model)
        self.max_positions = max_positions

    def forward(self, length: int, start: int = 0) -> Tensor:
        """Encodings of positions start, ..., start + length - 1.

        Returns:
            `(length, d_model)`, to be added to `(batch, length, d_model)` embeddings.

        Raises:
            ValueError: if start + length > max_positions, naming both lengths.
        """
        if start + length > self.max_positions:
            raise ValueError(f"sequence of {start + length} positions is longer than the model's "
                             f"max_positions={self.max_positions}; shorten the input or raise model.max_positions")
        return self.table[start:start + length]


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position alike (§3.3, eq. 2).

    Args:
        d_model: input and output width.
        d_ff: inner width.
        activation: "relu" (paper), "gelu" or "swish" (SiLU: x * sigmoid(x)).
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu") -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.activation = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}[activation]
        for linear in (self.linear1, self.linear2):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Args: x `(batch, len, d_model)`. Returns: `(batch, len, d_model)`."""
        return self.linear2(self.activation(self.linear1(x)))


def residual(x: Tensor, sublayer_out: Tensor, norm: nn.LayerNorm, norm_first: bool) -> Tensor:
    """The residual connection around a sub-layer (§3.1): post-norm LayerNorm(x + out), or pre-norm x + out (in
    pre-norm the LayerNorm was applied to the sub-layer's input instead).

    Args:
        x: the sub-layer's input `(batch, len, d_model)`; sublayer_out: its output (after dropout), the same shape.
        norm: the sub-layer's LayerNorm; norm_first: pre-norm (True) or post-norm (False).

    Returns:
        `(batch, len, d_model)`.
    """
    return x + sublayer_out if norm_first else norm(x + sublayer_out)


class EncoderLayer(nn.Module):
    """One encoder layer: self-attention, then feed-forward, each as a residual sub-layer (§3.1).

    Post-norm (paper): x = LayerNorm(x + Dropout(Sublayer(x))). Pre-norm (`norm_first`):
    x = x + Dropout(Sublayer(LayerNorm(x))).

    Args:
        d_model, n_heads, d_ff, dropout, attention_dropout, activation, norm_first: as in TransformerConfig.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, attention_dropout: float,
                 activation: str, norm_first: bool) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, activation)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, src_key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """Args:
            x: `(batch, src_len, d_model)`.
            src_key_padding_mask: `(batch, src_len)` bool, True at padding.
            need_weights: also return the self-attention weights.

        Returns:
            `(batch, src_len, d_model)` and the weights `(batch, n_heads, src_len, src_len)` or None.
        """
        h = self.norm1(x) if self.norm_first else x
        h, weights = self.self_attn(h, key_padding_mask=src_key_padding_mask, need_weights=need_weights)
        x = residual(x, self.dropout(h), self.norm1, self.norm_first)
        h = self.feed_forward(self.norm2(x) if self.norm_first else x)
        return residual(x, self.dropout(h), self.norm2, self.norm_first), weights


class DecoderLayer(nn.Module):
    """One decoder layer: masked self-attention, encoder-decoder attention, feed-forward (§3.1).

    In encoder-decoder attention the queries come from the decoder and the keys and values from the
    encoder output, the memory (§3.2.3). Residual and LayerNorm placement as in `EncoderLayer`.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, attention_dropout: float,
                 activation: str, norm_first: bool) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, activation)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, memory: Tensor, memory_key_padding_mask: Optional[Tensor] = None,
                tgt_key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = True, self_cache: Optional[KVCache] = None,
                cross_cache: Optional[KVCache] = None,
                need_weights: bool = False) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """Args:
            x: `(batch, tgt_len, d_model)` (only the new positions when decoding with a cache).
            memory: `(batch, src_len, d_model)` encoder output.
            memory_key_padding_mask: `(batch, src_len)` bool, True at source padding.
            tgt_key_padding_mask: `(batch, tgt_len)` bool, True at target padding (optional: the causal
                mask already hides trailing padding from every real position).
            attn_mask: `(tgt_len, k_len)` bool, True where blocked; overrides is_causal.
            is_causal: apply the causal mask without building it (full-sequence decoding).
            self_cache, cross_cache: `KVCache`s for incremental decoding, or None.
            need_weights: also return both attention weight tensors.

        Returns:
            `(batch, tgt_len, d_model)`, self-attention weights `(batch, n_heads, tgt_len, k_len)` and
            encoder-decoder weights `(batch, n_heads, tgt_len, src_len)` (None unless need_weights).
        """
        h = self.norm1(x) if self.norm_first else x
        h, self_weights = self.self_attn(h, key_padding_mask=tgt_key_padding_mask, attn_mask=attn_mask,
                                         is_causal=is_causal, cache=self_cache, need_weights=need_weights)
        x = residual(x, self.dropout(h), self.norm1, self.norm_first)
        h = self.norm2(x) if self.norm_first else x
        h, cross_weights = self.cross_attn(h, memory, key_padding_mask=memory_key_padding_mask, cache=cross_cache,
                                           need_weights=need_weights)
        x = residual(x, self.dropout(h), self.norm2, self.norm_first)
        h = self.feed_forward(self.norm3(x) if self.norm_first else x)
        return residual(x, self.dropout(h), self.norm3, self.norm_first), self_weights, cross_weights
