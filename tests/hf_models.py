"""Tiny Hugging Face Marian models built locally (no network): a sentencepiece model trained on a few hundred
synthetic lines, a Marian-style vocabulary (eos 0, unk 1, pad last, a target-language token) and random weights."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import sentencepiece as spm
import torch

WORDS = ("ein mann eine frau hund katze läuft spielt auf dem der die das im park strand wasser ball rot blau "
         "zwei kinder sitzt steht vor haus straße fahrrad springt über schnell klein groß grün gelb").split()


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(n)]


def marian_spm(seed: int = 0, vocab_size: int = 60) -> bytes:
    """A sentencepiece model as Marian's: its own ids (unk 0, bos 1, eos 2; no pad), which the vocabulary remaps."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences(400, seed)), model_writer=model,
                                   vocab_size=vocab_size, model_type="unigram", character_coverage=1.0,
                                   minloglevel=2)
    return model.getvalue()


def write_marian(folder: Path, seed: int = 0, decoder_start_is_pad: bool = True, weight_std: float = 0.3,
                 languages: tuple[str, ...] = ("fra",), **config) -> Path:
    """A MarianMTModel folder with random weights (std 0.3 by default, so that the output distributions are peaked;
    0: transformers' own initialisation) and a random final_logits_bias, saved by `transformers` itself, with its
    MarianTokenizer files. Its vocabulary holds a target-language token (`>>fra<<`) per code of `languages` (two
    or more: a multi-target model, as opus-mt-en-ROMANCE)."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    proto = marian_spm(seed)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    pieces = [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]
    vocab = {"</s>": 0, "<unk>": 1, **{f">>{code}<<": 2 + i for i, code in enumerate(languages)}}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)
    (folder / "source.spm").write_bytes(proto)
    (folder / "target.spm").write_bytes(proto)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    size = len(vocab)
    settings = dict(vocab_size=size, decoder_vocab_size=size, d_model=16, encoder_layers=2, decoder_layers=2,
                    encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                    max_position_embeddings=64, activation_function="swish", scale_embedding=True,
                    pad_token_id=size - 1, eos_token_id=0, forced_eos_token_id=None,
                    decoder_start_token_id=size - 1 if decoder_start_is_pad else 2)
    settings.update(config)
    torch.manual_seed(seed)
    model = MarianMTModel(MarianConfig(**settings)).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters() if weight_std else ():
            tensor.normal_(0.0, weight_std) if "layer_norm" not in name else tensor.normal_(1.0, 0.1)
        model.final_logits_bias.normal_(0.0, 0.5)
        model.final_logits_bias[0, 0] += 3.0  # eos: some outputs end before the length cap
    model.generation_config.max_length = 64
    model.generation_config.bad_words_ids = [[size - 1]]  # as the OPUS-MT models: pad is never produced
    model.save_pretrained(folder)
    MarianTokenizer(str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json"),
                    source_lang="de", target_lang="en").save_pretrained(folder)
    return folder


def write_our_checkpoint(path: Path, seed: int = 0, **model_changes) -> Path:
    """One of our checkpoints (random weights, a sentencepiece model trained on synthetic lines) at `path`."""
    from transformer.checkpoint import save_checkpoint
    from transformer.config import DataConfig, config_from_dict
    from transformer.model import Transformer
    from transformer.tokenizer import train_tokenizer

    data = DataConfig(src_lang="de", tgt_lang="en", path=str(path.parent), vocab_size=60, spm_model_type="unigram")
    tokenizer = train_tokenizer(sentences(400, seed), sentences(400, seed + 1), data)
    model = dict(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=2, max_positions=64,
                 share_all_embeddings=True, **model_changes)
    config = config_from_dict({"model": model, "data": {"src_lang": "de", "tgt_lang": "en", "path": str(path.parent),
                                                         "vocab_size": 60, "spm_model_type": "unigram"}},
                              vocab_sizes=(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size))
    torch.manual_seed(seed)
    transformer = Transformer(config.model)
    with torch.no_grad():
        for name, tensor in transformer.named_parameters():
            if "norm" in name:
                tensor.normal_(1.0, 0.1)
            else:
                tensor.normal_(0.0, 0.3)
    save_checkpoint({"model": transformer.state_dict(), "config": config.to_dict(),
                     "vocab_sizes": [config.model.src_vocab_size, config.model.tgt_vocab_size],
                     "tokenizer": tokenizer.to_dict()}, path)
    return path
