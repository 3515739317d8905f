"""Deployment through CTranslate2: export a checkpoint with CTranslate2's own converter API.

    transformer export --checkpoint RUN/checkpoints/best.pt --format ctranslate2 --output RUN/ct2 [--quantization int8]
    transformer translate --checkpoint RUN/ct2 "Ein Mann fährt Fahrrad."      # same flags and outputs

The export builds a `ctranslate2.specs.TransformerSpec` (post- or pre-norm as trained, ReLU or GELU, embeddings
scaled by sqrt(d_model), our sinusoidal table given explicitly because CTranslate2's built-in one orders sin and cos
differently, fused Q/K/V as our `in_proj`, the tied output projection) and lets CTranslate2 validate, quantize and
save it. Beside CTranslate2's `model.bin` and vocabularies go our sentencepiece model(s) and `transformer_nmt.json`
(the checkpoint's config), so the folder is a complete model for `translate`, `evaluate` and other CTranslate2 users
(`config.json` says add_source_eos: give it sentencepiece pieces).

The folder is decoded by `engines/ctranslate2.py` (`CTranslate2Engine`), which says how CTranslate2's decoding differs
from ours.

`ctranslate2` is an optional dependency: `pip install 'transformer-nmt[ct2]'` (`make install` includes it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .config import Config
from .files import ExportError, check_replaceable, write_folder
from .tokenizer import Tokenizer

METADATA = "transformer_nmt.json"
QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16", "float32")


def ctranslate2_module() -> Any:
    """The `ctranslate2` package (ExportError naming the pip command when it is not installed)."""
    try:
        import ctranslate2
    except ImportError:
        raise ExportError(
            "CTranslate2 is not installed: pip install 'transformer-nmt[ct2]' (or ctranslate2>=4.5)"
        ) from None
    return ctranslate2


def is_ctranslate2_dir(path: str | Path) -> bool:
    """True for a folder written by `export_ctranslate2`."""
    return (
        Path(path).is_dir()
        and (Path(path) / "model.bin").is_file()
        and (Path(path) / METADATA).is_file()
    )


def _vocabulary(tokenizer: Tokenizer, side: str) -> list[str]:
    size = tokenizer.src_vocab_size if side == "src" else tokenizer.tgt_vocab_size
    pieces = [tokenizer.id_to_piece(i, side) for i in range(size)]
    pieces[0] = "<blank>"  # CTranslate2's padding token (our pad id 0)
    return pieces


def _build_spec(config: Config, model: Any, tokenizer: Tokenizer) -> Any:
    """The `TransformerSpec` of our model, weights filled in (as float32 numpy arrays)."""
    from ctranslate2.specs import common_spec, transformer_spec

    m = config.model
    activation = {
        "relu": common_spec.Activation.RELU,
        "gelu": common_spec.Activation.GELU,
        "swish": common_spec.Activation.SWISH,
    }[m.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (m.n_encoder_layers, m.n_decoder_layers),
        m.n_heads,
        pre_norm=m.norm_first,
        activation=activation,
    )
    weights = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    d = m.d_model

    def linear(target: Any, prefix: str, rows: Optional[slice] = None) -> None:
        rows = rows or slice(None)
        target.weight = weights[f"{prefix}.weight"][rows]
        if f"{prefix}.bias" in weights:
            target.bias = weights[f"{prefix}.bias"][rows]

    def norm(target: Any, prefix: str) -> None:
        target.gamma, target.beta = weights[f"{prefix}.weight"], weights[f"{prefix}.bias"]

    def ffn(target: Any, prefix: str, norm_name: str) -> None:
        norm(target.layer_norm, f"{prefix}.{norm_name}")
        linear(target.linear_0, f"{prefix}.feed_forward.linear1")
        linear(target.linear_1, f"{prefix}.feed_forward.linear2")

    table = model.encoder.positional_encoding.table.float().cpu().numpy()
    for side, stack in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        embedding = stack.embeddings[0] if side == "encoder" else stack.embeddings
        embedding.weight = weights[f"{side}.embedding.embedding.weight"]
        stack.scale_embeddings = True  # times sqrt(d_model), as TokenEmbedding does
        stack.position_encodings.encodings = table
        if m.norm_first:
            norm(stack.layer_norm, f"{side}.final_norm")
    for i, layer in enumerate(spec.encoder.layer):
        prefix = f"encoder.layers.{i}"
        linear(layer.self_attention.linear[0], f"{prefix}.self_attn.in_proj")
        linear(layer.self_attention.linear[1], f"{prefix}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{prefix}.norm1")
        ffn(layer.ffn, prefix, "norm2")
    for i, layer in enumerate(spec.decoder.layer):
        prefix = f"decoder.layers.{i}"
        linear(layer.self_attention.linear[0], f"{prefix}.self_attn.in_proj")
        linear(layer.self_attention.linear[1], f"{prefix}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{prefix}.norm1")
        linear(layer.attention.linear[0], f"{prefix}.cross_attn.in_proj", slice(0, d))
        linear(layer.attention.linear[1], f"{prefix}.cross_attn.in_proj", slice(d, 3 * d))
        linear(layer.attention.linear[2], f"{prefix}.cross_attn.out_proj")
        norm(layer.attention.layer_norm, f"{prefix}.norm2")
        ffn(layer.ffn, prefix, "norm3")
    linear(spec.decoder.projection, "output_projection")
    spec.register_source_vocabulary(_vocabulary(tokenizer, "src"))
    spec.register_target_vocabulary(_vocabulary(tokenizer, "tgt"))
    spec.config.add_source_eos = True
    spec.config.layer_norm_epsilon = 1e-5  # torch.nn.LayerNorm's
    return spec


def export_ctranslate2(
    config: Config,
    model: Any,
    tokenizer: Tokenizer,
    output_dir: str | Path,
    quantization: Optional[str] = None,
    force: bool = False,
    origin: str = "",
) -> Path:
    """Convert a loaded model (`engines.load_model`) to a CTranslate2 model folder (see the module docstring).

    The folder is written beside its destination under a temporary name and renamed into place when complete, so
    a failed conversion leaves no partial folder and, with `force`, the earlier export intact.

    Args:
        config, model, tokenizer: the model to export, as `engines.load_model` returns it.
        output_dir: the folder to write.
        quantization: weight type, one of `QUANTIZATIONS` (None: float32).
        force: replace an existing output folder, if it is an earlier export (`is_ctranslate2_dir`) or empty;
            any other folder or file is never deleted.
        origin: what the metadata records as the model's origin (the checkpoint's path).

    Raises:
        ExportError: ctranslate2 missing, a bad quantization, the output exists
            without `force`, or with `force` is something other than an earlier export or an empty folder.
    """
    ct2 = ctranslate2_module()
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ExportError(
            f"--quantization {quantization!r}: expected one of {', '.join(QUANTIZATIONS)}"
        )
    output_dir = Path(output_dir)
    _check_replaceable(output_dir, force)
    spec = _build_spec(config, model, tokenizer)

    class _Converter(ct2.converters.Converter):
        def _load(self) -> Any:
            return spec

    def write(staging: Path) -> None:
        _Converter().convert(str(staging), quantization=quantization, force=True)
        files = tokenizer.save(staging, config.data.src_lang, config.data.tgt_lang)
        metadata = {
            "config": config.to_dict(),
            "vocab_sizes": [config.model.src_vocab_size, config.model.tgt_vocab_size],
            "checkpoint": origin,
            "quantization": quantization or "float32",
            "sentencepiece": [f.name for f in files if f.suffix == ".model"],
            "vocab": tokenizer.vocab,
        }
        (staging / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")

    write_folder(output_dir, write)
    return output_dir


def _check_replaceable(output_dir: Path, force: bool) -> None:
    """Refuse an existing output unless `force` and it is an earlier export or an empty folder (ExportError)."""
    check_replaceable(output_dir, force, is_ctranslate2_dir, f"no model.bin and {METADATA}")


__all__ = ["ExportError", "export_ctranslate2", "is_ctranslate2_dir"]
