"""The decoder's incremental step compiled by `torch.compile`, for faster decoding (`--compile`).

The eager decoder (`Transformer.decode` with a `DecoderCache`) is the readable reference: modules, a cache that
grows, about 40 PyTorch operators per layer and step, each dispatched from Python. `CompiledDecoding` runs the
same arithmetic as one function per step on key/value buffers of fixed capacity, which TorchInductor compiles
into C++: the small operators between the matrix products (bias, softmax, residual and LayerNorm) are fused into
a few loops, the weights are frozen into the compiled code in the layout its kernels prefer (`freezing`), and the
step is called from C++ rather than Python (`cpp_wrapper`).

How the buffers stand in for a growing cache: every layer's self-attention keys and values live in one
`(capacity, 2 * n_layers, rows, n_heads, d_head)` tensor, positions first, so that the decoded prefix
`[:length]` is a contiguous tensor the step takes as input and reads whole — the decoded positions only, not the
capacity. The step is a pure function: it returns the new position's keys and values, which the caller stores
at index `length` (written inside the compiled code, a slice of the buffer was copied whole at every step). The
buffer doubles when full, and `select` reorders rows (copying the decoded positions only) as beam search and
finished sentences need. Encoder-decoder attention reads keys and values projected from the memory once
(eagerly), with the padding as an additive bias; g consecutive rows share a memory row (the beams of one
sentence, as in `MultiHeadAttention`).

Compiled once per process for greedy search and once for beam search (about 20-60 s each on 2 CPU cores; Inductor
caches its output on disk, so a later process compiles faster); the sizes that change between calls (rows,
decoded positions, source length) are marked dynamic, so no size compiles again. PyTorch would still compile a
size of one apart (it specializes sizes 0 and 1): the step reads at least two positions (`prefix`), and a single
memory row is held twice in the buffers
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


def _mark_dynamic(tensor: Tensor, *dims: int) -> None:
    """Tell torch.compile that these sizes of `tensor` change between calls (rows, decoded positions, source
    length), so that it compiles one step for all of them instead of one per size. Marked where the tensors are
    made (about 10 us a tensor)."""
    torch._dynamo.mark_dynamic(tensor, list(dims))


class StaticDecoderCache:
    """Key/value buffers for `CompiledDecoding.decode`; made by its `new_cache`, filled at the first step.

    One tensor for every layer's self-attention keys and values, positions first, so that the decoded prefix
    `self_kv[:length]` is a contiguous tensor of its own: the step reads those positions only, not the capacity.

    Attributes:
        self_kv: `(capacity, 2 * n_layers, rows, n_heads, d_head)`; `[:, 2 * i]` layer i's keys, `[:, 2 * i + 1]`
            its values; positions < `length` hold the decoded prefix, the others are not read.
        cross_kv: `(2 * n_layers, memory_rows, n_heads, src_len, d_head)`, the memory's keys and values, laid out
            as `self_kv`'s second dimension.
        cross_bias: `(memory_rows, src_len)`: 0 at source tokens, -inf at padding.
        length: positions decoded so far (the next position's index).
    """

    def __init__(self) -> None:
        self.self_kv: Optional[Tensor] = None
        self.cross_kv: Optional[Tensor] = None
        self.cross_bias: Optional[Tensor] = None
        self.length = 0
        self.memory_rows = 0
        # With a single memory row (one sentence, or one left) every buffer holds two identical copies of its
        # rows: the step is compiled once for batches of two rows or more, and a batch of one would compile again.
        self.mirrored = False

    @property
    def capacity(self) -> int:
        """Positions the self-attention buffer holds before it must grow."""
        return 0 if self.self_kv is None else self.self_kv.size(0)

    def select(self, index: Tensor, cross_index: Optional[Tensor] = None) -> None:
        """Keep, reorder or repeat rows, as `DecoderCache.select`: self-attention row i becomes old row
        `index[i]`, and the memory's rows follow `cross_index` (None: unchanged). Copies the decoded positions
        only."""
        if cross_index is not None:
            self.memory_rows = cross_index.numel()
        self.mirrored = self.memory_rows == 1
        if self.mirrored:  # the old rows are the first ones of a mirrored buffer too
            index = index.repeat(2)
            cross_index = None if cross_index is None else cross_index.repeat(2)
        if self.self_kv is None:  # not filled yet
            return
        old = self.self_kv
        self.self_kv = old.new_empty(old.size(0), old.size(1), index.numel(), *old.shape[3:])
        torch.index_select(old[:self.length], 2, index, out=self.self_kv[:self.length])
        self._zero_unwritten()
        if cross_index is not None:
            self.cross_kv = self.cross_kv.index_select(1, cross_index)
            self.cross_bias = self.cross_bias.index_select(0, cross_index)
            self._mark_cross()

    def _mark_cross(self) -> None:
        _mark_dynamic(self.cross_kv, 1, 3)  # memory rows, source length
        _mark_dynamic(self.cross_bias, 0, 1)

    def _grow(self, capacity: int) -> None:
        old = self.self_kv
        self.self_kv = old.new_empty(capacity, *old.shape[1:])
        self.self_kv[:self.length] = old[:self.length]
        self._zero_unwritten()

    def _zero_unwritten(self) -> None:
        """Zeros at the positions `prefix` reads before they are decoded (a NaN left there by the allocator would
        survive the mask: NaN + -inf is NaN)."""
        self.self_kv[self.length:2] = 0.0

    def prefix(self) -> Tensor:
        """The decoded positions, `self_kv[:length]`, and at least two: PyTorch compiles sizes 0 and 1 apart. At
        the first two steps the positions not decoded yet hold zeros (`_zero_unwritten`), behind the mask."""
        prefix = self.self_kv[:max(self.length, 2)]
        _mark_dynamic(prefix, 0, 2)  # positions, rows
        return prefix


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

    def forward(self, tokens: Tensor, position: Tensor, self_kv: Tensor, cross_kv: Tensor,
                cross_bias: Tensor) -> tuple[Tensor, Tensor]:
        """The step with one row per memory row (greedy search).

        Args:
            tokens: `(rows,)` the previous output token of each row.
            position: 0-dim LongTensor, the index of the new position.
            self_kv: `(n, 2 * n_layers, rows, n_heads, d_head)`, `StaticDecoderCache.prefix()`: the decoded
                positions (those from `position` on are masked). Not written: the step is a pure function (a
                buffer written inside the compiled code was copied whole at every step).
            cross_kv, cross_bias: as in `StaticDecoderCache`.

        Returns:
            logits `(rows, tgt_vocab_size)`, and the new position's keys and values
            `(2 * n_layers, rows, n_heads, d_head)`, for the caller to store at index `position`.
        """
        return self._step(tokens, position, self_kv, cross_kv, cross_bias, 1)

    def _step(self, tokens: Tensor, position: Tensor, self_kv: Tensor, cross_kv: Tensor, cross_bias: Tensor,
              group: int) -> tuple[Tensor, Tensor]:
        rows, memory_rows = tokens.size(0), cross_bias.size(0)
        if group != 1:  # a multiple, known only to the tensors (beam search's rows per sentence)
            group = rows // memory_rows
        n = self_kv.size(0)
        d_model, n_heads = self.output_weight.size(1), self.n_heads
        d_head = d_model // n_heads
        scale = 1.0 / math.sqrt(d_head)
        table = self.decoder.positional_encoding.table
        x = self.decoder.embedding(tokens) + table.index_select(0, position.view(1))  # (rows, d_model)
        # The prefix's positions from `position` on are not decoded yet (only at the first two steps: see `prefix`)
        ahead = torch.arange(n, device=tokens.device) >= position  # (n,)
        self_bias = torch.zeros(n, dtype=x.dtype, device=x.device).masked_fill(ahead, float("-inf"))
        new_kv = []
        for i, layer in enumerate(self.decoder.layers):
            h = layer.norm1(x) if self.norm_first else x
            q, k, v = layer.self_attn.in_proj(h).view(rows, 3, n_heads, d_head).unbind(1)  # (rows, n_heads, d_head)
            new_kv += [k, v]
            keys, values = self_kv[:, 2 * i], self_kv[:, 2 * i + 1]  # (n, rows, n_heads, d_head)
            # Scores over the prefix and the new position; products written as sums over an axis, which Inductor
            # fuses into one pass over the prefix
            scores = torch.cat([(keys * q).sum(-1) * scale + self_bias[:, None, None], (k * q).sum(-1)[None] * scale])
            weights = scores.softmax(0)  # (n + 1, rows, n_heads)
            h = (weights[:-1, ..., None] * values).sum(0) + weights[-1, ..., None] * v
            h = h.view(rows, d_model)
            x = _residual(x, layer.self_attn.out_proj(h), layer.norm1, self.norm_first)
            h = layer.norm2(x) if self.norm_first else x
            q = layer.cross_attn._project_q(h).view(memory_rows, group, n_heads, d_head).transpose(1, 2)
            # (memory_rows, n_heads, group, src_len)
            scores = q @ cross_kv[2 * i].transpose(-1, -2) * scale + cross_bias[:, None, None, :]
            h = (scores.softmax(-1) @ cross_kv[2 * i + 1]).transpose(1, 2).reshape(rows, d_model)
            x = _residual(x, layer.cross_attn.out_proj(h), layer.norm2, self.norm_first)
            h = layer.feed_forward(layer.norm3(x) if self.norm_first else x)
            x = _residual(x, h, layer.norm3, self.norm_first)
        if self.decoder.final_norm is not None:
            x = self.decoder.final_norm(x)
        return F.linear(x, self.output_weight, self.output_bias), torch.stack(new_kv)


class _GroupedDecoderStep(_DecoderStep):
    """The step with g >= 2 consecutive rows per memory row (beam search's beams). A class of its own so that
    torch.compile keeps its compiled code apart from greedy's (it caches per function), each for any size."""

    def forward(self, tokens: Tensor, position: Tensor, self_kv: Tensor, cross_kv: Tensor,
                cross_bias: Tensor) -> tuple[Tensor, Tensor]:
        """As `_DecoderStep.forward`, with rows a multiple (>= 2) of the memory rows."""
        return self._step(tokens, position, self_kv, cross_kv, cross_bias, 2)


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
        elif cache.length == cache.capacity:
            cache._grow(2 * cache.length)
        position = torch.tensor(cache.length, device=tgt_in.device)
        rows = tgt_in.size(0)
        tokens = tgt_in.reshape(rows).contiguous()  # one stride whatever the prefix's length
        if cache.mirrored:
            tokens = tokens.repeat(2)
        _mark_dynamic(tokens, 0)
        inputs = (tokens, position, cache.prefix(), cache.cross_kv, cache.cross_bias)
        with self._inductor_config.patch(freezing=True, cpp_wrapper=True):  # read when it compiles (lazily)
            logits, new_kv = self._steps[tokens.size(0) > cache.cross_bias.size(0)](*inputs)
        cache.self_kv[cache.length] = new_kv
        cache.length += 1
        return logits[:rows, None]

    def _fill(self, cache: StaticDecoderCache, rows: int, memory: Tensor, mask: Optional[Tensor]) -> None:
        """Project the memory into each layer's keys and values; allocate the self-attention buffer."""
        memory_rows, src_len, d_model = memory.shape
        cache.memory_rows, cache.mirrored = memory_rows, memory_rows == 1
        if cache.mirrored:
            memory, rows, memory_rows = memory.expand(2, -1, -1), 2 * rows, 2
            mask = None if mask is None else mask.expand(2, -1)
        n_heads, n_layers = self.config.n_heads, len(self.model.decoder.layers)
        d_head = d_model // n_heads
        if mask is None:
            mask = torch.zeros(memory_rows, src_len, dtype=torch.bool, device=memory.device)
        bias = torch.zeros(mask.shape, dtype=memory.dtype, device=memory.device).masked_fill(mask, float("-inf"))
        empty = mask.all(dim=1)  # a row of padding only attends to nothing in the eager decoder: zero output
        bias[empty] = 0.0
        cache.cross_bias = bias
        cache.cross_kv = memory.new_empty(2 * n_layers, memory_rows, n_heads, src_len, d_head)
        for i, layer in enumerate(self.model.decoder.layers):
            k, v = layer.cross_attn._project_kv(memory)  # (memory_rows, src_len, d_model) each
            for j, t in enumerate((k, v)):
                cache.cross_kv[2 * i + j] = t.view(memory_rows, src_len, n_heads, d_head).transpose(1, 2)
            cache.cross_kv[2 * i + 1, empty] = 0.0
        cache._mark_cross()
        cache.self_kv = memory.new_empty(self.INITIAL_CAPACITY, 2 * n_layers, rows, n_heads, d_head)
        cache._zero_unwritten()
