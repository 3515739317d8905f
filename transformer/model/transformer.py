"""The encoder-decoder Transformer (Vaswani et al. 2017, §3, Figure 1).

    src (batch, src_len) --Encoder--> memory (batch, src_len, d_model)
    tgt_in (batch, tgt_len) + memory --Decoder--> hidden (batch, tgt_len, d_model) --W_out--> logits

Target padding needs no mask: it comes after the real tokens, so the causal mask already hides it from
every real position, and the loss ignores the outputs at padded positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor, nn

from ..config import PAD_ID, TransformerConfig
from .attention import KVCache, causal_mask, make_key_padding_mask
from .layers import DecoderLayer, EncoderLayer, SinusoidalPositionalEncoding, TokenEmbedding


@dataclass
class DecoderCache:
    """What incremental decoding keeps between steps: per-layer key/value caches, the memory, and the length.

    Attributes:
        self_attention: one appending `KVCache` per decoder layer.
        cross_attention: one `KVCache` per decoder layer, filled once with the memory's keys and values.
        memory: `(batch, src_len, d_model)` encoder output, one row per decoded row.
        memory_key_padding_mask: `(batch, src_len)` bool, True at source padding, or None.
        length: positions already decoded (the next position's index).
    """

    self_attention: list[KVCache]
    cross_attention: list[KVCache]
    memory: Optional[Tensor] = None
    memory_key_padding_mask: Optional[Tensor] = None
    length: int = 0

    def select(self, index: Tensor, memory_index: Optional[Tensor] = None) -> None:
        """Keep, reorder or repeat rows: new row i is old row `index[i]` (beam search's reordering, sentences that
        finished leaving the batch).

        Args:
            index: `(new_batch,)` LongTensor.
            memory_index: which sentences stay, for decoders that keep one memory row per sentence (see
                `decoding.IncrementalDecoder`); here every row has its own memory row, so `index` says it all.
        """
        for cache in self.self_attention + self.cross_attention:
            cache.select(index)
        if self.memory is not None:
            self.memory = self.memory.index_select(0, index)
        if self.memory_key_padding_mask is not None:
            self.memory_key_padding_mask = self.memory_key_padding_mask.index_select(0, index)


@dataclass
class AttentionWeights:
    """Attention weights of every layer and head, for visualization.

    Attributes:
        encoder_self: per encoder layer, `(batch, n_heads, src_len, src_len)`.
        decoder_self: per decoder layer, `(batch, n_heads, tgt_len, tgt_len)`.
        cross: per decoder layer, `(batch, n_heads, tgt_len, src_len)`.
    """

    encoder_self: list[Tensor] = field(default_factory=list)
    decoder_self: list[Tensor] = field(default_factory=list)
    cross: list[Tensor] = field(default_factory=list)


class Encoder(nn.Module):
    """Embedding, positional encoding and a stack of N encoder layers (§3.1); a final LayerNorm in pre-norm."""

    def __init__(self, config: TransformerConfig, embedding: TokenEmbedding) -> None:
        super().__init__()
        self.embedding = embedding
        self.positional_encoding = SinusoidalPositionalEncoding(config.d_model, config.max_positions)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(config.d_model, config.n_heads, config.d_ff, config.dropout, config.attention_dropout,
                         config.activation, config.norm_first) for _ in range(config.n_encoder_layers))
        self.final_norm = nn.LayerNorm(config.d_model) if config.norm_first else None

    def forward(self, src: Tensor, src_key_padding_mask: Optional[Tensor],
                weights: Optional[list[Tensor]] = None) -> Tensor:
        """Args:
            src: `(batch, src_len)` LongTensor of token ids.
            src_key_padding_mask: `(batch, src_len)` bool, True at padding.
            weights: if a list is given, each layer's self-attention weights are appended to it.

        Returns:
            memory `(batch, src_len, d_model)`.
        """
        x = self.dropout(self.embedding(src) + self.positional_encoding(src.size(1)))  # (batch, src_len, d_model)
        for layer in self.layers:
            x, w = layer(x, src_key_padding_mask, need_weights=weights is not None)
            if weights is not None:
                weights.append(w)
        return self.final_norm(x) if self.final_norm is not None else x


class Decoder(nn.Module):
    """Embedding, positional encoding and a stack of N decoder layers (§3.1); a final LayerNorm in pre-norm."""

    def __init__(self, config: TransformerConfig, embedding: TokenEmbedding) -> None:
        super().__init__()
        self.embedding = embedding
        self.positional_encoding = SinusoidalPositionalEncoding(config.d_model, config.max_positions)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            DecoderLayer(config.d_model, config.n_heads, config.d_ff, config.dropout, config.attention_dropout,
                         config.activation, config.norm_first) for _ in range(config.n_decoder_layers))
        self.final_norm = nn.LayerNorm(config.d_model) if config.norm_first else None

    def forward(self, tgt: Tensor, memory: Tensor, memory_key_padding_mask: Optional[Tensor],
                tgt_key_padding_mask: Optional[Tensor] = None, cache: Optional[DecoderCache] = None,
                weights: Optional[AttentionWeights] = None) -> Tensor:
        """Args:
            tgt: `(batch, tgt_len)` LongTensor; with a cache, only the positions not yet decoded.
            memory: `(batch, src_len, d_model)`.
            memory_key_padding_mask: `(batch, src_len)` bool, True at source padding.
            tgt_key_padding_mask: `(batch, tgt_len)` bool, True at target padding (optional).
            cache: a `DecoderCache`, updated in place (its length grows by tgt_len).
            weights: if given, each layer's self- and cross-attention weights are appended to it.

        Returns:
            hidden states `(batch, tgt_len, d_model)`.
        """
        start = cache.length if cache is not None else 0
        tgt_len = tgt.size(1)
        x = self.dropout(self.embedding(tgt) + self.positional_encoding(tgt_len, start))  # (batch, tgt_len, d_model)
        # Without cached positions the fused kernel applies the causal mask itself; with them, a single new
        # position may see every key, and several new positions need the offset mask.
        attn_mask = causal_mask(tgt_len, start + tgt_len, device=tgt.device) if start and tgt_len > 1 else None
        is_causal = start == 0
        for i, layer in enumerate(self.layers):
            x, self_w, cross_w = layer(
                x, memory, memory_key_padding_mask, tgt_key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
                self_cache=cache.self_attention[i] if cache is not None else None,
                cross_cache=cache.cross_attention[i] if cache is not None else None,
                need_weights=weights is not None)
            if weights is not None:
                weights.decoder_self.append(self_w)
                weights.cross.append(cross_w)
        if cache is not None:
            cache.length += tgt_len
        return self.final_norm(x) if self.final_norm is not None else x


class Transformer(nn.Module):
    """The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al. 2017).

    Weight tying (§3.4): with `tie_embeddings` the decoder's input embedding and the pre-softmax projection
    share one matrix; with `share_all_embeddings` the encoder's embedding is that matrix too.
    Initialisation: Xavier-uniform for every attention and feed-forward projection (per d_model x d_model
    block of W^Q, W^K, W^V), zero biases, N(0, d_model^-0.5) embeddings (zero pad row), LayerNorm (1, 0).

    Args:
        config: the sizes; see `TransformerConfig`.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        tgt_embedding = TokenEmbedding(config.tgt_vocab_size, config.d_model, PAD_ID)
        src_embedding = (tgt_embedding if config.share_all_embeddings
                         else TokenEmbedding(config.src_vocab_size, config.d_model, PAD_ID))
        self.encoder = Encoder(config, src_embedding)
        self.decoder = Decoder(config, tgt_embedding)
        self.output_projection = nn.Linear(config.d_model, config.tgt_vocab_size, bias=config.output_bias)
        if config.output_bias:
            nn.init.zeros_(self.output_projection.bias)
        if config.tie_embeddings:
            self.output_projection.weight = tgt_embedding.weight
        else:
            nn.init.normal_(self.output_projection.weight, mean=0.0, std=config.d_model ** -0.5)

    def src_key_padding_mask(self, src: Tensor) -> Tensor:
        """`(batch, src_len)` bool padding mask of `src`, True at `pad_id`."""
        return make_key_padding_mask(src, PAD_ID)

    def encode(self, src: Tensor, src_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """Run the encoder.

        Args:
            src: `(batch, src_len)` LongTensor padded with pad_id.
            src_key_padding_mask: `(batch, src_len)` bool, True at padding; built from `src` if None.

        Returns:
            memory `(batch, src_len, d_model)`.

        Raises:
            ValueError: if src_len exceeds max_positions.
        """
        if src_key_padding_mask is None:
            src_key_padding_mask = self.src_key_padding_mask(src)
        return self.encoder(src, src_key_padding_mask)

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_key_padding_mask: Optional[Tensor] = None,
               tgt_key_padding_mask: Optional[Tensor] = None, cache: Optional[DecoderCache] = None) -> Tensor:
        """Run the decoder and the output projection.

        Args:
            tgt_in: `(batch, tgt_len)` LongTensor starting with bos; with a cache, only the new position(s).
            memory: `(batch, src_len, d_model)` from `encode`.
            memory_key_padding_mask: `(batch, src_len)` bool, True at source padding (None: no padding).
            tgt_key_padding_mask: `(batch, tgt_len)` bool, True at target padding (optional, see module doc).
            cache: from `new_cache`, for incremental decoding; updated in place.

        Returns:
            logits `(batch, tgt_len, tgt_vocab_size)` (unnormalised, before softmax).

        Raises:
            ValueError: if the decoded length exceeds max_positions.
        """
        hidden = self.decoder(tgt_in, memory, memory_key_padding_mask, tgt_key_padding_mask, cache)
        return self.output_projection(hidden)

    def forward(self, src: Tensor, tgt_in: Tensor, src_key_padding_mask: Optional[Tensor] = None,
                tgt_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """Teacher-forced forward pass.

        Args:
            src: `(batch, src_len)` LongTensor padded with pad_id.
            tgt_in: `(batch, tgt_len)` LongTensor (bos + target), padded with pad_id.
            src_key_padding_mask: `(batch, src_len)` bool, True at padding; built from `src` if None.
            tgt_key_padding_mask: `(batch, tgt_len)` bool, optional (see module doc).

        Returns:
            logits `(batch, tgt_len, tgt_vocab_size)`.
        """
        return self.output_projection(self.hidden_states(src, tgt_in, src_key_padding_mask, tgt_key_padding_mask))

    def hidden_states(self, src: Tensor, tgt_in: Tensor, src_key_padding_mask: Optional[Tensor] = None,
                      tgt_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """Teacher-forced forward pass up to the output projection: what `forward` projects to logits, and what
        the training loss takes, to project it chunk by chunk (`training/loss.py`) instead of building every logit.

        Args: as `forward`.

        Returns:
            the decoder's hidden states `(batch, tgt_len, d_model)`.

        Raises:
            ValueError: if src_len or tgt_len exceeds max_positions.
        """
        if src_key_padding_mask is None:
            src_key_padding_mask = self.src_key_padding_mask(src)
        memory = self.encoder(src, src_key_padding_mask)
        return self.decoder(tgt_in, memory, src_key_padding_mask, tgt_key_padding_mask)

    def forward_with_attention(self, src: Tensor, tgt_in: Tensor) -> tuple[Tensor, AttentionWeights]:
        """Teacher-forced forward pass through the explicit attention path, returning every weight.

        Args:
            src: `(batch, src_len)`; tgt_in: `(batch, tgt_len)`.

        Returns:
            logits `(batch, tgt_len, tgt_vocab_size)` and the `AttentionWeights` of every layer.
        """
        src_key_padding_mask = self.src_key_padding_mask(src)
        weights = AttentionWeights()
        memory = self.encoder(src, src_key_padding_mask, weights=weights.encoder_self)
        hidden = self.decoder(tgt_in, memory, src_key_padding_mask, weights=weights)
        return self.output_projection(hidden), weights

    def new_cache(self, memory: Tensor, memory_key_padding_mask: Optional[Tensor] = None,
                  beam_size: int = 1) -> DecoderCache:
        """An empty `DecoderCache` for incremental decoding of `memory`, each sentence on beam_size rows.

        Args:
            memory: `(batch, src_len, d_model)` from `encode`.
            memory_key_padding_mask: `(batch, src_len)` bool, True at source padding, or None.
            beam_size: consecutive decoder rows per sentence (the memory row is repeated for each).

        Returns:
            the cache, for `decode(..., cache=cache)` with `cache.memory` or for `decode_step`.
        """
        n = self.config.n_decoder_layers
        mask = memory_key_padding_mask
        if beam_size > 1:
            memory = memory.repeat_interleave(beam_size, dim=0)  # (batch * beam_size, src_len, d_model)
            mask = None if mask is None else mask.repeat_interleave(beam_size, dim=0)
        return DecoderCache([KVCache() for _ in range(n)], [KVCache() for _ in range(n)], memory, mask)

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """One step of incremental decoding: the next position of every row (`decoding.IncrementalDecoder`).

        Args:
            tokens: `(rows,)` LongTensor, each row's previous output token (bos at the first step).
            cache: from `new_cache`; updated in place.

        Returns:
            logits `(rows, tgt_vocab_size)` for the next token.
        """
        return self.decode(tokens[:, None], cache.memory, cache.memory_key_padding_mask, cache=cache)[:, -1]

    def num_parameters(self) -> int:
        """Number of distinct parameters, trainable or not (tied matrices counted once)."""
        return sum(p.numel() for p in self.parameters())
