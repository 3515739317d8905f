"""Multi-head scaled dot-product attention (Vaswani et al. 2017, §3.2), masks and the key/value cache.

Shape legend (used in every docstring and reshape comment of the model):
    batch     sentences in the batch (times beam_size during beam search)
    q_len     query positions; k_len key/value positions
    src_len   source positions; tgt_len target positions
    d_model   model width; n_heads heads of width d_head = d_model / n_heads

Mask convention (one for the whole project):
    * A padding mask is a bool tensor `(batch, len)` that is **True at padding** (PyTorch's
      `key_padding_mask` meaning). It is built once, in `data/batching.py` or by `make_key_padding_mask`.
    * The causal mask is a bool tensor `(tgt_len, tgt_len)` that is **True above the diagonal**: query i may
      not look at key j > i. It is built once, by `causal_mask`.
    * `torch.nn.functional.scaled_dot_product_attention` reads bool masks the other way round (True = may
      attend); in this package the conversion is `allowed_positions` below. (The speed paths of `transformer/fast/`
      turn the padding mask into an additive bias, 0 or -inf, once per batch.)
    * A query whose keys are all masked (for instance every position of an empty, fully padded source)
      attends to nothing: its attention weights are all zero and its output is zero, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def make_key_padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """Padding mask of a batch of token ids.

    Args:
        tokens: `(batch, len)` LongTensor of token ids.
        pad_id: id of the padding token.

    Returns:
        `(batch, len)` bool tensor, True at padding.
    """
    return tokens.eq(pad_id)


def causal_mask(q_len: int, k_len: Optional[int] = None, device: torch.device | str | None = None) -> Tensor:
    """The decoder's causal ("subsequent") mask (§3.2.3: prevent leftward information flow).

    Args:
        q_len: number of query positions (tgt_len).
        k_len: number of key positions; defaults to q_len. When k_len > q_len the queries are the last
            q_len positions (incremental decoding with k_len - q_len cached positions before them).
        device: where to build it.

    Returns:
        `(q_len, k_len)` bool tensor, True where key j lies in the future of query i (blocked): True above
        the diagonal when k_len == q_len.
    """
    k_len = q_len if k_len is None else k_len
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(k_len - q_len + 1)


def allowed_positions(key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]) -> Optional[Tensor]:
    """Combine the masks into one bool tensor that is True where attention is *allowed*.

    Args:
        key_padding_mask: `(batch, k_len)`, True at padding, or None.
        attn_mask: `(q_len, k_len)`, True where blocked (e.g. `causal_mask`), or None.

    Returns:
        None when nothing is masked, else a bool tensor broadcastable to `(batch, n_heads, q_len, k_len)`.
    """
    allowed = None
    if key_padding_mask is not None:
        allowed = ~key_padding_mask[:, None, None, :]  # (batch, 1, 1, k_len)
    if attn_mask is not None:
        not_blocked = ~attn_mask  # (q_len, k_len)
        allowed = not_blocked if allowed is None else allowed & not_blocked
    return allowed


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, allowed: Optional[Tensor] = None,
                                 dropout: Optional[Callable[[Tensor], Tensor]] = None) -> tuple[Tensor, Tensor]:
    """Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V, written out (§3.2.1, eq. 1).

    This is the explicit path that also returns the weights (for visualization and tests); the fused
    path in `MultiHeadAttention` computes the same output with `F.scaled_dot_product_attention`.

    Args:
        query: `(batch, n_heads, q_len, d_head)`.
        key: `(batch, n_heads, k_len, d_head)`.
        value: `(batch, n_heads, k_len, d_head)`.
        allowed: bool, broadcastable to `(batch, n_heads, q_len, k_len)`, True where attention is allowed.
        dropout: applied to the weights before they weigh the values (an `nn.Dropout`), or None.

    Returns:
        output `(batch, n_heads, q_len, d_head)` and weights `(batch, n_heads, q_len, k_len)`; each row of
        weights sums to 1, or is all zero when every key of that row is masked.
    """
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))  # (batch, n_heads, q_len, k_len)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.softmax(dim=-1)
    if allowed is not None:
        # A fully masked row is softmax(-inf, ..., -inf) = NaN; it attends to nothing instead.
        weights = weights.masked_fill(~allowed, 0.0)
    output = (dropout(weights) if dropout is not None else weights) @ value  # (batch, n_heads, q_len, d_head)
    return output, weights


@dataclass
class KVCache:
    """Keys and values of one attention layer kept across decoding steps (incremental decoding).

    Self-attention appends the new positions' keys and values at each step; encoder-decoder attention fills it
    once, at the first step, with the memory's keys and values, and reuses them.

    Attributes:
        key: `(batch, n_heads, cached_len, d_head)`, or None before the first step.
        value: `(batch, n_heads, cached_len, d_head)`, or None before the first step.
    """

    key: Optional[Tensor] = None
    value: Optional[Tensor] = None

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store new positions' keys and values `(batch, n_heads, new_len, d_head)` after the cached ones; returns
        every cached key and value, `(batch, n_heads, cached_len + new_len, d_head)` each."""
        if self.key is not None:
            key, value = torch.cat([self.key, key], dim=2), torch.cat([self.value, value], dim=2)
        self.key, self.value = key, value
        return key, value

    def select(self, index: Tensor) -> None:
        """Keep (and reorder, repeat) batch rows: row i becomes old row `index[i]` (index: `(new_batch,)`)."""
        if self.key is not None:
            self.key, self.value = self.key.index_select(0, index), self.value.index_select(0, index)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    Reference: Vaswani et al. 2017, §3.2.2. The h per-head projections are stored as one d_model x d_model
    matrix each for Q, K and V (the heads are column blocks), packed into `in_proj`: self-attention projects
    Q, K and V with one matrix multiplication, encoder-decoder attention K and V of the memory with one.

    Args:
        d_model: model width.
        n_heads: number of heads; d_model must be divisible by it.
        attention_dropout: dropout on the attention weights during training.

    Raises:
        ValueError: if d_model is not divisible by n_heads.
    """

    explicit_dropout: bool = False
    """A hook for training speed, off here: when True, training with attention dropout takes the explicit path
    and applies `self.dropout` to its weights, instead of the fused kernel's own dropout. `fast.dropout`'s
    `use_fast_cpu_dropout` turns it on together with a faster CPU dropout kernel in `self.dropout`."""

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.in_proj = nn.Linear(d_model, 3 * d_model)  # rows: [W^Q; W^K; W^V]
        self.out_proj = nn.Linear(d_model, d_model)  # W^O
        self.dropout = nn.Dropout(attention_dropout)  # on the attention weights (not in the paper)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform for each of W^Q, W^K, W^V, W^O (as a d_model x d_model matrix); zero biases."""
        for block in self.in_proj.weight.chunk(3, dim=0):
            nn.init.xavier_uniform_(block)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.in_proj.bias)
        nn.init.zeros_(self.out_proj.bias)

    def split_heads(self, x: Tensor) -> Tensor:
        """`(batch, len, d_model)` -> `(batch, n_heads, len, d_head)`: head i is the i-th block of d_head columns."""
        batch, length, _ = x.shape
        return x.view(batch, length, self.n_heads, self.d_head).transpose(1, 2)  # (batch, n_heads, len, d_head)

    def project_self(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's x W^Q, x W^K and x W^V (biases added) with one product by `in_proj`, split into heads:
        `(batch, n_heads, len, d_head)` each."""
        q, k, v = self.in_proj(x).chunk(3, dim=-1)  # each (batch, len, d_model)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)

    def project_query(self, x: Tensor) -> Tensor:
        """Encoder-decoder attention's queries x W^Q (bias added), split into heads: `(batch, n_heads, len, d_head)`."""
        d = self.d_model
        return self.split_heads(F.linear(x, self.in_proj.weight[:d], self.in_proj.bias[:d]))

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Encoder-decoder attention's keys memory W^K and values memory W^V (biases added) with one product, split
        into heads: `(batch, n_heads, src_len, d_head)` each."""
        d = self.d_model
        k, v = F.linear(memory, self.in_proj.weight[d:], self.in_proj.bias[d:]).chunk(2, dim=-1)
        return self.split_heads(k), self.split_heads(v)

    def forward(self, x: Tensor, memory: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None, is_causal: bool = False, cache: Optional[KVCache] = None,
                need_weights: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """Self-attention over `x` (memory None), or encoder-decoder attention from `x` to `memory`.

        Args:
            x: `(batch, q_len, d_model)`: the queries, and in self-attention the keys and values too.
            memory: `(batch, k_len, d_model)`, the encoder output: the keys and values of encoder-decoder
                attention; None for self-attention.
            key_padding_mask: `(batch, k_len)` bool, True at padded keys (all keys, cached ones included).
            attn_mask: `(q_len, k_len)` bool, True where blocked, e.g. `causal_mask(tgt_len)`.
            is_causal: shortcut for `attn_mask=causal_mask(q_len)` when q_len == k_len (no cache); lets the
                fused kernel skip building the mask. Ignored when `attn_mask` is given.
            cache: a `KVCache`; self-attention appends this call's keys/values to it, encoder-decoder attention
                fills it with the memory's at the first call and then reads them from it (ignoring `memory`).
            need_weights: if True, take the explicit path and also return the attention weights.

        Returns:
            output `(batch, q_len, d_model)` and, if need_weights, the weights
            `(batch, n_heads, q_len, k_len)` (else None).
        """
        if memory is None:  # self-attention: queries, keys and values from x
            q, k, v = self.project_self(x)
            if cache is not None:
                k, v = cache.append(k, v)  # (batch, n_heads, cached_len + q_len, d_head)
        else:  # encoder-decoder attention: queries from x, keys and values from the memory
            q = self.project_query(x)
            if cache is not None and cache.key is not None:
                k, v = cache.key, cache.value
            else:
                k, v = self.project_memory(memory)
                if cache is not None:
                    cache.key, cache.value = k, v
        dropout_p = self.dropout.p if self.training else 0.0
        explicit = need_weights or (self.explicit_dropout and dropout_p > 0.0)
        if is_causal and attn_mask is None and (explicit or key_padding_mask is not None):
            attn_mask = causal_mask(q.size(2), k.size(2), device=q.device)
        allowed = allowed_positions(key_padding_mask, attn_mask)
        if explicit:
            out, weights = scaled_dot_product_attention(q, k, v, allowed, self.dropout)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                                 is_causal=is_causal and allowed is None)
            weights = None
        batch, _, q_len, _ = out.shape
        out = out.transpose(1, 2).reshape(batch, q_len, self.d_model)  # (batch, q_len, d_model)
        return self.out_proj(out), weights if need_weights else None
