"""Hugging Face interoperability: MarianMT model folders in and out.

    transformer export --format huggingface --checkpoint RUN/checkpoints/best.pt --output RUN/hf
    transformer translate --checkpoint opus-mt-de-en "Ein Mann fährt Fahrrad."    # a MarianMT folder
    transformer train --config C --init-from opus-mt-de-en                         # fine-tune it

`transformers.MarianMTModel` (the Helsinki-NLP OPUS-MT models) is the paper's post-norm encoder-decoder with
scaled, shared embeddings and sinusoidal positions, as ours. It differs in three ways, each converted exactly:

1. Its position table puts the sines in the first d_model / 2 coordinates and the cosines in the second half;
   ours interleaves them (§3.5: sin at 2i, cos at 2i + 1). The two models are the same function up to a fixed
   reordering of the d_model coordinates of the residual stream (LayerNorm, residual sums and attention do not
   depend on the order of those coordinates), so export reorders the weights' d_model axes into Marian's order
   (`marian_order`) and import reorders them back. Nothing is approximated: tensors are permuted, not changed.
2. Its vocabulary puts eos at 0 and pad last, has no bos, and starts decoding with the pad token; ours fixes
   pad 0, unk 1, bos 2, eos 3 and starts with bos. Import reorders the vocabulary rows once, here, so that
   Marian's special tokens take our ids (its decoder start row becomes our bos row; pad too when they are one
   token); nothing past the import knows Marian's order. Export writes our ids as they are, with bos as the
   decoder start token, so an imported model exported again is the same function in our row order (the same
   outputs from `generate`, not the same files).
3. Its output projection has a bias (`final_logits_bias`) and OPUS-MT models use the swish activation: the config
   options `model.output_bias` and `model.activation: swish`.

The export writes `config.json` and `model.safetensors` (what `MarianMTModel.from_pretrained` reads), the tokenizer
files (`source.spm`, `target.spm`, `vocab.json`, `tokenizer_config.json`) and `generation_config.json` with the
checkpoint's decoding defaults. Our config rides along in `config.json` (key `transformer_nmt`), so a round trip
restores it. What Marian cannot express (pre-norm, two vocabularies) is refused with the reason, and so is on import
what our model cannot (unscaled embeddings, separate vocabularies, unequal encoder and decoder sizes, ...).

A multilingual model (`data.directions`) is exported with its target-language tokens (`>>fra<<`, one piece each)
in vocab.json: `transformers` code that starts a source with `>>fra<<`, as for the OPUS-MT multi-target models,
translates as `translate --tgt-lang fr` does. Importing a folder we did not export, a vocabulary with two or more
such tokens is read as a multi-target model: its languages are those of `--tgt-lang` (`>>fra<<` and `>>fr<<` -> fr,
see `config/languages.py`), with "src" as the source language, as Marian folders do not record theirs. Each
language keeps the token the vocabulary spells (`data.language_tokens`): a source starts with `>>de<<` where the
model was trained with `>>de<<`, as `MarianTokenizer` gives it, and the export writes the same pieces back.

`transformers` is not needed for any of this (the files are plain JSON, sentencepiece and safetensors); only the
`safetensors` package is: `pip install 'transformer-nmt[hf]'` (`make install` includes it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Config, ConfigError, config_from_dict
from .config.languages import language_pairs, language_token, token_language
from .files import CheckpointError, ExportError, check_replaceable, write_folder
from .model import Transformer
from .tokenizer import SPECIAL_PIECES, Tokenizer, TokenizerError

CONFIG_KEY = "transformer_nmt"
"""The key of `config.json` that holds our config in an export."""

ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}
"""Marian's `activation_function` -> our `model.activation`."""

UNKNOWN_PAIR = ("src", "tgt")
"""data.src_lang and data.tgt_lang of a MarianMT folder that we did not export: it does not record its languages."""


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ExportError(
            "safetensors is not installed: pip install 'transformer-nmt[hf]' (or safetensors)"
        ) from None
    return safetensors.torch


def is_marian_dir(path: str | Path) -> bool:
    """True for a folder as `MarianMTModel.save_pretrained` writes it (config.json with model_type "marian")."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type") == "marian"
    except (ValueError, OSError):
        return False


def marian_order(d_model: int) -> Tensor:
    """The coordinate reordering between our position table and Marian's: Marian's coordinate j is our coordinate
    `order[j]` (the sines 0, 2, 4, ... first, then the cosines 1, 3, 5, ...).

    Returns:
        `(d_model,)` LongTensor; `x[..., order]` turns our residual-stream vector x into Marian's.
    """
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _layer_names(config: Config) -> list[tuple[str, str, str]]:
    """(our name, Marian's name, kind) of every weight but the embeddings and the output projection. Kinds:
    "reads" (a linear layer from the residual stream: its input axis is reordered), "writes" (a linear layer into
    it: its output axis and bias), "norm" (a LayerNorm over it), "qkv" (our fused W^Q;W^K;W^V, read as three)."""
    names = []
    for side, n_layers in (
        ("encoder", config.model.n_encoder_layers),
        ("decoder", config.model.n_decoder_layers),
    ):
        for i in range(n_layers):
            ours, theirs = f"{side}.layers.{i}", f"model.{side}.layers.{i}"
            blocks = [("self_attn", "self_attn", "norm1", "self_attn_layer_norm")]
            if side == "decoder":
                blocks.append(("cross_attn", "encoder_attn", "norm2", "encoder_attn_layer_norm"))
            for attn, their_attn, norm, their_norm in blocks:
                names.append((f"{ours}.{attn}.in_proj", f"{theirs}.{their_attn}", "qkv"))
                names.append(
                    (f"{ours}.{attn}.out_proj", f"{theirs}.{their_attn}.out_proj", "writes")
                )
                names.append((f"{ours}.{norm}", f"{theirs}.{their_norm}", "norm"))
            ffn_norm = "norm3" if side == "decoder" else "norm2"
            names.append((f"{ours}.feed_forward.linear1", f"{theirs}.fc1", "reads"))
            names.append((f"{ours}.feed_forward.linear2", f"{theirs}.fc2", "writes"))
            names.append((f"{ours}.{ffn_norm}", f"{theirs}.final_layer_norm", "norm"))
    return names


# --------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------


def _check_exportable(config: Config, tokenizer: Tokenizer) -> None:
    m = config.model
    reasons = []
    if m.norm_first:
        reasons.append(
            "model.norm_first is true: MarianMTModel is post-norm, with no final LayerNorm"
        )
    if not m.share_all_embeddings or not tokenizer.is_joint:
        reasons.append(
            "model.share_all_embeddings is false or data.joint_vocab is false: this export writes one "
            "vocabulary shared by the encoder, the decoder and the output projection"
        )
    if not m.tie_embeddings:
        reasons.append(
            "model.tie_embeddings is false: the output projection must be the embedding matrix"
        )
    if m.d_model % 2:
        reasons.append(
            f"model.d_model={m.d_model} is odd: the position tables differ in their last coordinate"
        )
    if reasons:
        raise ExportError("cannot export as a Hugging Face Marian model: " + "; ".join(reasons))


def to_marian_state(model: Transformer, config: Config) -> dict[str, Tensor]:
    """Our weights as MarianMTModel's state dict (float32, contiguous), vocabulary rows in our id order."""
    ours = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    order = marian_order(config.model.d_model)
    d = config.model.d_model
    out = {"model.shared.weight": ours["decoder.embedding.embedding.weight"][:, order]}
    bias = ours.get("output_projection.bias")
    out["final_logits_bias"] = (torch.zeros(config.model.tgt_vocab_size) if bias is None else bias)[
        None
    ]
    for our_name, name, kind in _layer_names(config):
        weight, bias = ours[f"{our_name}.weight"], ours[f"{our_name}.bias"]
        if kind == "qkv":
            for k, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                out[f"{name}.{proj}.weight"] = weight[k * d : (k + 1) * d][:, order]
                out[f"{name}.{proj}.bias"] = bias[k * d : (k + 1) * d]
        elif kind == "reads":
            out[f"{name}.weight"], out[f"{name}.bias"] = weight[:, order], bias
        else:  # writes, norm
            out[f"{name}.weight"], out[f"{name}.bias"] = weight[order], bias[order]
    return {k: v.contiguous() for k, v in out.items()}


def marian_config(config: Config) -> dict[str, Any]:
    """The `config.json` of the export: MarianConfig's fields (our ids as they are, bos the decoder start token),
    and ours under `CONFIG_KEY`."""
    m = config.model
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": m.tgt_vocab_size,
        "decoder_vocab_size": m.tgt_vocab_size,
        "d_model": m.d_model,
        "encoder_layers": m.n_encoder_layers,
        "decoder_layers": m.n_decoder_layers,
        "encoder_attention_heads": m.n_heads,
        "decoder_attention_heads": m.n_heads,
        "encoder_ffn_dim": m.d_ff,
        "decoder_ffn_dim": m.d_ff,
        "activation_function": m.activation,
        "max_position_embeddings": m.max_positions,
        "dropout": m.dropout,
        "attention_dropout": m.attention_dropout,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "init_std": 0.02,
        "scale_embedding": True,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
        "is_encoder_decoder": True,
        "use_cache": True,
        "normalize_embedding": False,
        "static_position_embeddings": True,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "decoder_start_token_id": BOS_ID,
        "forced_eos_token_id": None,
        CONFIG_KEY: {
            "config": config.to_dict(),
            "vocab_sizes": [m.src_vocab_size, m.tgt_vocab_size],
        },
    }


def _vocabulary(tokenizer: Tokenizer) -> dict[str, int]:
    """vocab.json: each piece and its id (the first id of a piece that occurs twice)."""
    pieces: dict[str, int] = {}
    names = {PAD_ID: "<pad>", EOS_ID: "</s>", UNK_ID: "<unk>"}
    for i in range(tokenizer.tgt_vocab_size):
        pieces.setdefault(names.get(i) or tokenizer.id_to_piece(i), i)
    return pieces


def generation_config(config: Config) -> dict[str, Any]:
    """generation_config.json: our decoding defaults in `generate`'s terms. Pad and bos are never produced (as in
    our search). `generate` divides beam scores by length^α, ours by ((5 + length) / 6)^α: the same α is written."""
    d = config.decoding
    return {
        "decoder_start_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "forced_eos_token_id": None,
        "num_beams": d.beam_size,
        "length_penalty": d.length_penalty,
        "max_length": config.model.max_positions,
        "suppress_tokens": [PAD_ID, BOS_ID],
        "bad_words_ids": None,
    }


def export_huggingface(
    config: Config,
    model: Transformer,
    tokenizer: Tokenizer,
    output_dir: str | Path,
    force: bool = False,
) -> Path:
    """Write a MarianMT folder that `transformers` loads with no code of ours (see the module docstring).

    The folder is built under a temporary name and renamed into place when complete (as the CTranslate2 export).

    Args:
        config, model, tokenizer: as `checkpoint.load_for_inference` returns them (one of our checkpoints, or a
            Marian folder imported, which is then written in our vocabulary order).
        force: replace an existing output folder, if it is an earlier export or empty.

    Raises:
        ExportError: a model Marian cannot express (naming the config key),
            safetensors missing, or an output that exists (without `force`, or with it when it is something other
            than an earlier export or empty).
    """
    safetensors = _safetensors()
    output_dir = Path(output_dir)
    check_replaceable(output_dir, force, is_marian_dir, "no config.json of a Marian model")
    _check_exportable(config, tokenizer)
    state = to_marian_state(model, config)

    def write(staging: Path) -> None:
        safetensors.save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        _write_json(staging / "config.json", marian_config(config))
        _write_json(staging / "generation_config.json", generation_config(config))
        (staging / "source.spm").write_bytes(tokenizer.src_proto)
        (staging / "target.spm").write_bytes(tokenizer.tgt_proto or tokenizer.src_proto)
        _write_json(staging / "vocab.json", _vocabulary(tokenizer))
        _write_json(
            staging / "tokenizer_config.json",
            {
                "tokenizer_class": "MarianTokenizer",
                **_languages_of(config),
                "model_max_length": config.model.max_positions,
                "separate_vocabs": False,
                "unk_token": "<unk>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "bos_token": tokenizer.id_to_piece(BOS_ID),
            },
        )

    write_folder(output_dir, write)
    return output_dir


def _languages_of(config: Config) -> dict[str, str]:
    """tokenizer_config.json's source_lang and target_lang: a multilingual model's languages joined by "+" (its
    tokens, `>>fra<<`, are pieces of vocab.json: MarianTokenizer keeps one written at the start of a source whole)."""
    pairs = language_pairs(config.data)
    return {
        "source_lang": "+".join(dict.fromkeys(src for src, _ in pairs)),
        "target_lang": "+".join(dict.fromkeys(tgt for _, tgt in pairs)),
    }


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not readable JSON: {err}") from None


def _read_weights(folder: Path) -> dict[str, Tensor]:
    if (folder / "model.safetensors").is_file():
        return dict(_safetensors().load_file(str(folder / "model.safetensors")))
    if (folder / "pytorch_model.bin").is_file():
        try:
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file is one error for the user
            raise CheckpointError(f"{folder / 'pytorch_model.bin'}: not readable: {err}") from None
    raise CheckpointError(
        f"{folder}: a Marian folder without model.safetensors or pytorch_model.bin"
    )


def _our_config(folder: Path, marian: dict[str, Any], vocab: list[str]) -> Config:
    """Our Config for a MarianConfig; ConfigError naming the Marian field we cannot express."""

    def refuse(field: str, why: str) -> None:
        raise ConfigError(f"{folder / 'config.json'}: {field}={marian.get(field)!r}: {why}")

    for ours, theirs in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if marian.get(ours) != marian.get(theirs):
            refuse(
                theirs,
                f"differs from {ours}={marian.get(ours)!r}; our model has one n_heads and one d_ff",
            )
    if not marian.get("scale_embedding", False):
        refuse("scale_embedding", "our embeddings are always multiplied by sqrt(d_model) (§3.4)")
    if not marian.get("share_encoder_decoder_embeddings", True):
        refuse(
            "share_encoder_decoder_embeddings",
            "separate encoder and decoder vocabularies are not supported",
        )
    if marian.get("decoder_vocab_size") not in (None, marian.get("vocab_size")):
        refuse(
            "decoder_vocab_size",
            f"differs from vocab_size={marian.get('vocab_size')}: separate encoder and "
            "decoder vocabularies are not supported",
        )
    for field in (
        "normalize_before",
        "add_final_layer_norm",
        "normalize_embedding",
        "layernorm_embedding",
    ):
        if marian.get(field):
            refuse(field, "our model is post-norm without extra LayerNorms (as MarianMTModel)")
    if marian.get("static_position_embeddings") is False or marian.get(
        "learned_positional_embeddings"
    ):
        refuse(
            "static_position_embeddings",
            "learned position embeddings are not supported (ours are sinusoidal)",
        )
    activation = ACTIVATIONS.get(str(marian.get("activation_function")))
    if activation is None:
        refuse("activation_function", f"expected one of {', '.join(ACTIVATIONS)}")
    if marian.get("d_model", 0) % 2:
        refuse("d_model", "the position tables differ for an odd width")
    saved = marian.get(CONFIG_KEY, {}).get("config")
    raw = (
        json.loads(json.dumps(saved))
        if saved
        else {
            "data": {
                "src_lang": UNKNOWN_PAIR[0],
                "tgt_lang": UNKNOWN_PAIR[1],
                "path": str(folder),
                **_target_languages(vocab),
            },
            "decoding": {"beam_size": 4, "max_repeat": 0},
        }
    )  # as transformers' generate, which has no such limit
    vocab_size = len(vocab)
    raw["model"] = {
        "d_model": marian["d_model"],
        "n_heads": marian["encoder_attention_heads"],
        "d_ff": marian["encoder_ffn_dim"],
        "n_encoder_layers": marian["encoder_layers"],
        "n_decoder_layers": marian["decoder_layers"],
        "dropout": marian.get("dropout", 0.1),
        "attention_dropout": marian.get("attention_dropout", 0.0),
        "activation": activation,
        "norm_first": False,
        "max_positions": marian.get("max_position_embeddings", 512),
        "tie_embeddings": marian.get("tie_word_embeddings", True),
        "share_all_embeddings": True,
        "output_bias": True,
    }
    raw["data"].update(vocab_size=vocab_size, joint_vocab=True)
    return config_from_dict(raw, vocab_sizes=(vocab_size, vocab_size))


def _target_languages(vocab: list[str]) -> dict[str, Any]:
    """The data keys of a multi-target OPUS-MT vocabulary (two or more target-language tokens, `>>fra<<` or
    `>>fr<<`): `directions`, one per token in vocabulary order, and `language_tokens`, each token whose spelling is
    not ours (`>>de<<` for de), so that the model is given its own pieces and they are exported as they came. A
    vocabulary with one such token or none: {} (a model that translates into one language is not told which)."""
    tokens: dict[str, str] = {}
    for piece in vocab:
        code = token_language(piece)
        if code is not None and code != UNKNOWN_PAIR[0]:
            tokens.setdefault(code, piece)  # >>de<< and >>deu<< both there: the first names de
    if len(tokens) < 2:
        return {}
    return {
        "directions": [f"{UNKNOWN_PAIR[0]}-{code}" for code in tokens],
        "language_tokens": {code: t for code, t in tokens.items() if t != language_token(code)},
    }


def _import_vocabulary(folder: Path, marian: dict[str, Any]) -> tuple[list[str], list[int]]:
    """Our vocabulary for a Marian one: (pieces by our id, the Marian row of each of our ids). Marian's pad, unk,
    decoder start and eos rows take our special ids (`_marian_specials`); the other rows keep their order after
    them."""
    tokenizer_config = (
        _read_json(folder / "tokenizer_config.json")
        if (folder / "tokenizer_config.json").is_file()
        else {}
    )
    if tokenizer_config.get("separate_vocabs") or (folder / "target_vocab.json").is_file():
        raise ConfigError(
            f"{folder / 'tokenizer_config.json'}: separate_vocabs=True: separate source and target "
            "vocabularies are not supported"
        )
    vocab = _read_json(folder / "vocab.json")
    size = marian["vocab_size"]
    pieces = [f"<unused{i}>" for i in range(size)]
    for piece, i in sorted(
        vocab.items(), key=lambda item: -item[1]
    ):  # the smallest id of a piece wins
        if not 0 <= i < size:
            raise ConfigError(
                f"{folder / 'vocab.json'}: id {i} of {piece!r} is outside vocab_size={size}"
            )
        pieces[i] = piece
    unk_piece = tokenizer_config.get("unk_token", "<unk>")
    unk_piece = unk_piece.get("content", "<unk>") if isinstance(unk_piece, dict) else unk_piece
    if unk_piece not in vocab:
        raise ConfigError(f"{folder / 'vocab.json'}: no unknown-token piece {unk_piece!r}")
    specials = _marian_specials(folder, marian, vocab[unk_piece])
    rest = [i for i in range(size) if i not in specials]
    return list(SPECIAL_PIECES) + [pieces[i] for i in rest], specials + rest


def _marian_specials(folder: Path, marian: dict[str, Any], unk: int) -> list[int]:
    """The Marian rows of our pad, unk, bos (Marian's decoder start token) and eos, in our id order."""
    size = marian["vocab_size"]
    pad, eos = marian.get("pad_token_id"), marian.get("eos_token_id")
    start = marian.get("decoder_start_token_id", pad)
    start = pad if start is None else start
    for name, value in (
        ("pad_token_id", pad),
        ("eos_token_id", eos),
        ("decoder_start_token_id", start),
    ):
        if not isinstance(value, int) or not 0 <= value < size:
            raise ConfigError(
                f"{folder / 'config.json'}: {name}={value!r}: expected a token id below {size}"
            )
    if len({pad, unk, eos}) < 3 or start in (eos, unk):
        raise ConfigError(
            f"{folder / 'config.json'}: pad, eos, unk and the decoder start token need distinct ids "
            f"(got pad {pad}, eos {eos}, unk {unk}, start {start})"
        )
    return [pad, unk, start, eos]


def load_marian(
    path: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[Config, Transformer, Tokenizer]:
    """A MarianMT folder as our config, model (eval mode) and tokenizer (see the module docstring).

    Raises:
        ConfigError: the Marian model uses something our model cannot express (naming its config field).
        CheckpointError: missing or unreadable files, or weights that do not fit the config.
    """
    folder = Path(path)
    marian = _read_json(folder / "config.json")
    for name in ("source.spm", "vocab.json"):
        if not (folder / name).is_file():
            raise CheckpointError(
                f"{folder}: a Marian folder without {name} (the tokenizer files, as "
                "MarianTokenizer.save_pretrained writes them)"
            )
    vocab, rows = _import_vocabulary(folder, marian)
    config = _our_config(folder, marian, vocab)
    src = (folder / "source.spm").read_bytes()
    tgt = (folder / "target.spm").read_bytes() if (folder / "target.spm").is_file() else src
    try:
        tokenizer = Tokenizer(src, None if tgt == src else tgt, vocab)
    except (TokenizerError, RuntimeError) as err:
        raise CheckpointError(f"{folder}: unreadable tokenizer files: {err}") from None
    weights = _read_weights(folder)
    model = Transformer(config.model)
    try:
        model.load_state_dict(from_marian_state(weights, config, rows))
    except (KeyError, RuntimeError) as err:
        raise CheckpointError(f"{folder}: the weights do not fit its config.json: {err}") from None
    return config, model.to(map_location).eval(), tokenizer


def from_marian_state(
    weights: dict[str, Tensor], config: Config, rows: list[int]
) -> dict[str, Tensor]:
    """MarianMTModel's state dict as ours (the inverse of `to_marian_state`).

    Args:
        rows: the Marian row of each of our token ids.
    """
    d = config.model.d_model
    back = torch.argsort(marian_order(d))  # Marian's coordinate of each of ours
    index = torch.tensor(rows)
    embedding = weights.get("model.shared.weight")
    if embedding is None:
        embedding = weights["model.decoder.embed_tokens.weight"]
    embedding = embedding.float()[index][:, back]
    out = {
        "encoder.embedding.embedding.weight": embedding,
        "decoder.embedding.embedding.weight": embedding,
    }
    if config.model.tie_embeddings:
        out["output_projection.weight"] = embedding
    else:
        out["output_projection.weight"] = weights["lm_head.weight"].float()[index][:, back]
    bias = weights.get("final_logits_bias")
    out["output_projection.bias"] = (
        torch.zeros(len(rows)) if bias is None else bias.float().reshape(-1)[index]
    )
    for our_name, name, kind in _layer_names(config):
        if kind == "qkv":
            out[f"{our_name}.weight"] = torch.cat(
                [
                    weights[f"{name}.{p}.weight"].float()[:, back]
                    for p in ("q_proj", "k_proj", "v_proj")
                ]
            )
            out[f"{our_name}.bias"] = torch.cat(
                [weights[f"{name}.{p}.bias"].float() for p in ("q_proj", "k_proj", "v_proj")]
            )
        elif kind == "reads":
            out[f"{our_name}.weight"] = weights[f"{name}.weight"].float()[:, back]
            out[f"{our_name}.bias"] = weights[f"{name}.bias"].float()
        else:
            out[f"{our_name}.weight"] = weights[f"{name}.weight"].float()[back]
            out[f"{our_name}.bias"] = weights[f"{name}.bias"].float()[back]
    return out
