"""Subword tokenization with sentencepiece: train, save, load, encode, decode.

Every model this project trains uses the same special ids (config.PAD_ID ...):
pad = 0, unk = 1, bos = 2, eos = 3. Source sequences end with eos; target sequences are fed as
bos + pieces (`tgt_in`) and predicted as pieces + eos (`tgt_out`).

Text is normalised by sentencepiece's `nmt_nfkc` rule, so NFC and NFD spellings and fullwidth letters
map to the same pieces.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import sentencepiece as spm

from .config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, DataConfig

logger = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """A tokenizer cannot be trained with the requested settings, or a saved one cannot be read."""


def _load_proto(proto: bytes) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(proto)
    return sp


class Tokenizer:
    """Source and target sentencepiece models (one object twice when the vocabulary is joint).

    Args:
        src_proto: serialized source sentencepiece model.
        tgt_proto: serialized target model, or None for a joint vocabulary.
    """

    def __init__(self, src_proto: bytes, tgt_proto: Optional[bytes] = None) -> None:
        self.src_proto, self.tgt_proto = src_proto, tgt_proto
        self.src = _load_proto(src_proto)
        self.tgt = self.src if tgt_proto is None else _load_proto(tgt_proto)
        for sp in (self.src, self.tgt):
            ids = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
            if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
                raise TokenizerError(f"sentencepiece model has special ids {ids} (pad, unk, bos, eos); "
                                     f"this project needs {(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}")

    @property
    def is_joint(self) -> bool:
        return self.tgt_proto is None

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_piece_size()

    def encode_src(self, texts: list[str]) -> list[list[int]]:
        """Source token ids, each sequence ending with eos."""
        return [ids + [EOS_ID] for ids in self.src.encode(texts, out_type=int)]

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        """Target token ids without bos/eos (batching adds them)."""
        return self.tgt.encode(texts, out_type=int)

    def tgt_pieces(self, ids: list[int]) -> list[str]:
        """Target pieces for display (e.g. attention plots)."""
        return [self.tgt.id_to_piece(i) for i in ids]

    def src_pieces(self, text: str) -> list[str]:
        """Source pieces of one sentence, eos included."""
        return self.src.encode(text, out_type=str) + ["</s>"]

    def decode_tgt(self, ids: Iterable[int], keep_unk: bool = False) -> str:
        """Detokenized target text. Special ids are dropped; unk too unless keep_unk (then shown as ⁇)."""
        drop = {PAD_ID, BOS_ID, EOS_ID} if keep_unk else {PAD_ID, BOS_ID, EOS_ID, UNK_ID}
        return self.tgt.decode([i for i in ids if i not in drop])

    def to_dict(self) -> dict:
        """Plain data (bytes) for a checkpoint: {"src": bytes, "tgt": bytes or None}."""
        return {"src": self.src_proto, "tgt": self.tgt_proto}

    @classmethod
    def from_dict(cls, data: dict) -> "Tokenizer":
        return cls(data["src"], data.get("tgt"))

    def save(self, run_dir: Path, src_lang: str, tgt_lang: str) -> list[Path]:
        """Write `spm.model` (joint) or `spm.{src_lang}.model` and `spm.{tgt_lang}.model` into run_dir."""
        if self.is_joint:
            files = {run_dir / "spm.model": self.src_proto}
        else:
            files = {run_dir / f"spm.{src_lang}.model": self.src_proto,
                     run_dir / f"spm.{tgt_lang}.model": self.tgt_proto}
        for path, proto in files.items():
            path.write_bytes(proto)
        return list(files)

    @classmethod
    def load(cls, run_dir: Path, src_lang: str, tgt_lang: str, joint: bool) -> Optional["Tokenizer"]:
        """The tokenizer saved in run_dir by `save`, or None if it is not there."""
        if joint:
            path = run_dir / "spm.model"
            return cls(path.read_bytes()) if path.exists() else None
        src, tgt = run_dir / f"spm.{src_lang}.model", run_dir / f"spm.{tgt_lang}.model"
        return cls(src.read_bytes(), tgt.read_bytes()) if src.exists() and tgt.exists() else None


SPM_MAX_SENTENCE_BYTES = 4192
"""Sentencepiece's own limit (its `max_sentence_length`, in UTF-8 bytes): longer training sentences are skipped by
sentencepiece; we count and log them (the rest of the pipeline keeps them)."""


def _train_one(sentences: list[str], data: DataConfig, what: str, threads: int) -> bytes:
    """Train one sentencepiece model in memory on all of `sentences`; returns its serialized proto."""
    import io

    too_long = sum(len(s) * 4 > SPM_MAX_SENTENCE_BYTES and len(s.encode("utf-8")) > SPM_MAX_SENTENCE_BYTES
                   for s in sentences)
    if too_long:
        logger.warning("sentencepiece skips %d of the %d %s sentences it trains on: longer than %d bytes",
                       too_long, len(sentences), what, SPM_MAX_SENTENCE_BYTES)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=data.vocab_size,
            model_type=data.spm_model_type, character_coverage=1.0, pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID,
            eos_id=EOS_ID, input_sentence_size=0, shuffle_input_sentence=False,
            max_sentence_length=SPM_MAX_SENTENCE_BYTES, num_threads=threads, minloglevel=2)
    except RuntimeError as err:
        match = re.search(r"<= (\d+)", str(err))
        largest = f"; the largest size that works on this data is {match.group(1)}" if match else ""
        raise TokenizerError(f"data.vocab_size={data.vocab_size}: sentencepiece cannot build that many pieces "
                             f"from the {what} training text ({len(sentences)} sentences){largest}. "
                             f"Lower data.vocab_size. (sentencepiece: {err})") from None
    return model.getvalue()


def train_tokenizer(src_texts: list[str], tgt_texts: list[str], data: DataConfig, threads: int = 2) -> Tokenizer:
    """Train sentencepiece on these sentences (a sample of the training split): one joint model, or one per language.

    Every sentence given is used (the caller samples: see `DataConfig.spm_max_sentences`); with the same sentences
    the same model comes out.

    Args:
        src_texts, tgt_texts: training sentences.
        data: vocab_size, joint_vocab, spm_model_type.
        threads: sentencepiece training threads.

    Raises:
        TokenizerError: if the vocabulary size cannot be reached on this text (naming the largest that can).
    """
    if data.joint_vocab:
        logger.info("training a joint %s sentencepiece model (%d pieces) on %d sentences", data.spm_model_type,
                    data.vocab_size, len(src_texts) + len(tgt_texts))
        return Tokenizer(_train_one(src_texts + tgt_texts, data, f"{data.src_lang}+{data.tgt_lang}", threads))
    logger.info("training %s sentencepiece models (%d pieces each) on %d sentences each", data.spm_model_type,
                data.vocab_size, len(src_texts))
    return Tokenizer(_train_one(src_texts, data, data.src_lang, threads),
                     _train_one(tgt_texts, data, data.tgt_lang, threads))
