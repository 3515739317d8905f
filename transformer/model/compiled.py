"""The decoder's incremental step compiled by `torch.compile`, for faster decoding (`--compile`).

The eager decoder (`Transformer.decode` with a `DecoderCache`) is the readable reference: modules, a cache that
grows, about 40 PyTorch operators per layer and step, each dispatched from Python. `CompiledDecoding` runs the
same arithmetic as one function per step on key/value buffers of fixed capacity, which TorchInductor compiles
into C++: the small operators between the matrix products (bias, softmax, residual and LayerNorm) are fused into
a few loops, the weights are frozen into the compiled code in the layout its kernels prefer (`freezing`), and the
step is called from C++ rather than Python (`cpp_wrapper`).

How the fixed buffers stand in for a growing cache: self-attention writes the new position's key and value at
index `position` of a `(rows, n_heads, capacity, d_head)` buffer and attends over the whole capacity with -inf
added at the positions not yet decoded (exp(-inf) = 0: the same weights as over the filled positions only).
The buffers double when full, and `select` reorders rows as beam search and finished sentences need.
Encoder-decoder attention reads keys and values projected from the memory once (eagerly), with the padding as
an additive bias; g consecutive rows share a memory row (the beams of one sentence, as in `MultiHeadAttention`).

Compiled once per process for greedy search and once for beam search (about 20-40 s each on 2 CPU cores; Inductor
caches its output on disk, so a later process compiles faster); the sizes that change between calls (rows,
capacity, source length) are marked dynamic, so no size compiles again. PyTorch would still compile a batch of one
row apart (it specializes sizes 0 and 1), so a single memory row is held twice in the buffers
(`StaticDecoderCache.mirrored`) and greedy's one row per sentence and beam search's several get separate compiled
functions. It needs a C++ compiler, as Inductor does on the CPU; tested on the CPU only. Speed: README,
"Decoding speed". Outputs: the same arithmetic in another order, so logits agree to float rounding and the
tokens are the eager decoder's (tests compare both).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import _residual
from .transformer import Transformer


def _mark_dynamic(*tensors: Tensor) -> None:
    """Tell torch.compile which sizes change between calls — rows (dim 0) and capacity or source length (the last
    dim but one of a buffer, the last of the padding bias; tokens have rows only) — so that it compiles one step for
    all of them instead of one per size. Marked where the tensors are made (about 10 us a tensor)."""
    for tensor in tensors:  # tokens (rows,); bias (rows, src_len); buffers (rows, n_heads, capacity | src_len, d_head)
        torch._dynamo.mark_dynamic(tensor, {1: [0], 2: [0, 1], 4: [0, 2]}[tensor.dim()])


class StaticDecoderCache:
    """Key/value buffers for `CompiledDecoding.decode`; made by its `new_cache`, filled at the first step.

    Attributes:
        self_keys, self_values: per decoder layer, `(rows, n_heads, capacity, d_head)`; positions < `length` hold
            the decoded prefix.
        cross_keys, cross_values: per decoder layer, `(memory_rows, n_heads, src_len, d_head)`, the memory's
            keys and values.
        cross_bias: `(memory_rows, src_len)`: 0 at source tokens, -inf at padding.
        length: positions decoded so far (the next position's index).
    """

    def __init__(self) -> None:
        self.self_keys: list[Tensor] = []
        self.self_values: list[Tensor] = []
        self.cross_keys: list[Tensor] = []
        self.cross_values: list[Tensor] = []
        self.cross_bias: Optional[Tensor] = None
        self.length = 0
        self.memory_rows = 0
        # With a single memory row (one sentence, or one left) every buffer holds two identical copies of its
        # rows: the step is compiled once for batches of two rows or more, and a batch of one would compile again.
        self.mirrored = False

    def select(self, index: Tensor, cross_index: Optional[Tensor] = None) -> None:
        """Keep, reorder or repeat rows, as `DecoderCache.select`: self-attention row i becomes old row
        `index[i]`, and the memory's rows follow `cross_index` (None: unchanged)."""
        if cross_index is not None:
            self.memory_rows = cross_index.numel()
        self.mirrored = self.memory_rows == 1
        if self.mirrored:  # the old rows are the first ones of a mirrored buffer too
            index = index.repeat(2)
            cross_index = None if cross_index is None else cross_index.repeat(2)
        self.self_keys = [k.index_select(0, index) for k in self.self_keys]
        self.self_values = [v.index_select(0, index) for v in self.self_values]
        if cross_index is not None and self.cross_bias is not None:
            self.cross_keys = [k.index_select(0, cross_index) for k in self.cross_keys]
            self.cross_values = [v.index_select(0, cross_index) for v in self.cross_values]
            self.cross_bias = self.cross_bias.index_select(0, cross_index)
        self._mark()

    def _mark(self) -> None:
        if self.cross_bias is None:  # not filled yet
            return
        _mark_dynamic(*self.self_keys, *self.self_values, *self.cross_keys, *self.cross_values, self.cross_bias)

    def _grow(self, capacity: int) -> None:
        def grown(buffer: Tensor) -> Tensor:
            new = buffer.new_zeros(*buffer.shape[:2], capacity, buffer.size(3))
            new[:, :, :buffer.size(2)] = buffer
            return new
        self.self_keys = [grown(k) for k in self.self_keys]
        self.self_values = [grown(v) for v in self.self_values]
        self._mark()


class _DecoderStep(nn.Module):
    """One decoding position through every decoder layer and the output projection, on `StaticDecoderCache`
    buffers (written in place). The function `torch.compile` compiles; its arithmetic is `Decoder.forward`'s
    (§3.1-3.4) for one new position."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.decoder = model.decoder
        projection = model.output_projection
        # The float32 CPU copy (`for_cpu_decoding`) runs the output projection through oneDNN on a reordered
        # weight; the compiled step takes the plain weight and lets Inductor choose the layout.
        weight = getattr(projection, "weight", None)
        if weight is None:
            weight = projection.original_weight
        # Parameters (sharing the model's storage), so that `freezing` folds them into the compiled code
        self.output_weight = nn.Parameter(weight.detach(), requires_grad=False)
        bias = projection.bias
        self.output_bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.n_heads = model.config.n_heads
        self.norm_first = model.config.norm_first

    def forward(self, tokens: Tensor, position: Tensor, self_keys: list[Tensor], self_values: list[Tensor],
                cross_keys: list[Tensor], cross_values: list[Tensor], cross_bias: Tensor) -> Tensor:
        """The step with one row per memory row (greedy search).

        Args:
            tokens: `(rows,)` the previous output token of each row.
            position: 0-dim LongTensor, the index of the new position.
            self_keys, self_values, cross_keys, cross_values, cross_bias: as in `StaticDecoderCache`.

        Returns:
            logits `(rows, tgt_vocab_size)`.
        """
        return self._step(tokens, position, self_keys, self_values, cross_keys, cross_values, cross_bias, 1)

    def _step(self, tokens: Tensor, position: Tensor, self_keys: list[Tensor], self_values: list[Tensor],
              cross_keys: list[Tensor], cross_values: list[Tensor], cross_bias: Tensor, group: int) -> Tensor:
        rows, memory_rows = tokens.size(0), cross_bias.size(0)
        if group != 1:  # a multiple, known only to the tensors (beam search's rows per sentence)
            group = rows // memory_rows
        capacity = self_keys[0].size(2)
        d_model, n_heads = self.output_weight.size(1), self.n_heads
        d_head = d_model // n_heads
        scale = 1.0 / math.sqrt(d_head)
        table = self.decoder.positional_encoding.table
        x = self.decoder.embedding(tokens) + table.index_select(0, position.view(1))  # (rows, d_model)
        ahead = torch.arange(capacity, device=tokens.device) > position
        self_bias = torch.zeros(capacity, dtype=x.dtype, device=x.device).masked_fill(ahead, float("-inf"))
        for i, layer in enumerate(self.decoder.layers):
            h = layer.norm1(x) if self.norm_first else x
            q, k, v = layer.self_attn.in_proj(h).view(rows, 3, n_heads, 1, d_head).unbind(1)
            self_keys[i].index_copy_(2, position.view(1), k)
            self_values[i].index_copy_(2, position.view(1), v)
            scores = q @ self_keys[i].transpose(-1, -2) * scale + self_bias  # (rows, n_heads, 1, capacity)
            h = (scores.softmax(-1) @ self_values[i]).view(rows, d_model)
            x = _residual(x, layer.self_attn.out_proj(h), layer.norm1, self.norm_first)
            h = layer.norm2(x) if self.norm_first else x
            q = layer.cross_attn._project_q(h).view(memory_rows, group, n_heads, d_head).transpose(1, 2)
            # (memory_rows, n_heads, group, src_len)
            scores = q @ cross_keys[i].transpose(-1, -2) * scale + cross_bias[:, None, None, :]
            h = (scores.softmax(-1) @ cross_values[i]).transpose(1, 2).reshape(rows, d_model)
            x = _residual(x, layer.cross_attn.out_proj(h), layer.norm2, self.norm_first)
            h = layer.feed_forward(layer.norm3(x) if self.norm_first else x)
            x = _residual(x, h, layer.norm3, self.norm_first)
        if self.decoder.final_norm is not None:
            x = self.decoder.final_norm(x)
        return F.linear(x, self.output_weight, self.output_bias)


class _GroupedDecoderStep(_DecoderStep):
    """The step with g >= 2 consecutive rows per memory row (beam search's beams). A class of its own so that
    torch.compile keeps its compiled code apart from greedy's (it caches per function), each for any size."""

    def forward(self, tokens: Tensor, position: Tensor, self_keys: list[Tensor], self_values: list[Tensor],
                cross_keys: list[Tensor], cross_values: list[Tensor], cross_bias: Tensor) -> Tensor:
        """As `_DecoderStep.forward`, with rows a multiple (>= 2) of the memory rows."""
        return self._step(tokens, position, self_keys, self_values, cross_keys, cross_values, cross_bias, 2)


class CompiledDecoding:
    """A trained model whose incremental decoding step runs compiled; the searches take it in place of the model.

    `encode` and `config` are the model's; `decode` with a cache from `new_cache` runs the compiled step (one new
    position per call, as greedy and beam search decode); without one it is the model's own `decode`.

    Args:
        model: a Transformer in eval mode (the CPU decoding copy, or the model on a GPU), not trained further.

    Raises:
        ValueError: the model is in training mode, or is int8-quantized (its layers are not compilable).
    """

    INITIAL_CAPACITY = 32  # decoded positions before the self-attention buffers first double

    def __init__(self, model: Transformer) -> None:
        if model.training:
            raise ValueError("CompiledDecoding: put the model in eval mode first")
        if not any(type(m) is nn.Linear for m in model.decoder.modules()):
            raise ValueError("--compile works on float32 (or float16/bfloat16) models, not with --quantization int8")
        import torch._inductor.config  # here, not at the top: it takes seconds, which every CLI start would pay

        self._inductor_config = torch._inductor.config
        self.model = model
        self.config = model.config
        self._steps = [torch.compile(step(model).eval()) for step in (_DecoderStep, _GroupedDecoderStep)]

    def encode(self, src: Tensor, src_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """The model's `encode`: memory `(batch, src_len, d_model)`."""
        return self.model.encode(src, src_key_padding_mask)

    def new_cache(self) -> StaticDecoderCache:
        """An empty `StaticDecoderCache`."""
        return StaticDecoderCache()

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_key_padding_mask: Optional[Tensor] = None,
               tgt_key_padding_mask: Optional[Tensor] = None, cache=None) -> Tensor:
        """As `Transformer.decode`; with a `StaticDecoderCache`, one new position per call, compiled.

        Args:
            tgt_in: `(rows, 1)` the previous tokens (with a cache); memory: `(memory_rows, src_len, d_model)` with
                rows a multiple of memory_rows; memory_key_padding_mask: `(memory_rows, src_len)` bool or None.

        Returns:
            logits `(rows, 1, tgt_vocab_size)`.

        Raises:
            ValueError: several new positions or a target padding mask with a `StaticDecoderCache`; a decoded
                length beyond max_positions.
        """
        if not isinstance(cache, StaticDecoderCache):
            return self.model.decode(tgt_in, memory, memory_key_padding_mask, tgt_key_padding_mask, cache)
        if tgt_in.size(1) != 1 or tgt_key_padding_mask is not None:
            raise ValueError("the compiled decoder takes one new position per call, without a target padding mask")
        self.model.decoder.positional_encoding(1, cache.length)  # raises beyond max_positions
        if cache.cross_bias is None:
            self._fill(cache, tgt_in.size(0), memory, memory_key_padding_mask)
        elif cache.length == cache.self_keys[0].size(2):
            cache._grow(2 * cache.length)
        position = torch.tensor(cache.length, device=tgt_in.device)
        rows = tgt_in.size(0)
        tokens = tgt_in.reshape(rows).contiguous()  # one stride whatever the prefix's length
        if cache.mirrored:
            tokens = tokens.repeat(2)
        _mark_dynamic(tokens)
        inputs = (tokens, position, cache.self_keys, cache.self_values, cache.cross_keys, cache.cross_values,
                  cache.cross_bias)
        with self._inductor_config.patch(freezing=True, cpp_wrapper=True):  # read when it compiles (lazily)
            logits = self._steps[tokens.size(0) > cache.cross_bias.size(0)](*inputs)
        cache.length += 1
        return logits[:rows, None]

    def _fill(self, cache: StaticDecoderCache, rows: int, memory: Tensor, mask: Optional[Tensor]) -> None:
        """Project the memory into each layer's keys and values; allocate the self-attention buffers."""
        memory_rows, src_len, d_model = memory.shape
        cache.memory_rows, cache.mirrored = memory_rows, memory_rows == 1
        if cache.mirrored:
            memory, rows, memory_rows = memory.expand(2, -1, -1), 2 * rows, 2
            mask = None if mask is None else mask.expand(2, -1)
        n_heads = self.config.n_heads
        d_head = d_model // n_heads
        if mask is None:
            mask = torch.zeros(memory_rows, src_len, dtype=torch.bool, device=memory.device)
        bias = torch.zeros(mask.shape, dtype=memory.dtype, device=memory.device).masked_fill(mask, float("-inf"))
        empty = mask.all(dim=1)  # a row of padding only attends to nothing in the eager decoder: zero output
        bias[empty] = 0.0
        cache.cross_bias = bias
        for layer in self.model.decoder.layers:
            k, v = layer.cross_attn._project_kv(memory)  # (memory_rows, src_len, d_model) each
            k, v = (t.view(memory_rows, src_len, n_heads, d_head).transpose(1, 2).contiguous() for t in (k, v))
            v[empty] = 0.0
            cache.cross_keys.append(k)
            cache.cross_values.append(v)
            shape = (rows, n_heads, self.INITIAL_CAPACITY, d_head)
            cache.self_keys.append(memory.new_zeros(shape))
            cache.self_values.append(memory.new_zeros(shape))
        cache._mark()
