"""Batches of padded token ids and token-budget batching (Vaswani et al. 2017, §5.1).

A `Batch` is built once from lists of ids: `src` ends with eos; `tgt_in` = bos + target, `tgt_out` =
target + eos; all padded with pad_id on the right. Masks follow `model/attention.py` (True at padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
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
        n_src_tokens: non-pad tokens in src, an int.
        n_tgt_tokens: non-pad tokens in tgt_out (the loss normaliser), an int.
    """

    src: Tensor
    src_key_padding_mask: Tensor
    tgt_in: Optional[Tensor]
    tgt_out: Optional[Tensor]
    n_src_tokens: int
    n_tgt_tokens: int

    def to(self, device: torch.device) -> "Batch":
        """Copy the tensors to `device`; from the CPU to a GPU through pinned memory, without blocking (the copy
        overlaps the work queued before it)."""
        if self.src.device == device:
            return self
        source = (
            self.pin_memory() if device.type == "cuda" and self.src.device.type == "cpu" else self
        )
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(
            move(source.src),
            move(source.src_key_padding_mask),
            move(source.tgt_in),
            move(source.tgt_out),
            self.n_src_tokens,
            self.n_tgt_tokens,
        )

    def pin_memory(self) -> "Batch":
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(
            pin(self.src),
            pin(self.src_key_padding_mask),
            pin(self.tgt_in),
            pin(self.tgt_out),
            self.n_src_tokens,
            self.n_tgt_tokens,
        )


Sequence = Union[list[int], np.ndarray]


def pad_sequences(
    sequences: list[Sequence],
    pad_id: int = PAD_ID,
    prefix: Optional[int] = None,
    suffix: Optional[int] = None,
) -> Tensor:
    """`(len(sequences), longest + extras)` LongTensor, right-padded with pad_id.

    Args:
        sequences: lists of ids or 1-D integer numpy arrays (e.g. slices of a memory-mapped token cache).
        prefix, suffix: an id put before / after every sequence (bos, eos), or None.
    """
    start = int(prefix is not None)
    width = max(len(s) for s in sequences) + start + int(suffix is not None)
    out = np.full((len(sequences), width), pad_id, dtype=np.int64)
    if prefix is not None:
        out[:, 0] = prefix
    for i, seq in enumerate(sequences):
        out[i, start : start + len(seq)] = seq
        if suffix is not None:
            out[i, start + len(seq)] = suffix
    return torch.from_numpy(out)


def make_batch(src_ids: list[Sequence], tgt_ids: Optional[list[Sequence]] = None) -> Batch:
    """Pad a list of examples into a `Batch`.

    Args:
        src_ids: source ids per sentence, eos included (as `Tokenizer.encode_src` gives them).
        tgt_ids: target ids per sentence without bos/eos (as `Tokenizer.encode_tgt` gives them), or None.
    """
    src = pad_sequences(src_ids)
    tgt_in = tgt_out = None
    n_tgt = 0
    if tgt_ids is not None:
        tgt_in = pad_sequences(tgt_ids, prefix=BOS_ID)
        tgt_out = pad_sequences(tgt_ids, suffix=EOS_ID)
        n_tgt = sum(len(t) + 1 for t in tgt_ids)
    return Batch(src, src.eq(PAD_ID), tgt_in, tgt_out, sum(len(s) for s in src_ids), n_tgt)


def token_batches(
    src_lengths: Sequence,
    tgt_lengths: Sequence,
    max_tokens: int,
    seed: int,
    epoch: int,
    pool_factor: int = 100,
) -> list[np.ndarray]:
    """Group example indices into batches of about `max_tokens` source and target tokens (§5.1).

    The examples are shuffled (from seed and epoch), cut into pools, each pool sorted by length, cut into
    batches whose padded size (sentences x longest sequence, on either side) stays within max_tokens, and
    the batches are shuffled. Every example appears in exactly one batch. Everything is numpy over the two
    length arrays (one sort per pool, one slice per batch): no Python object per sentence, so an epoch of
    4.5M pairs is ordered in about a second.

    Args:
        src_lengths, tgt_lengths: tokens per example as fed to the model (eos/bos included), `(n,)` arrays or lists.
        max_tokens: budget per batch, in padded tokens per side.
        seed, epoch: together they fix the order; the same pair gives the same batches.
        pool_factor: a pool holds about pool_factor batches' worth of examples.

    Returns:
        A list of batches, each an int64 array of example indices sorted by decreasing length.

    Raises:
        ValueError: if an example alone exceeds max_tokens.
    """
    longest = np.maximum(
        np.asarray(src_lengths, dtype=np.int64), np.asarray(tgt_lengths, dtype=np.int64)
    )
    n = len(longest)
    if n and longest.max() > max_tokens:
        i = int(np.argmax(longest > max_tokens))
        raise ValueError(f"example {i} has {longest[i]} tokens, more than max_tokens={max_tokens}")
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n)
    mean_len = max(1, int(longest.sum()) // max(1, n))
    pool_size = max(1, pool_factor * max_tokens // mean_len)
    batches: list[np.ndarray] = []
    for start in range(0, n, pool_size):
        pool = order[start : start + pool_size]
        pool = pool[
            np.lexsort((pool, longest[pool]))[::-1]
        ]  # longest first (ties: higher index first)
        # Sorted longest first, a batch starting at i holds max_tokens // longest[i] examples.
        sizes = max_tokens // longest[pool]
        i = 0
        while i < len(pool):
            batches.append(pool[i : i + sizes[i]])
            i += int(sizes[i])
    return [batches[i] for i in rng.permutation(len(batches))]
