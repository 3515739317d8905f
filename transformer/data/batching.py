"""Batches of padded token ids and token-budget batching (Vaswani et al. 2017, §5.1).

A `Batch` is built once from lists of ids: `src` ends with eos; `tgt_in` = bos + target, `tgt_out` =
target + eos; all padded with pad_id on the right. Masks follow `model/attention.py` (True at padding).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..config import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Batch:
    """One batch of sentence pairs.

    Attributes:
        src: `(batch, src_len)` LongTensor, each row ending with eos, padded with pad_id.
        src_key_padding_mask: `(batch, src_len)` bool, True at padding.
        tgt_in: `(batch, tgt_len)` LongTensor, bos + target (None when there is no target).
        tgt_out: `(batch, tgt_len)` LongTensor, target + eos (None when there is no target).
        n_tgt_tokens: non-pad tokens in tgt_out (the loss normaliser), an int.
        n_src_tokens: non-pad tokens in src, an int.
        indices: `(batch,)` positions of the sentences in the corpus they came from.
    """

    src: Tensor
    src_key_padding_mask: Tensor
    tgt_in: Optional[Tensor]
    tgt_out: Optional[Tensor]
    n_src_tokens: int
    n_tgt_tokens: int
    indices: list[int]

    def to(self, device: torch.device) -> "Batch":
        """Copy the tensors to `device` (non-blocking from pinned memory on CUDA)."""
        if self.src.device == device:
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.src), move(self.src_key_padding_mask), move(self.tgt_in), move(self.tgt_out),
                     self.n_src_tokens, self.n_tgt_tokens, self.indices)

    def pin_memory(self) -> "Batch":
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(pin(self.src), pin(self.src_key_padding_mask), pin(self.tgt_in), pin(self.tgt_out),
                     self.n_src_tokens, self.n_tgt_tokens, self.indices)


def pad_sequences(sequences: list[list[int]], pad_id: int = PAD_ID) -> Tensor:
    """`(len(sequences), max_len)` LongTensor, right-padded with pad_id."""
    out = torch.full((len(sequences), max(len(s) for s in sequences)), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        out[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def make_batch(src_ids: list[list[int]], tgt_ids: Optional[list[list[int]]] = None,
               indices: Optional[list[int]] = None) -> Batch:
    """Pad a list of examples into a `Batch`.

    Args:
        src_ids: source ids per sentence, eos included (from `Tokenizer.encode_src`).
        tgt_ids: target ids per sentence without bos/eos (from `Tokenizer.encode_tgt`), or None.
        indices: corpus positions of the sentences (default 0..n-1).
    """
    src = pad_sequences(src_ids)
    tgt_in = tgt_out = None
    n_tgt = 0
    if tgt_ids is not None:
        tgt_in = pad_sequences([[BOS_ID] + t for t in tgt_ids])
        tgt_out = pad_sequences([t + [EOS_ID] for t in tgt_ids])
        n_tgt = sum(len(t) + 1 for t in tgt_ids)
    return Batch(src, src.eq(PAD_ID), tgt_in, tgt_out, sum(len(s) for s in src_ids), n_tgt,
                 list(range(len(src_ids))) if indices is None else list(indices))


def token_batches(src_lengths: list[int], tgt_lengths: list[int], max_tokens: int, seed: int, epoch: int,
                  pool_factor: int = 100) -> list[list[int]]:
    """Group example indices into batches of about `max_tokens` source and target tokens (§5.1).

    The examples are shuffled (from seed and epoch), cut into pools, each pool sorted by length, cut into
    batches whose padded size (sentences x longest sequence, on either side) stays within max_tokens, and
    the batches are shuffled. Every example appears in exactly one batch.

    Args:
        src_lengths, tgt_lengths: tokens per example (as fed to the model, eos/bos included).
        max_tokens: budget per batch, in padded tokens per side.
        seed, epoch: together they fix the order; the same pair gives the same batches.
        pool_factor: a pool holds about pool_factor batches' worth of examples.

    Returns:
        A list of batches, each a list of example indices sorted by decreasing length.

    Raises:
        ValueError: if an example alone exceeds max_tokens.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(src_lengths)))
    rng.shuffle(order)
    longest = [max(s, t) for s, t in zip(src_lengths, tgt_lengths)]
    mean_len = max(1, sum(longest) // max(1, len(longest)))
    pool_size = max(1, pool_factor * max_tokens // mean_len)
    batches: list[list[int]] = []
    for start in range(0, len(order), pool_size):
        pool = sorted(order[start:start + pool_size], key=lambda i: (longest[i], i), reverse=True)
        batch: list[int] = []
        batch_len = 0
        for i in pool:
            if longest[i] > max_tokens:
                raise ValueError(f"example {i} has {longest[i]} tokens, more than max_tokens={max_tokens}")
            if batch and (len(batch) + 1) * max(batch_len, longest[i]) > max_tokens:
                batches.append(batch)
                batch, batch_len = [], 0
            batch.append(i)
            batch_len = max(batch_len, longest[i])
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches
