"""The model: dropout (`dropout.py`), attention (`attention.py`), its layers (`layers.py`) and the encoder-decoder
(`transformer.py`)."""

from .attention import KVCache, MultiHeadAttention, causal_mask, make_key_padding_mask
from .transformer import AttentionWeights, DecoderCache, Transformer

__all__ = ["AttentionWeights", "DecoderCache", "KVCache", "MultiHeadAttention", "Transformer", "causal_mask",
           "make_key_padding_mask"]
