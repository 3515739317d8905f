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
      attend); the only conversion is `_allowed_positions` below.
    * A query whose keys are all masked (for instance every position of an empty, fully padded source)
      attends to nothing: its attention weights are all zero and its output is zero, never NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dropout import dropout


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


def _allowed_positions(key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]) -> Optional[Tensor]:
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
                                 dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V, written out (§3.2.1, eq. 1).

    This is the explicit path that also returns the weights (for visualization and tests); the fused
    path in `MultiHeadAttention` computes the same output with `F.scaled_dot_product_attention`.

    Args:
        query: `(batch, n_heads, q_len, d_head)`.
        key: `(batch, n_heads, k_len, d_head)`.
        value: `(batch, n_heads, k_len, d_head)`.
        allowed: bool, broadcastable to `(batch, n_heads, q_len, k_len)`, True where attention is allowed.
        dropout_p: dropout probability on the weights (0 in eval mode).

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
    output = dropout(weights, dropout_p) @ value  # (batch, n_heads, q_len, d_head)
    return output, weights


@dataclass
class KVCache:
    """Keys and values of one attention layer kept across decoding steps.

    Self-attention appends the new position's key and value at each step (`append`) into a preallocated buffer
    `(2, batch, n_heads, capacity, d_head)` that grows geometrically, instead of concatenating a new tensor per
    step; beam search reorders rows (`select`) into a second buffer of the same size, copying only the filled
    positions. Encoder-decoder attention (`is_static=True`) projects the memory once and reuses it.

    Attributes:
        key: `(batch, n_heads, cached_len, d_head)` (a view of the buffer) or None before the first step.
        value: `(batch, n_heads, cached_len, d_head)` or None before the first step.
        is_static: True for encoder-decoder attention.
        padding_bias: static caches only: the memory's key padding mask as an additive bias, 0 at real keys and
            -inf at padding, `(batch, n_heads, 1, k_len)` (repeated over heads, so that rows fold into
            `batch * n_heads` without a copy); set when the cache is filled in eval mode, and None when there is
            no mask or some row is all padding (that row must attend to nothing, which a bias cannot express).
    """

    key: Optional[Tensor] = None
    value: Optional[Tensor] = None
    is_static: bool = False
    padding_bias: Optional[Tensor] = None
    _buffer: Optional[Tensor] = field(default=None, repr=False)  # [key, value] (2, rows, n_heads, capacity, d_head)
    _spare: Optional[Tensor] = field(default=None, repr=False)  # the same shape: where `select` writes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store the keys and values of new positions after the cached ones.

        Args:
            key, value: `(batch, n_heads, new_len, d_head)`.

        Returns:
            every cached key and value, `(batch, n_heads, cached_len + new_len, d_head)` each.
        """
        batch, n_heads, new_len, d_head = key.shape
        length = 0 if self.key is None else self.key.size(2)
        end = length + new_len
        if self._buffer is None or end > self._buffer.size(3) or batch != self._buffer.size(1):
            capacity = max(end, 16, 2 * self._buffer.size(3) if self._buffer is not None else 0)
            buffer = key.new_empty(2, batch, n_heads, capacity, d_head)
            if length:
                buffer[0, :, :, :length], buffer[1, :, :, :length] = self.key, self.value
            self._buffer, self._spare = buffer, None
        self._buffer[0, :, :, length:end], self._buffer[1, :, :, length:end] = key, value
        self.key, self.value = self._buffer[0, :, :, :end], self._buffer[1, :, :, :end]
        return self.key, self.value

    def set_padding_bias(self, key_padding_mask: Tensor, n_heads: int, dtype: torch.dtype) -> None:
        """Store the memory's padding mask as `padding_bias` (static caches, when they are filled); left None when
        some row is all padding.

        Args:
            key_padding_mask: `(batch, k_len)` bool, True at padding.
            n_heads: heads to repeat the bias over; dtype: the attention scores' dtype.
        """
        if key_padding_mask.all(dim=1).any():
            return
        bias = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
        bias.masked_fill_(key_padding_mask, float("-inf"))
        self.padding_bias = bias[:, None, None, :].expand(-1, n_heads, 1, -1).contiguous()  # (batch, n_heads, 1, k_len)

    def select(self, index: Tensor) -> None:
        """Keep (and reorder, repeat) batch rows: row i becomes old row `index[i]`.

        Args:
            index: `(new_batch,)` LongTensor of row indices.
        """
        if self.key is None:
            return
        if self.is_static or self._buffer is None or self.key.requires_grad:  # (out= does not record gradients)
            self.key, self.value = self.key.index_select(0, index), self.value.index_select(0, index)
            if self.padding_bias is not None:
                self.padding_bias = self.padding_bias.index_select(0, index)
            self._buffer = self._spare = None
            return
        length = self.key.size(2)
        if self._spare is None or self._spare.size(1) != index.numel():
            self._spare = self._buffer.new_empty(2, index.numel(), *self._buffer.shape[2:])
        torch.index_select(self.key, 0, index, out=self._spare[0, :, :, :length])
        torch.index_select(self.value, 0, index, out=self._spare[1, :, :, :length])
        self._buffer, self._spare = self._spare, self._buffer
        self.key, self.value = self._buffer[0, :, :, :length], self._buffer[1, :, :, :length]


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    Reference: Vaswani et al. 2017, §3.2.2. The h per-head projections are stored as one d_model x d_model
    matrix each for Q, K and V (the heads are column blocks), packed into `in_proj` so that self-attention
    projects Q, K and V with one matrix multiplication.

    Args:
        d_model: model width.
        n_heads: number of heads; d_model must be divisible by it.
        attention_dropout: dropout on the attention weights during training.

    Raises:
        ValueError: if d_model is not divisible by n_heads.
    """

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.attention_dropout = attention_dropout
        self.in_proj = nn.Linear(d_model, 3 * d_model)  # rows: [W^Q; W^K; W^V]
        self.out_proj = nn.Linear(d_model, d_model)  # W^O
        # Separate W^Q and [W^K; W^V] layers, made only by `split_projections` for inference (e.g. before int8
        # quantization, which replaces whole nn.Linear modules and so cannot slice `in_proj` at call time).
        self.q_proj: Optional[nn.Linear] = None
        self.kv_proj: Optional[nn.Linear] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform for each of W^Q, W^K, W^V, W^O (as a d_model x d_model matrix); zero biases."""
        for block in self.in_proj.weight.chunk(3, dim=0):
            nn.init.xavier_uniform_(block)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.in_proj.bias)
        nn.init.zeros_(self.out_proj.bias)

    @torch.no_grad()
    def split_projections(self) -> None:
        """Copy W^Q and [W^K; W^V] out of `in_proj` into layers of their own, `q_proj` and `kv_proj`, which
        encoder-decoder attention then uses (self-attention keeps the packed `in_proj`). For inference only: the
        copies are not tied to `in_proj`, so training would update one and not the other."""
        d = self.d_model
        self.q_proj, self.kv_proj = nn.Linear(d, d), nn.Linear(d, 2 * d)
        for layer, rows in ((self.q_proj, slice(0, d)), (self.kv_proj, slice(d, 3 * d))):
            layer.to(self.in_proj.weight)
            layer.weight.copy_(self.in_proj.weight[rows])
            layer.bias.copy_(self.in_proj.bias[rows])

    def _project_q(self, x: Tensor) -> Tensor:
        """x W^Q + b^Q: `(batch, len, d_model)` -> `(batch, len, d_model)`."""
        if self.q_proj is not None:
            return self.q_proj(x)
        return F.linear(x, self.in_proj.weight[:self.d_model], self.in_proj.bias[:self.d_model])

    def _project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x W^K + b^K and x W^V + b^V with one matmul: `(batch, len, d_model)` each."""
        if self.kv_proj is not None:
            return self.kv_proj(x).chunk(2, dim=-1)
        d = self.d_model
        return F.linear(x, self.in_proj.weight[d:], self.in_proj.bias[d:]).chunk(2, dim=-1)

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.n_heads, self.d_head).transpose(1, 2)  # (batch, n_heads, len, d_head)

    def _project(self, query: Tensor, key: Tensor, value: Tensor, cache: Optional[KVCache]) -> tuple[Tensor, ...]:
        """Project to per-head queries, keys and values, using and updating the cache."""
        if cache is not None and cache.is_static and cache.key is not None:
            return self._split_heads(self._project_q(query)), cache.key, cache.value
        if query is key and key is value:  # self-attention: one matmul for Q, K and V
            q, k, v = self.in_proj(query).chunk(3, dim=-1)  # each (batch, q_len, d_model)
        else:
            q = self._project_q(query)
            if key is value:  # encoder-decoder attention: one matmul for K and V
                k, v = self._project_kv(key)
            else:  # distinct keys and values (not used by the model): each through [W^K; W^V], half kept
                k, v = self._project_kv(key)[0], self._project_kv(value)[1]
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        if cache is not None:
            if cache.is_static:  # stored contiguous: read at every step, and head-split views of it are not
                k, v = k.contiguous(), v.contiguous()
                cache.key, cache.value = k, v
            else:
                k, v = cache.append(k, v)  # (batch, n_heads, cached_len + k_len, d_head)
        return q, k, v

    def _cached_attention(self, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor]) -> Tensor:
        """Attention(Q, K, V) for incremental decoding, in as few operations as possible: three (one batched
        matrix product with the scale and the padding bias folded in, a softmax, a second batched product).

        The same arithmetic as `scaled_dot_product_attention` (a masked key gets weight exp(-inf) = 0 either way).

        Args:
            q: `(batch, n_heads, q_len, d_head)`; k, v: `(batch, n_heads, k_len, d_head)` (views of the cache).
            bias: `(batch, n_heads, 1, k_len)` additive mask (`KVCache.padding_bias`), or None: every key allowed.

        Returns:
            `(batch, q_len, d_model)`, the heads concatenated (before W^O).
        """
        batch, n_heads, q_len, d_head = q.shape
        k_len = k.size(2)
        q, v = q.reshape(batch * n_heads, q_len, d_head), v.reshape(batch * n_heads, k_len, d_head)
        k_t = k.reshape(batch * n_heads, k_len, d_head).transpose(1, 2)  # (batch * n_heads, d_head, k_len)
        scale = 1.0 / math.sqrt(d_head)
        if bias is None:
            scores = torch.bmm(q, k_t).mul_(scale)  # (batch * n_heads, q_len, k_len)
        else:
            scores = torch.baddbmm(bias.reshape(batch * n_heads, 1, k_len), q, k_t, alpha=scale)
        out = torch.bmm(scores.softmax(dim=-1), v)  # (batch * n_heads, q_len, d_head)
        return out.view(batch, n_heads, q_len, d_head).transpose(1, 2).reshape(batch, q_len, self.d_model)

    def _grouped(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
                 attn_mask: Optional[Tensor], is_causal: bool, cache: Optional[KVCache],
                 need_weights: bool) -> tuple[Tensor, Optional[Tensor]]:
        """Encoder-decoder attention for `group` consecutive query rows per key row (the beams of one sentence in
        beam search): the group's positions become extra query positions of their shared key row, so the memory
        is stored, projected and read once per sentence instead of once per beam."""
        batch, group = key.size(0), query.size(0) // key.size(0)
        if query.size(0) != batch * group or attn_mask is not None or is_causal or need_weights or (
                cache is not None and not cache.is_static):
            raise ValueError(f"query batch {query.size(0)} against key batch {batch}: only encoder-decoder attention "
                             "without weights may share keys between a whole number of query rows")
        q_len = query.size(1)
        out, _ = self.forward(query.reshape(batch, group * q_len, self.d_model), key, value, key_padding_mask,
                              cache=cache)  # (batch, group * q_len, d_model)
        return out.reshape(batch * group, q_len, self.d_model), None

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None, is_causal: bool = False, cache: Optional[KVCache] = None,
                need_weights: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """Attend from `query` to `key`/`value`.

        Args:
            query: `(batch, q_len, d_model)`.
            key: `(batch, k_len, d_model)`; pass the same tensor as `query` for self-attention and the
                same tensor as `value` for encoder-decoder attention (both save projections).
            value: `(batch, k_len, d_model)`.
            key_padding_mask: `(batch, k_len)` bool, True at padded keys (all keys, cached ones included).
            attn_mask: `(q_len, k_len)` bool, True where blocked, e.g. `causal_mask(tgt_len)`.
            is_causal: shortcut for `attn_mask=causal_mask(q_len)` when q_len == k_len (no cache); lets the
                fused kernel skip building the mask. Ignored when `attn_mask` is given.
            cache: a `KVCache`; self-attention appends this call's keys/values to it, static
                (encoder-decoder) attention fills it once and then ignores `key` and `value`.
            need_weights: if True, take the explicit path and also return the attention weights.

        The query batch may be a whole multiple g of the key batch (encoder-decoder attention in beam search):
        query rows i*g .. i*g + g-1 then attend to key row i.

        Returns:
            output `(batch, q_len, d_model)` and, if need_weights, the weights
            `(batch, n_heads, q_len, k_len)` (else None).
        """
        group = query.size(0) // key.size(0)
        if group > 1:
            return self._grouped(query, key, value, key_padding_mask, attn_mask, is_causal, cache, need_weights)
        filling_static = cache is not None and cache.is_static and cache.key is None
        q, k, v = self._project(query, key, value, cache)
        if cache is not None and not self.training and not need_weights:
            if filling_static and key_padding_mask is not None:
                cache.set_padding_bias(key_padding_mask, self.n_heads, q.dtype)
            if cache.is_static:
                bias = cache.padding_bias
                fast = bias is not None or key_padding_mask is None
            else:  # one new position sees every cached key: no mask at all
                bias, fast = None, q.size(2) == 1 and key_padding_mask is None and attn_mask is None
            if fast:
                return self.out_proj(self._cached_attention(q, k, v, bias)), None
        dropout_p = self.attention_dropout if self.training else 0.0
        # Incremental decoding that `_cached_attention` does not cover (several new positions, a target padding
        # mask, a source row that is all padding) takes the explicit path: there the fused kernel's per-row overhead
        # dominates (320 rows x 4 heads, 1 query, 20 keys: 0.47 against 1.07 ms on 2 CPU threads).
        # Training on CPU with attention dropout takes it too: F.scaled_dot_product_attention's CPU dropout draws
        # its mask with bernoulli_, several times slower than `dropout` (model/dropout.py).
        explicit = (need_weights or (cache is not None and not self.training)
                    or (dropout_p > 0.0 and q.device.type == "cpu"))
        if is_causal and attn_mask is None and (explicit or key_padding_mask is not None):
            attn_mask = causal_mask(q.size(2), device=q.device)
        allowed = _allowed_positions(key_padding_mask, attn_mask)
        if explicit:
            out, weights = scaled_dot_product_attention(q, k, v, allowed, dropout_p)
            weights = weights if need_weights else None
        else:
            use_causal = is_causal and allowed is None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                                 is_causal=use_causal)
            weights = None
        batch, _, q_len, _ = out.shape
        out = out.transpose(1, 2).reshape(batch, q_len, self.d_model)  # (batch, q_len, d_model)
        return self.out_proj(out), weights
