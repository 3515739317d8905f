"""The decoder's incremental step compiled by `torch.compile` (`--compile`), on fixed-capacity key/value buffers.

`CPUDecoder.decode_step` dispatches about 60 PyTorch operators per layer and step from Python. `CompiledDecoder`
runs the same arithmetic as one function per step, which TorchInductor compiles into C++: the small operators
between the matrix products (bias, softmax, residual and LayerNorm) are fused into a few loops, the weights are
frozen into the compiled code in the layout its kernels prefer (`freezing`), and the step is called from C++
(`cpp_wrapper`).

The buffers: every layer's self-attention keys and values live in one `(capacity, 2 * n_layers, rows, n_heads,
d_head)` tensor, positions first, so that the decoded prefix `[:length]` is a contiguous tensor that the step
reads whole (the decoded positions only, not the capacity). The step is a pure function: it returns the new
position's keys and values, and the caller stores them at index `length` (a buffer written inside the compiled
code is copied whole at every step). The buffer doubles when full, and `select` reorders rows (copying the
decoded positions only). Encoder-decoder attention reads keys and values projected from the memory once
(eagerly), with the padding as an additive bias; g consecutive rows share a memory row (the beams of one
sentence, as in `CPUDecoder`).

Compiled once per process for greedy search and once for beam search; the sizes that change between calls (rows,
decoded positions, source length) are marked dynamic, so no size compiles again. PyTorch compiles sizes 0 and 1
apart, so the step reads at least two positions (`prefix`), a single memory row is held twice in the buffers
(`StaticDecoderCache.mirrored`), and greedy's one row per sentence and beam search's several get separate
compiled functions. Inductor needs a C++ compiler on the CPU. The arithmetic is `CPUDecoder`'s in another order:
logits agree to float rounding (tests compare the two at every step, and the searches' outputs).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import OptionError
from ..model.layers import residual
from .cpu import CPUDecoder


def _mark_dynamic(tensor: Tensor, *dims: int) -> None:
    """Tell torch.compile that these sizes of `tensor` change between calls (rows, decoded positions, source
    length), so that it compiles one step for all of them instead of one per size. Marked where the tensors are
    made, not at every step (each mark has a cost)."""
    torch._dynamo.mark_dynamic(tensor, list(dims))


class StaticDecoderCache:
    """Key/value buffers for `CompiledDecoder.decode_step`, made by its `new_cache`.

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

    def select(self, index: Tensor, memory_index: Optional[Tensor] = None) -> None:
        """Keep, reorder or repeat rows, as `CPUDecoderCache.select`: self-attention row i becomes old row
        `index[i]`, and the memory's rows follow `memory_index` (None: unchanged). Copies the decoded positions
        only."""
        if memory_index is not None:
            self.memory_rows = memory_index.numel()
        self.mirrored = self.memory_rows == 1
        if self.mirrored:  # the old rows are the first ones of a mirrored buffer too
            index = index.repeat(2)
            memory_index = None if memory_index is None else memory_index.repeat(2)
        old = self.self_kv
        self.self_kv = old.new_empty(old.size(0), old.size(1), index.numel(), *old.shape[3:])
        torch.index_select(old[: self.length], 2, index, out=self.self_kv[: self.length])
        self._zero_unwritten()
        if memory_index is not None:
            self.cross_kv = self.cross_kv.index_select(1, memory_index)
            self.cross_bias = self.cross_bias.index_select(0, memory_index)
            self._mark_cross()

    def _mark_cross(self) -> None:
        _mark_dynamic(self.cross_kv, 1, 3)  # memory rows, source length
        _mark_dynamic(self.cross_bias, 0, 1)

    def grow(self, capacity: int) -> None:
        """Reallocate the self-attention buffer with room for `capacity` positions."""
        old = self.self_kv
        self.self_kv = old.new_empty(capacity, *old.shape[1:])
        self.self_kv[: self.length] = old[: self.length]
        self._zero_unwritten()

    def _zero_unwritten(self) -> None:
        """Zeros at the positions `prefix` reads before they are decoded (a NaN left there by the allocator would
        survive the mask: NaN + -inf is NaN)."""
        self.self_kv[self.length : 2] = 0.0

    def prefix(self) -> Tensor:
        """The decoded positions, `self_kv[:length]`, and at least two: PyTorch compiles sizes 0 and 1 apart. At
        the first two steps the positions not decoded yet hold zeros (`_zero_unwritten`), behind the mask."""
        prefix = self.self_kv[: max(self.length, 2)]
        _mark_dynamic(prefix, 0, 2)  # positions, rows
        return prefix


class _DecoderStep(nn.Module):
    """One decoding position through every decoder layer and the output projection, reading the
    `StaticDecoderCache` buffers. The function `torch.compile` compiles; its arithmetic is `CPUDecoderLayer`'s
    (§3.1-3.4) for one new position."""

    def __init__(self, model: CPUDecoder) -> None:
        super().__init__()
        self.embedding, self.layers, self.final_norm = (
            model.embedding,
            model.layers,
            model.final_norm,
        )
        self.register_buffer("table", model.positional_encoding.table, persistent=False)
        projection = model.output_projection
        # `CPUDecoder` runs the output projection through oneDNN on a reordered weight; the compiled step takes
        # the plain weight and lets Inductor choose the layout.
        weight = getattr(projection, "weight", None)
        if weight is None:
            weight = projection.original_weight
        # Parameters (sharing the model's storage), so that `freezing` folds them into the compiled code
        self.output_weight = nn.Parameter(weight.detach(), requires_grad=False)
        bias = projection.bias
        self.output_bias = (
            None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        )
        self.n_heads = model.config.n_heads
        self.norm_first = model.config.norm_first

    def forward(
        self,
        tokens: Tensor,
        position: Tensor,
        self_kv: Tensor,
        cross_kv: Tensor,
        cross_bias: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """The step with one row per memory row (greedy search).

        Args:
            tokens: `(rows,)` the previous output token of each row.
            position: 0-dim LongTensor, the index of the new position.
            self_kv: `(n, 2 * n_layers, rows, n_heads, d_head)`, `StaticDecoderCache.prefix()`: the decoded
                positions (those from `position` on are masked). Not written: the step is a pure function (a
                buffer written inside the compiled code would be copied whole at every step).
            cross_kv, cross_bias: as in `StaticDecoderCache`.

        Returns:
            logits `(rows, tgt_vocab_size)`, and the new position's keys and values
            `(2 * n_layers, rows, n_heads, d_head)`, for the caller to store at index `position`.
        """
        return self._step(tokens, position, self_kv, cross_kv, cross_bias, 1)

    def _step(
        self,
        tokens: Tensor,
        position: Tensor,
        self_kv: Tensor,
        cross_kv: Tensor,
        cross_bias: Tensor,
        group: int,
    ) -> tuple[Tensor, Tensor]:
        rows, memory_rows = tokens.size(0), cross_bias.size(0)
        if group != 1:  # a multiple, known only to the tensors (beam search's rows per sentence)
            group = rows // memory_rows
        n = self_kv.size(0)
        d_model, n_heads = self.output_weight.size(1), self.n_heads
        d_head = d_model // n_heads
        scale = 1.0 / math.sqrt(d_head)
        x = self.embedding(tokens) + self.table.index_select(0, position.view(1))  # (rows, d_model)
        # The prefix's positions from `position` on are not decoded yet (only at the first two steps: see `prefix`)
        ahead = torch.arange(n, device=tokens.device) >= position  # (n,)
        self_bias = torch.zeros(n, dtype=x.dtype, device=x.device).masked_fill(ahead, float("-inf"))
        new_kv = []
        for i, layer in enumerate(self.layers):
            h = layer.norm1(x) if self.norm_first else x
            # (rows, n_heads, d_head)
            q, k, v = layer.self_qkv(h).view(rows, 3, n_heads, d_head).unbind(1)
            new_kv += [k, v]
            keys, values = self_kv[:, 2 * i], self_kv[:, 2 * i + 1]  # (n, rows, n_heads, d_head)
            # Scores over the prefix and the new position; products written as sums over an axis, which Inductor
            # fuses into one pass over the prefix
            scores = torch.cat(
                [
                    (keys * q).sum(-1) * scale + self_bias[:, None, None],
                    (k * q).sum(-1)[None] * scale,
                ]
            )
            weights = scores.softmax(0)  # (n + 1, rows, n_heads)
            h = (weights[:-1, ..., None] * values).sum(0) + weights[-1, ..., None] * v
            h = h.view(rows, d_model)
            x = residual(x, layer.self_out(h), layer.norm1, self.norm_first)
            h = layer.norm2(x) if self.norm_first else x
            q = layer.cross_q(h).view(memory_rows, group, n_heads, d_head).transpose(1, 2)
            # (memory_rows, n_heads, group, src_len)
            scores = q @ cross_kv[2 * i].transpose(-1, -2) * scale + cross_bias[:, None, None, :]
            h = (scores.softmax(-1) @ cross_kv[2 * i + 1]).transpose(1, 2).reshape(rows, d_model)
            x = residual(x, layer.cross_out(h), layer.norm2, self.norm_first)
            h = layer.feed_forward(layer.norm3(x) if self.norm_first else x)
            x = residual(x, h, layer.norm3, self.norm_first)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return F.linear(x, self.output_weight, self.output_bias), torch.stack(new_kv)


class _GroupedDecoderStep(_DecoderStep):
    """The step with g >= 2 consecutive rows per memory row (beam search's beams). A class of its own so that
    torch.compile keeps its compiled code apart from greedy's (it caches per function), each for any size."""

    def forward(
        self,
        tokens: Tensor,
        position: Tensor,
        self_kv: Tensor,
        cross_kv: Tensor,
        cross_bias: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """As `_DecoderStep.forward`, with rows a multiple (>= 2) of the memory rows."""
        return self._step(tokens, position, self_kv, cross_kv, cross_bias, 2)


class CompiledDecoder:
    """`CPUDecoder` with its incremental step compiled; a `decoding.IncrementalDecoder`.

    `encode` and `config` are the decoder's; `decode_step` runs the compiled step.

    Args:
        model: a float32 `CPUDecoder`.

    Raises:
        OptionError: the decoder is int8-quantized (its layers are not compilable).
    """

    INITIAL_CAPACITY = 32  # decoded positions before the self-attention buffers first double

    def __init__(self, model: CPUDecoder) -> None:
        if not model.is_float:
            raise OptionError(
                "{compile} works on float32 models, not with {quantization}",
                compile=True,
                quantization=model.quantization,
            )
        import torch._inductor.config  # here, not at the top: it takes seconds, which every CLI start would pay

        self._inductor_config = torch._inductor.config
        self.model = model
        self.config = model.config
        self._steps = [
            torch.compile(step(model).eval()) for step in (_DecoderStep, _GroupedDecoderStep)
        ]

    def encode(self, src: Tensor, src_key_padding_mask: Tensor) -> Tensor:
        """The model's `encode`: memory `(batch, src_len, d_model)`."""
        return self.model.encode(src, src_key_padding_mask)

    def new_cache(
        self, memory: Tensor, memory_key_padding_mask: Optional[Tensor] = None, beam_size: int = 1
    ) -> StaticDecoderCache:
        """Project the memory into each layer's keys and values and allocate the self-attention buffer.

        Args:
            memory: `(memory_rows, src_len, d_model)`; memory_key_padding_mask: `(memory_rows, src_len)` bool or None.
            beam_size: decoder rows per memory row.
        """
        cache = StaticDecoderCache()
        mask = memory_key_padding_mask
        memory_rows, src_len, d_model = memory.shape
        rows = memory_rows * beam_size
        cache.memory_rows, cache.mirrored = memory_rows, memory_rows == 1
        if cache.mirrored:
            memory, rows, memory_rows = memory.expand(2, -1, -1), 2 * rows, 2
            mask = None if mask is None else mask.expand(2, -1)
        n_heads, n_layers = self.config.n_heads, len(self.model.layers)
        d_head = d_model // n_heads
        if mask is None:
            mask = torch.zeros(memory_rows, src_len, dtype=torch.bool, device=memory.device)
        bias = torch.zeros(mask.shape, dtype=memory.dtype, device=memory.device).masked_fill(
            mask, float("-inf")
        )
        empty = mask.all(
            dim=1
        )  # a row of padding only attends to nothing in the eager decoder: zero output
        bias[empty] = 0.0
        cache.cross_bias = bias
        cache.cross_kv = memory.new_empty(2 * n_layers, memory_rows, n_heads, src_len, d_head)
        for i, layer in enumerate(self.model.layers):
            k, v = layer.cross_kv(memory).chunk(2, dim=-1)  # (memory_rows, src_len, d_model) each
            for j, t in enumerate((k, v)):
                cache.cross_kv[2 * i + j] = t.view(memory_rows, src_len, n_heads, d_head).transpose(
                    1, 2
                )
            cache.cross_kv[2 * i + 1, empty] = 0.0
        cache._mark_cross()
        cache.self_kv = memory.new_empty(self.INITIAL_CAPACITY, 2 * n_layers, rows, n_heads, d_head)
        cache._zero_unwritten()
        return cache

    def decode_step(self, tokens: Tensor, cache: StaticDecoderCache) -> Tensor:
        """As `Transformer.decode_step`, compiled: tokens `(rows,)` -> logits `(rows, tgt_vocab_size)`.

        Raises:
            ValueError: the decoded length would exceed max_positions.
        """
        self.model.positional_encoding(1, cache.length)  # raises beyond max_positions
        if cache.length == cache.capacity:
            cache.grow(2 * cache.length)
        position = torch.tensor(cache.length, device=tokens.device)
        rows = tokens.size(0)
        tokens = tokens.contiguous()  # one stride whatever the prefix's length
        if cache.mirrored:
            tokens = tokens.repeat(2)
        _mark_dynamic(tokens, 0)
        inputs = (tokens, position, cache.prefix(), cache.cross_kv, cache.cross_bias)
        with self._inductor_config.patch(
            freezing=True, cpp_wrapper=True
        ):  # read when it compiles (lazily)
            logits, new_kv = self._steps[tokens.size(0) > cache.cross_bias.size(0)](*inputs)
        cache.self_kv[cache.length] = new_kv
        cache.length += 1
        return logits[:rows]


def forget_compiled() -> None:
    """Drop all code torch.compile has compiled in this process. The compiled steps' code is shared by every
    `CompiledDecoder` of the process: one for a model of other sizes compiles again, with guards that the first
    model's sizes shaped (tests that count compiles start from here)."""
    import torch._dynamo

    torch._dynamo.reset()


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far (a count that only grows)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def uncompiled(module: nn.Module) -> nn.Module:
    """The module that `torch.compile(module)` wrapped, or `module` itself when it was not compiled. (The wrapper
    keeps it in a private attribute, `_orig_mod`; the training step reaches the DDP module inside this way.)"""
    return getattr(module, "_orig_mod", module)
