"""The model as the paper describes it: attention, masks and the key/value cache (`attention.py`), embeddings,
positional encoding and the layers with their `nn.Dropout` (`layers.py`), the encoder-decoder (`transformer.py`).
The CPU speed paths that decode with these weights, and the faster dropout that training swaps in, are in
`transformer/fast/`."""

from .attention import KVCache, MultiHeadAttention, causal_mask, make_key_padding_mask
from .transformer import AttentionWeights, DecoderCache, Transformer

__all__ = ["AttentionWeights", "DecoderCache", "KVCache", "MultiHeadAttention", "Transformer", "causal_mask",
           "make_key_padding_mask"]
