"""Shared fixtures: a tiny seeded model and helpers to build padded batches."""

from __future__ import annotations

import pytest
import torch

from transformer import Transformer, TransformerConfig

PAD = 0


def tiny_config(**changes) -> TransformerConfig:
    """A model small enough for exact checks in milliseconds."""
    sizes = dict(src_vocab_size=23, tgt_vocab_size=29, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2,
                 n_decoder_layers=2, dropout=0.1, attention_dropout=0.1, max_positions=64, pad_id=PAD)
    sizes.update(changes)
    return TransformerConfig(**sizes)


def tiny_model(seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_config(**changes)).eval()


def random_tokens(batch: int, length: int, vocab: int, lengths: list[int] | None = None, seed: int = 0):
    """`(batch, length)` random ids in [4, vocab), padded with PAD after lengths[i] tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (batch, length), generator=g)
    if lengths is not None:
        for i, n in enumerate(lengths):
            tokens[i, n:] = PAD
    return tokens


@pytest.fixture(params=[False, True], ids=["post-norm", "pre-norm"])
def model(request) -> Transformer:
    return tiny_model(norm_first=request.param)
