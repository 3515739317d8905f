"""`CPUDecoder`: a trained model's copy for decoding on the CPU, one step at a time, as fast as eager PyTorch allows.

It computes what `Transformer.decode_step` computes (the decoder layer of `model/layers.py` for one new position,
§3.1-3.4) with these differences, each for speed on the CPU:

* weights in the layouts of `layout.py` (column-major; the output projection through oneDNN), or int8;
* encoder-decoder attention with W^Q and [W^K; W^V] as layers of their own (int8 replaces whole layers, so it
  cannot slice the packed `in_proj` at call time), the memory projected once per sentence, and the beams of a
  sentence reading its memory row as extra query positions (`cache.py`);
* attention over the cache in three operations (`cached_attention`): one batched product with the 1/√d_k scale
  and the padding bias folded in, a softmax, a second batched product. One query against a few dozen cached
  keys is faster this way than through `F.scaled_dot_product_attention`, whose fixed cost per call dominates.

The same arithmetic as the readable path, up to the order of floating-point sums; tests check the logits at
every step, and greedy and beam search outputs, against `Transformer`.
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch
from torch import Tensor, nn

from ..config import OptionError
from ..model import Transformer
from ..model.attention import scaled_dot_product_attention
from ..model.layers import DecoderLayer, residual
from .cache import CPUDecoderCache, GrowingKVCache, MemoryKV, padding_bias
from .layout import PackedLinear, column_major_, has_float_linear, quantize_int8_


def split_linear(linear: nn.Linear, rows: slice) -> nn.Linear:
    """A new layer holding `rows` of `linear`'s weight and bias (copies)."""
    weight = linear.weight[rows]
    layer = nn.Linear(weight.size(1), weight.size(0)).to(weight)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(linear.bias[rows])
    return layer


class CPUDecoderLayer(nn.Module):
    """The parameters of one `DecoderLayer`, with encoder-decoder attention's W^Q and [W^K; W^V] split apart.

    Attributes:
        self_qkv, self_out: self-attention's packed [W^Q; W^K; W^V] and W^O.
        cross_q, cross_kv, cross_out: encoder-decoder attention's W^Q, [W^K; W^V] and W^O.
        norm1, norm2, norm3, feed_forward: the layer's own modules.
    """

    def __init__(self, layer: DecoderLayer) -> None:
        super().__init__()
        d_model = layer.self_attn.d_model
        self.n_heads, self.d_head, self.norm_first = (
            layer.self_attn.n_heads,
            layer.self_attn.d_head,
            layer.norm_first,
        )
        self.self_qkv, self.self_out = layer.self_attn.in_proj, layer.self_attn.out_proj
        self.cross_q = split_linear(layer.cross_attn.in_proj, slice(0, d_model))
        self.cross_kv = split_linear(layer.cross_attn.in_proj, slice(d_model, 3 * d_model))
        self.cross_out = layer.cross_attn.out_proj
        self.norm1, self.norm2, self.norm3 = layer.norm1, layer.norm2, layer.norm3
        self.feed_forward = layer.feed_forward

    def split_heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.n_heads, self.d_head).transpose(
            1, 2
        )  # (batch, n_heads, len, d_head)

    def forward(
        self,
        x: Tensor,
        self_cache: GrowingKVCache,
        cross: MemoryKV,
        bias: Optional[Tensor],
        memory_key_padding_mask: Optional[Tensor],
    ) -> Tensor:
        """One new position: `(rows, d_model)` -> `(rows, d_model)`; rows a multiple g of the memory rows.

        The rows stay two-dimensional (one position each), so that every linear layer is one matrix product with no
        reshaping around it."""
        rows, memory_rows, d_model = x.size(0), cross.key.size(0), x.size(1)
        h = self.norm1(x) if self.norm_first else x
        # q, k, v: (rows, n_heads, 1, d_head) views of the packed projection
        q, k, v = self.self_qkv(h).view(rows, 3, self.n_heads, 1, self.d_head).unbind(1)
        k, v = self_cache.append(k, v)  # (rows, n_heads, length, d_head)
        h = self.self_out(
            cached_attention(q, k, v, None).view(rows, d_model)
        )  # one position sees every key
        x = residual(x, h, self.norm1, self.norm_first)
        h = self.norm2(x) if self.norm_first else x
        group = (
            rows // memory_rows
        )  # the g rows of a sentence as g query positions of its memory row
        q = self.cross_q(h).view(memory_rows, group, self.n_heads, self.d_head).transpose(1, 2)
        if bias is not None or memory_key_padding_mask is None:
            h = cached_attention(q, cross.key, cross.value, bias)
        else:  # a row of padding only: the explicit path, which attends to nothing there
            out, _ = scaled_dot_product_attention(
                q, cross.key, cross.value, ~memory_key_padding_mask[:, None, None, :]
            )
            h = out.transpose(1, 2).reshape(memory_rows, group, d_model)
        h = self.cross_out(h.view(rows, d_model))
        x = residual(x, h, self.norm2, self.norm_first)
        h = self.feed_forward(self.norm3(x) if self.norm_first else x)
        return residual(x, h, self.norm3, self.norm_first)


def cached_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor]) -> Tensor:
    """Attention(Q, K, V) = softmax(Q Kᵀ / √d_k + bias) V in three operations, heads concatenated (before W^O).

    The same arithmetic as `model.attention.scaled_dot_product_attention` (a masked key gets weight
    exp(-inf) = 0 either way).

    Args:
        q: `(batch, n_heads, q_len, d_head)`; k, v: `(batch, n_heads, k_len, d_head)`.
        bias: `(batch, n_heads, 1, k_len)` additive mask (0 or -inf), or None: every key allowed.

    Returns:
        `(batch, q_len, n_heads * d_head)`.
    """
    batch, n_heads, q_len, d_head = q.shape
    k_len = k.size(2)
    q, v = q.reshape(batch * n_heads, q_len, d_head), v.reshape(batch * n_heads, k_len, d_head)
    k_t = k.reshape(batch * n_heads, k_len, d_head).transpose(
        1, 2
    )  # (batch * n_heads, d_head, k_len)
    scale = 1.0 / math.sqrt(d_head)
    if bias is None:
        scores = torch.bmm(q, k_t).mul_(scale)  # (batch * n_heads, q_len, k_len)
    else:
        scores = torch.baddbmm(bias.reshape(batch * n_heads, 1, k_len), q, k_t, alpha=scale)
    out = torch.bmm(scores.softmax(dim=-1), v)  # (batch * n_heads, q_len, d_head)
    return (
        out.view(batch, n_heads, q_len, d_head)
        .transpose(1, 2)
        .reshape(batch, q_len, n_heads * d_head)
    )


class CPUDecoder(nn.Module):
    """A trained Transformer made ready for decoding on the CPU (module docstring); a `decoding.IncrementalDecoder`.

    Inference only: it holds copies of the weights, cannot be trained, and is not saved as a checkpoint.

    Args:
        model: a trained Transformer on the CPU; it is not modified.
        quantization: None (float32) or "int8".

    Raises:
        ValueError: the model is not on the CPU.
        OptionError: an unknown quantization, or int8 without a quantized CPU engine in this PyTorch build.
    """

    def __init__(self, model: Transformer, quantization: Optional[str] = None) -> None:
        super().__init__()
        device = next(model.parameters()).device
        if device.type != "cpu":
            raise ValueError(f"CPUDecoder: the model is on {device}, not on the CPU")
        if quantization not in (None, "int8"):
            raise OptionError("{quantization}: expected None or 'int8'", quantization=quantization)
        trained = copy.deepcopy(model).eval()  # shared and tied modules stay shared in the copy
        self.config = model.config
        self.encoder = trained.encoder
        self.embedding, self.positional_encoding = (
            trained.decoder.embedding,
            trained.decoder.positional_encoding,
        )
        self.layers = nn.ModuleList(CPUDecoderLayer(layer) for layer in trained.decoder.layers)
        self.final_norm = trained.decoder.final_norm
        self.output_projection = trained.output_projection
        self.quantization = quantization
        if quantization == "int8":
            quantize_int8_(self)
        else:
            # a copy: a tied embedding keeps its own row-major weight
            if PackedLinear.is_available():
                self.output_projection = PackedLinear(self.output_projection)
            column_major_(self)
        self.eval()

    @property
    def is_float(self) -> bool:
        """False once int8-quantized."""
        return has_float_linear(self)

    def encode(self, src: Tensor, src_key_padding_mask: Tensor) -> Tensor:
        """The encoder (`Transformer.encode`): memory `(batch, src_len, d_model)`."""
        return self.encoder(src, src_key_padding_mask)

    def new_cache(
        self, memory: Tensor, memory_key_padding_mask: Optional[Tensor] = None, beam_size: int = 1
    ) -> CPUDecoderCache:
        """Project the memory into every layer's keys and values, once per sentence.

        Args:
            memory: `(batch, src_len, d_model)`; memory_key_padding_mask: `(batch, src_len)` bool or None.
            beam_size: decoder rows per sentence (they share the memory row).
        """
        cross = []
        for layer in self.layers:
            k, v = layer.cross_kv(memory).chunk(2, dim=-1)  # (batch, src_len, d_model) each
            cross.append(
                MemoryKV(layer.split_heads(k).contiguous(), layer.split_heads(v).contiguous())
            )
        bias = None
        if memory_key_padding_mask is not None:
            bias = padding_bias(memory_key_padding_mask, self.config.n_heads, memory.dtype)
        return CPUDecoderCache(
            [GrowingKVCache() for _ in self.layers], cross, memory_key_padding_mask, bias
        )

    def decode_step(self, tokens: Tensor, cache: CPUDecoderCache) -> Tensor:
        """As `Transformer.decode_step`: tokens `(rows,)` -> logits `(rows, tgt_vocab_size)`.

        Raises:
            ValueError: the decoded length would exceed max_positions.
        """
        x = self.embedding(tokens) + self.positional_encoding(1, cache.length)  # (rows, d_model)
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                cache.self_attention[i],
                cache.cross_attention[i],
                cache.padding_bias,
                cache.memory_key_padding_mask,
            )
        cache.length += 1
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.output_projection(x)
