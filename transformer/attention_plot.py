"""See the attention: heatmaps (or JSON) of encoder self-, decoder self- and encoder-decoder attention.

    transformer attention --checkpoint CKPT "Eine Frau spielt Gitarre." --out attention.png

The sentence is translated, then the (float32) model is run once more over its own output through the explicit
attention path (`Transformer.forward_with_attention`). Teacher-forcing the model's own output reproduces the
attention of the incremental decoder (cached decoding equals the full pass, to float rounding; tested), so these
are the weights the model used to translate (with `--quantization int8`, those of the float32 model it was
quantized from).

The translation is greedy unless options say otherwise (`attention_options`: the same default for
`transformer attention` and the server's /attention). A sentence longer than the model's max_positions is
truncated as translation truncates it (`translate.source_within`): the weights index the part translated.

JSON format (`--format json`), n = n_heads, S = source pieces (eos included), T = target pieces + 1:
    translation      the output text
    truncated        true when only the sentence's start was translated (S = max_positions)
    src_pieces       S labels; tgt_in_pieces: T labels ("<s>" + output pieces); tgt_out_pieces: T labels
                     (output pieces + "</s>", or + "(cut)" for a translation cut at the length cap, which
                     produced no eos): position t reads tgt_in[t] and predicts tgt_out[t]
    encoder_self     [n_encoder_layers][n][S][S]   (query source position, key source position)
    decoder_self     [n_decoder_layers][n][T][T]   (query target position, key target position); zero above
                     the diagonal
    cross            [n_decoder_layers][n][T][S]   (query target position, key source position)
Every row sums to 1.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from .config import BOS_ID, OptionError
from .request import ResolvedOptions, TranslationRequest, WrittenSentence, read_sentences
from .translate import Translator, source_within

logger = logging.getLogger(__name__)

KINDS = ("cross", "encoder_self", "decoder_self")
TITLES = {
    "cross": "encoder-decoder attention",
    "encoder_self": "encoder self-attention",
    "decoder_self": "decoder self-attention",
}


class AttentionPlotError(OptionError):
    """A bad layer, head, kind or output suffix (named as parameters; the CLI spells them as flags), or matplotlib
    missing."""


CUT = "(cut)"
"""The last label of tgt_out_pieces for a translation cut at the length cap: its last position produced no eos."""

ATTENTION_SEARCH = {"beam_size": 1}
"""What the translation shown differs in from the config's decoding defaults, unless options say otherwise."""


def attention_options(
    translator: Translator,
    options: Optional[dict[str, Any]] = None,
    sentence: Optional[str | WrittenSentence] = None,
) -> ResolvedOptions:
    """The decoding of the translation whose attention is shown: the given options (`DecodingConfig` fields; None
    values unset) over greedy search (beam_size 1) and the config's other defaults; one hypothesis. Without a
    tgt_lang, a language token written at the start of `sentence` names the language.

    Raises:
        ConfigError: an option out of range, or a tgt_lang the model lacks.
    """
    given = {k: v for k, v in (options or {}).items() if v is not None}
    sentences = [sentence] if sentence is not None else None
    return translator.resolve_options(sentences, **{**ATTENTION_SEARCH, **given, "n_best": 1})


def attention_for(
    translator: Translator, sentence: str, options: Optional[ResolvedOptions] = None
) -> dict:
    """Translate one sentence and collect every attention weight, as described in the module docstring.

    Args:
        translator: the model.
        sentence: one source sentence.
        options: decoding of the translation (default: `attention_options(translator, sentence=sentence)`,
            greedy); the best
            hypothesis is used whatever its n_best.

    Returns:
        A dict with the JSON fields; weights as nested lists of floats.

    Raises:
        AttentionPlotError: the translator's engine has no attention to read (CTranslate2).
        WrittenLanguageError (a ConfigError): the sentence starts with another language's token than tgt_lang.
    """
    read = read_sentences([sentence])  # a written >>fra<< read once
    options = options or attention_options(translator, sentence=read[0])
    return request_attention(translator, translator.request(read, options))


def request_attention(translator: Translator, request: TranslationRequest) -> dict:
    """`attention_for` of a resolved request's first sentence (`Translator.request`): the server's /attention.

    Raises:
        AttentionPlotError: the translator's engine has no attention to read (CTranslate2).
    """
    model = translator.engine.attention_model
    if model is None:
        raise AttentionPlotError(
            f"attention needs our own model (a .pt checkpoint or a MarianMT folder); a "
            f"{translator.engine.name} model has no attention to read"
        )
    tokenizer, options = translator.tokenizer, request.options
    marks = list(options.source_prefix)  # a multilingual model's target-language token
    src_ids, truncated = source_within(marks + request.ids[0], translator.engine.max_source_len)
    hyp = translator.decode_ids([src_ids], options.decoding)[0][0]
    text = tokenizer.decode_tgt(hyp.tokens)
    device = next(model.parameters()).device
    src = torch.tensor([src_ids], device=device)
    tgt_in = torch.tensor([[BOS_ID] + hyp.tokens], device=device)
    with torch.no_grad():
        _, weights = model.forward_with_attention(src, tgt_in)
    return {
        "translation": text,
        "truncated": truncated,
        "src_pieces": (
            [tokenizer.id_to_piece(i, "src") for i in marks]
            + tokenizer.src_pieces(request.sentences[0].strip())
        )[: len(src_ids) - 1]
        + ["</s>"],
        "tgt_in_pieces": ["<s>"] + tokenizer.tgt_pieces(hyp.tokens),
        "tgt_out_pieces": tokenizer.tgt_pieces(hyp.tokens) + ["</s>" if hyp.finished else CUT],
        **{kind: _to_lists(getattr(weights, kind)) for kind in KINDS},
    }


def _to_lists(layers: list[torch.Tensor]) -> list:
    return [w[0].float().cpu().tolist() for w in layers]  # each (n_heads, q_len, k_len)


def _labels(data: dict, kind: str) -> tuple[list[str], list[str]]:
    """(row labels, column labels) for one kind of attention."""
    if kind == "encoder_self":
        return data["src_pieces"], data["src_pieces"]
    if kind == "decoder_self":
        return data["tgt_in_pieces"], data["tgt_in_pieces"]
    return data["tgt_out_pieces"], data["src_pieces"]


def save_plot(
    data: dict, out: Path, layer: int, head: Optional[int], kinds: tuple[str, ...]
) -> None:
    """Draw heatmaps: one row per kind; every head of `layer` plus their average, or only `head`.

    Raises:
        AttentionPlotError: if matplotlib is not installed, or layer/head is out of range.
    """
    try:
        from matplotlib.figure import (
            Figure,
        )  # not pyplot: the caller's backend (a notebook's inline one) is kept
    except ImportError:
        raise AttentionPlotError(
            "plotting needs matplotlib: pip install 'transformer-nmt[viz]' "
            "(or pip install matplotlib), or use --format json"
        ) from None
    n_heads = len(data["cross"][0])
    columns = [head] if head is not None else list(range(n_heads)) + ["mean"]
    fig = Figure(figsize=(2.8 * len(columns) + 1, 2.9 * len(kinds) + 0.5))
    axes = fig.subplots(len(kinds), len(columns), squeeze=False)
    for r, kind in enumerate(kinds):
        rows, cols = _labels(data, kind)
        n_layers = len(data[kind])
        if not -n_layers <= layer < n_layers:
            raise AttentionPlotError(
                f"{{layer}}: the model has {n_layers} layers of {TITLES[kind]}", layer=layer
            )
        layer_weights = torch.tensor(data[kind][layer])  # (n_heads, q_len, k_len)
        for c, which in enumerate(columns):
            matrix = layer_weights.mean(0) if which == "mean" else layer_weights[which]
            ax = axes[r][c]
            ax.imshow(matrix.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=6)
            ax.set_yticks(range(len(rows)), rows, fontsize=6)
            label = "mean of heads" if which == "mean" else f"head {which}"
            ax.set_title(f"{TITLES[kind]}\nlayer {layer % n_layers}, {label}", fontsize=7)
    fig.suptitle(
        f"{' '.join(data['src_pieces'][:-1]).replace('▁', ' ').strip()}  →  {data['translation']}",
        fontsize=8,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)


def run(
    checkpoint: str,
    sentence: str,
    out: str,
    layer: int = -1,
    head: Optional[int] = None,
    kind: str = "all",
    fmt: Optional[str] = None,
    options: Optional[dict[str, Any]] = None,
    device: str = "cpu",
) -> Path:
    """The `transformer attention` command: write a PNG/SVG/PDF (by suffix) or, with fmt="json", JSON.

    Args:
        options: decoding options of the translation shown (`DecodingConfig` fields; default: greedy).

    Raises:
        AttentionPlotError: an empty sentence, bad kind/layer/head, an unknown image suffix, matplotlib missing, or
            a model without attention to read (a CTranslate2 folder).
        CheckpointError: unreadable checkpoint.
        ConfigError: a decoding option out of range.
    """
    if not sentence.strip():
        raise AttentionPlotError("the sentence is empty: there is no attention to show")
    translator = Translator.from_checkpoint(checkpoint, device=device)
    if translator.engine.attention_model is None:
        raise AttentionPlotError(
            f"{checkpoint}: attention needs our own model (a .pt checkpoint or a MarianMT "
            "folder); a CTranslate2 folder has no attention to read"
        )
    n_heads = translator.engine.attention_model.config.n_heads
    if head is not None and not 0 <= head < n_heads:
        raise AttentionPlotError(f"{{head}}: the model has heads 0..{n_heads - 1}", head=head)
    kinds = KINDS if kind == "all" else (kind,)
    if kind != "all" and kind not in KINDS:
        raise AttentionPlotError(f"{{kind}}: expected all, {', '.join(KINDS)}", kind=kind)
    out_path = Path(out)
    fmt = fmt or ("json" if out_path.suffix == ".json" else "image")
    if fmt == "image" and out_path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise AttentionPlotError(
            "{out}: the suffix must be .png, .svg or .pdf (or use --format json)", out=out
        )
    data = attention_for(translator, sentence, attention_options(translator, options, sentence))
    if data["truncated"]:
        logger.warning(
            "the sentence is longer than the model's max_positions=%d tokens: its first %d translated and "
            "shown",
            translator.engine.max_source_len,
            translator.engine.max_source_len - 1,
        )
    if fmt == "json":
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(data))
    else:
        save_plot(data, out_path, layer, head, kinds)
    return out_path
