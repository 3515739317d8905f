"""Run a speed-path decoder and the readable model step by step on the same schedule, comparing logits."""

from __future__ import annotations

import torch

from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.model import Transformer

# (step, rows kept, sentences kept): beams reordered within sentences, then sentences leaving, for beam_size 2 and
# 3 sentences; `None` for the sentences: the same ones.
BEAM_SCHEDULE = {3: ([1, 0, 3, 3, 4, 5], None), 6: ([0, 1, 4, 5], [0, 2]), 9: ([2, 3], [1])}
GREEDY_SCHEDULE = {3: ([1, 0, 2], [1, 0, 2]), 6: ([0, 2], [0, 2]), 9: ([1], [1])}


def sources(lengths: list[int], vocab: int = 23, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded source ids ending in eos, and their padding mask."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (len(lengths), max(lengths)), generator=g)
    for i, n in enumerate(lengths):
        src[i, n - 1], src[i, n:] = EOS_ID, PAD_ID
    return src, src.eq(PAD_ID)


@torch.no_grad()
def compare_steps(model: Transformer, decoder, src: torch.Tensor, mask: torch.Tensor, beam_size: int,
                  schedule: dict, steps: int, atol: float = 1e-5) -> int:
    """Decode random tokens with both, selecting rows as `schedule` says; assert equal logits at every step.

    Returns:
        the number of steps compared.
    """
    memory = model.encode(src, mask)
    torch.testing.assert_close(decoder.encode(src, mask), memory, atol=atol, rtol=atol)
    readable, fast = model.new_cache(memory, mask, beam_size), decoder.new_cache(memory, mask, beam_size)
    rows = src.size(0) * beam_size
    vocab = model.config.tgt_vocab_size
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step in schedule:
            index, memory_index = schedule[step]
            index = torch.tensor(index)
            memory_index = None if memory_index is None else torch.tensor(memory_index)
            readable.select(index, memory_index)
            fast.select(index, memory_index)
            rows = index.numel()
        tokens = torch.full((rows,), BOS_ID) if step == 0 else torch.randint(3, vocab, (rows,), generator=g)
        expected, got = model.decode_step(tokens, readable), decoder.decode_step(tokens, fast)
        assert got.shape == expected.shape == (rows, vocab)
        assert torch.isfinite(got).all(), f"step {step}"
        torch.testing.assert_close(got, expected, atol=atol, rtol=atol, msg=f"step {step}")
    return steps
