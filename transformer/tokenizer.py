"""Subword tokenization with sentencepiece: train, save, load, encode, decode.

Every model this project trains uses the same special ids (config.PAD_ID ...):
pad = 0, unk = 1, bos = 2, eos = 3. Source sequences end with eos; target sequences are fed as
bos + pieces (`tgt_in`) and predicted as pieces + eos (`tgt_out`).

Text is normalised by sentencepiece's `nmt_nfkc` rule, so NFC and NFD spellings and fullwidth letters
map to the same pieces.

A tokenizer imported with a model from elsewhere (a Marian model, `transformer/hf.py`) carries its own
vocabulary: a list of pieces whose index is the model's token id (the same four special ids first). Text is
then split into pieces by the sentencepiece model(s) and each piece looked up in that list (unk if absent), and a
leading target-language token such as `>>fra<<` is kept as one piece, as Marian's tokenizer does.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import sentencepiece as spm

from .config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, DataConfig
from .config.languages import Corpus, language_pairs

logger = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """A tokenizer cannot be trained with the requested settings, or a saved one cannot be read."""


def split_language_code(text: str) -> tuple[list[str], str]:
    """A leading `>>xx<<` target-language token as its own piece, and the rest of the text (as Marian's tokenizer)."""
    end = text.find("<<") if text.startswith(">>") else -1
    return ([text[: end + 2]], text[end + 2 :]) if end != -1 else ([], text)


def _user_defined_ids(proto: bytes) -> frozenset[int]:
    """The ids of a sentencepiece model's user-defined pieces (the marks: language tokens, tags)."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    return frozenset(i for i, piece in enumerate(model.pieces) if piece.type == user_defined)


def _load_proto(proto: bytes) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(proto)
    return sp


SPECIAL_PIECES = ("<pad>", "<unk>", "<s>", "</s>")
"""The pieces of the special ids PAD_ID, UNK_ID, BOS_ID, EOS_ID (in this order) in a tokenizer's own vocabulary."""
ENCODING_VERSION = 2
"""Bumped whenever the ids `Tokenizer.src_ids`/`tgt_ids` give for a text change with the same sentencepiece model
(2: a reserved piece written in text is spelled as text, `marks_as_text`): token caches are keyed on it."""


class Tokenizer:
    """Source and target sentencepiece models (one object twice when the vocabulary is joint).

    Args:
        src_proto: serialized source sentencepiece model.
        tgt_proto: serialized target model, or None when source and target share `src_proto`.
        vocab: the pieces of token ids 0, 1, ... for both sides, starting with `SPECIAL_PIECES`; None: the
            sentencepiece model's own ids (which must then be the special ids of `config.PAD_ID` ...).

    Raises:
        TokenizerError: a sentencepiece model with other special ids, or a vocabulary without `SPECIAL_PIECES` first.
    """

    def __init__(
        self, src_proto: bytes, tgt_proto: Optional[bytes] = None, vocab: Optional[list[str]] = None
    ) -> None:
        self.src_proto, self.tgt_proto = src_proto, tgt_proto
        self.src = _load_proto(src_proto)
        self.tgt = self.src if tgt_proto is None else _load_proto(tgt_proto)
        self.vocab = vocab
        if vocab is not None:
            if tuple(vocab[:4]) != SPECIAL_PIECES:
                raise TokenizerError(
                    f"a tokenizer vocabulary must start with {SPECIAL_PIECES}, got {vocab[:4]}"
                )
            self._piece_ids = {}
            for i, piece in enumerate(vocab):
                self._piece_ids.setdefault(piece, i)
            return
        for sp in (self.src, self.tgt):
            ids = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
            if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
                raise TokenizerError(
                    f"sentencepiece model has special ids {ids} (pad, unk, bos, eos); "
                    f"this project needs {(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}"
                )
        self._marks = {"src": _user_defined_ids(src_proto)}
        self._marks["tgt"] = (
            self._marks["src"] if tgt_proto is None else _user_defined_ids(tgt_proto)
        )

    @property
    def is_joint(self) -> bool:
        """True when source and target share one list of token ids (and the embeddings may be shared)."""
        return self.tgt_proto is None or self.vocab is not None

    @property
    def src_vocab_size(self) -> int:
        return len(self.vocab) if self.vocab is not None else self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return len(self.vocab) if self.vocab is not None else self.tgt.get_piece_size()

    def src_ids(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Source token ids of each text, without eos. Text is text: a language token or tag written in it
        (`>>fra<<`, anywhere) is spelled with ordinary pieces, never given the mark's id (`marks_as_text`); the
        marks a model reads are put before the ids by their callers. A vocabulary of its own (a MarianMT import)
        reads a `>>fra<<` at the very start as one piece, as MarianTokenizer does; later ones are text."""
        if self.vocab is None:
            ids = self.src.encode(texts, out_type=int, num_threads=num_threads)
            return [self.marks_as_text(i, "src") for i in ids]
        codes, rests = zip(*map(split_language_code, texts)) if texts else ((), ())
        pieces = self.src.encode(list(rests), out_type=str, num_threads=num_threads)
        return [self.piece_ids(code + p, "src") for code, p in zip(codes, pieces)]

    def tgt_ids(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Target token ids of each text, without bos/eos (marks written in it spelled as text, as `src_ids`)."""
        if self.vocab is None:
            ids = self.tgt.encode(texts, out_type=int, num_threads=num_threads)
            return [self.marks_as_text(i, "tgt") for i in ids]
        return [
            self.piece_ids(p) for p in self.tgt.encode(texts, out_type=str, num_threads=num_threads)
        ]

    def marks_as_text(self, ids: list[int], side: str = "src") -> list[int]:
        """`ids` (of a sentencepiece encoding of text) with every reserved piece (a language token or tag the
        vocabulary holds whole: sentencepiece matches those anywhere in a text) replaced by the pieces of its
        characters (unk for one the vocabulary lacks), so that written text never carries a mark."""
        marks = self._marks[side]
        if not marks or marks.isdisjoint(ids):
            return ids
        sp = self.src if side == "src" else self.tgt
        out: list[int] = []
        for i in ids:
            out.extend(sp.piece_to_id(list(sp.id_to_piece(i))) if i in marks else [i])
        return out

    def piece_ids(self, pieces: list[str], side: str = "tgt") -> list[int]:
        """The token ids of `pieces` (unk for a piece the vocabulary lacks), side "src" or "tgt"."""
        if self.vocab is not None:
            return [self._piece_ids.get(p, UNK_ID) for p in pieces]
        return (self.src if side == "src" else self.tgt).piece_to_id(list(pieces))

    def token_id(self, piece: str) -> int:
        """The source id of a piece that must be one whole piece of the vocabulary (a language token, `>>fra<<`).

        Raises:
            TokenizerError: the vocabulary lacks it.
        """
        token = self.piece_ids([piece], "src")[0]
        if token == UNK_ID or self.id_to_piece(token, "src") != piece:
            raise TokenizerError(
                f"the vocabulary has no piece {piece}: this model was not trained with it"
            )
        return token

    def source_prefix(self, corpus: Corpus) -> list[int]:
        """The ids put before every source of `corpus` (`Corpus.source_pieces`: a multilingual run's target-language
        token, a tag): none for a corpus without marks.

        Raises:
            TokenizerError: the vocabulary lacks one of the pieces.
        """
        return [self.token_id(piece) for piece in corpus.source_pieces]

    def encode_src(self, texts: list[str]) -> list[list[int]]:
        """Source token ids, each sequence ending with eos."""
        return [ids + [EOS_ID] for ids in self.src_ids(texts)]

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        """Target token ids without bos/eos (batching adds them)."""
        return self.tgt_ids(texts)

    def id_to_piece(self, i: int, side: str = "tgt") -> str:
        """The piece of token id `i` (side "src" or "tgt")."""
        if self.vocab is not None:
            return self.vocab[i]
        return (self.src if side == "src" else self.tgt).id_to_piece(i)

    def tgt_pieces(self, ids: list[int]) -> list[str]:
        """Target pieces for display (e.g. attention plots)."""
        return [self.id_to_piece(i) for i in ids]

    def src_pieces(self, text: str) -> list[str]:
        """Source pieces of one sentence, eos included: the pieces of `src_ids` (a mark written in the text is
        spelled with ordinary pieces)."""
        return [self.id_to_piece(i, "src") for i in self.src_ids([text])[0]] + ["</s>"]

    def decode_tgt(self, ids: Iterable[int], keep_unk: bool = False) -> str:
        """Detokenized target text. Special ids are dropped; unk too unless keep_unk (then shown as ⁇)."""
        drop = {PAD_ID, BOS_ID, EOS_ID} if keep_unk else {PAD_ID, BOS_ID, EOS_ID, UNK_ID}
        kept = [i for i in ids if i not in drop]
        if self.vocab is None:
            return self.tgt.decode(kept)
        return self.tgt.decode_pieces([self.vocab[i] for i in kept])

    def to_dict(self) -> dict:
        """Plain data for a checkpoint: {"src": bytes, "tgt": bytes or None}, and "vocab" (a list of pieces) for a
        tokenizer with its own vocabulary."""
        out = {"src": self.src_proto, "tgt": self.tgt_proto}
        if self.vocab is not None:
            out["vocab"] = list(self.vocab)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Tokenizer":
        return cls(data["src"], data.get("tgt"), data.get("vocab"))

    def digest(self) -> str:
        """SHA-256 of what decides the token ids: the sentencepiece model(s) and the vocabulary, if any (a target
        model identical to the source model decides what no separate one does: the same digest)."""
        import hashlib

        digest = hashlib.sha256(self.src_proto)
        if self.tgt_proto is not None and self.tgt_proto != self.src_proto:
            digest.update(b"\0target\0" + self.tgt_proto)
        if self.vocab is not None:
            digest.update(b"\0vocab\0" + "\n".join(self.vocab).encode("utf-8"))
        return digest.hexdigest()

    def save(self, run_dir: Path, src_lang: str, tgt_lang: str) -> list[Path]:
        """Write `spm.model` (joint) or `spm.{src_lang}.model` and `spm.{tgt_lang}.model` into run_dir; a tokenizer
        with its own vocabulary writes both models and `vocab.json`."""
        if self.vocab is not None:
            files = {
                run_dir / f"spm.{src_lang}.model": self.src_proto,
                run_dir / f"spm.{tgt_lang}.model": self.tgt_proto or self.src_proto,
                run_dir / VOCAB_FILE: json.dumps({"vocab": self.vocab}, ensure_ascii=False).encode(
                    "utf-8"
                ),
            }
        elif self.is_joint:
            files = {run_dir / "spm.model": self.src_proto}
        else:
            files = {
                run_dir / f"spm.{src_lang}.model": self.src_proto,
                run_dir / f"spm.{tgt_lang}.model": self.tgt_proto,
            }
        for path, proto in files.items():
            path.write_bytes(proto)
        return list(files)

    @classmethod
    def load(
        cls, run_dir: Path, src_lang: str, tgt_lang: str, joint: bool
    ) -> Optional["Tokenizer"]:
        """The tokenizer saved in run_dir by `save`, or None if it is not there."""
        src, tgt = run_dir / f"spm.{src_lang}.model", run_dir / f"spm.{tgt_lang}.model"
        if (run_dir / VOCAB_FILE).exists():
            saved = json.loads((run_dir / VOCAB_FILE).read_text(encoding="utf-8"))
            return cls(src.read_bytes(), tgt.read_bytes(), saved["vocab"])
        if joint:
            path = run_dir / "spm.model"
            return cls(path.read_bytes()) if path.exists() else None
        return cls(src.read_bytes(), tgt.read_bytes()) if src.exists() and tgt.exists() else None


VOCAB_FILE = "vocab.json"
"""Where `Tokenizer.save` writes a tokenizer's own vocabulary in a run directory."""


SPM_MAX_SENTENCE_BYTES = 4192
"""Sentencepiece's own limit (its `max_sentence_length`, in UTF-8 bytes): longer training sentences are skipped by
sentencepiece; we count and log them (the rest of the pipeline keeps them)."""


def _train_one(
    sentences: list[str], data: DataConfig, what: str, threads: int, symbols: tuple[str, ...] = ()
) -> bytes:
    """Train one sentencepiece model in memory on all of `sentences`; returns its serialized proto. `symbols` (the
    language tokens of a multilingual run) become user-defined pieces: each is one piece, ids 4, 5, ..."""
    import io

    too_long = sum(
        len(s) * 4 > SPM_MAX_SENTENCE_BYTES and len(s.encode("utf-8")) > SPM_MAX_SENTENCE_BYTES
        for s in sentences
    )
    if too_long:
        logger.warning(
            "sentencepiece skips %d of the %d %s sentences it trains on: longer than %d bytes",
            too_long,
            len(sentences),
            what,
            SPM_MAX_SENTENCE_BYTES,
        )
    model = io.BytesIO()
    extra = {"user_defined_symbols": list(symbols)} if symbols else {}
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=data.vocab_size,
            model_type=data.spm_model_type,
            character_coverage=1.0,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=SPM_MAX_SENTENCE_BYTES,
            num_threads=threads,
            minloglevel=2,
            **extra,
        )
    except RuntimeError as err:
        match = re.search(r"<= (\d+)", str(err))
        largest = f"; the largest size that works on this data is {match.group(1)}" if match else ""
        raise TokenizerError(
            f"data.vocab_size={data.vocab_size}: sentencepiece cannot build that many pieces "
            f"from the {what} training text ({len(sentences)} sentences){largest}. "
            f"Lower data.vocab_size. (sentencepiece: {err})"
        ) from None
    return model.getvalue()


def train_tokenizer(
    src_texts: list[str],
    tgt_texts: list[str],
    data: DataConfig,
    threads: int = 2,
    symbols: tuple[str, ...] = (),
) -> Tokenizer:
    """Train sentencepiece on these sentences (a sample of the training split): one joint model, or one per language.

    Every sentence given is used (the caller samples: see `DataConfig.spm_max_sentences`); with the same sentences
    the same model comes out.

    Args:
        src_texts, tgt_texts: training sentences.
        data: vocab_size, joint_vocab, spm_model_type.
        threads: sentencepiece training threads.
        symbols: pieces the joint model must hold whole (a multilingual run's language tokens).

    Raises:
        TokenizerError: if the vocabulary size cannot be reached on this text (naming the largest that can).
    """
    if data.joint_vocab:
        logger.info(
            "training a joint %s sentencepiece model (%d pieces) on %d sentences",
            data.spm_model_type,
            data.vocab_size,
            len(src_texts) + len(tgt_texts),
        )
        what = "+".join(dict.fromkeys(lang for pair in language_pairs(data) for lang in pair))
        return Tokenizer(_train_one(src_texts + tgt_texts, data, what, threads, symbols))
    logger.info(
        "training %s sentencepiece models (%d pieces each) on %d sentences each",
        data.spm_model_type,
        data.vocab_size,
        len(src_texts),
    )
    return Tokenizer(
        _train_one(src_texts, data, data.src_lang, threads),
        _train_one(tgt_texts, data, data.tgt_lang, threads),
    )
