"""Deployment through CTranslate2: export a checkpoint with CTranslate2's own converter API, and translate with it.

    transformer export --checkpoint RUN/checkpoints/best.pt --format ctranslate2 --output RUN/ct2 [--quantization int8]
    transformer translate --checkpoint RUN/ct2 "Ein Mann fährt Fahrrad."      # same flags and outputs

The export builds a `ctranslate2.specs.TransformerSpec` (post- or pre-norm as trained, ReLU or GELU, embeddings
scaled by sqrt(d_model), our sinusoidal table given explicitly because CTranslate2's built-in one orders sin and cos
differently, fused Q/K/V as our `in_proj`, the tied output projection) and lets CTranslate2 validate, quantize and
save it. Beside CTranslate2's `model.bin` and vocabularies go our sentencepiece model(s) and `transformer_nmt.json`
(the checkpoint's config), so the folder is a complete model for `translate`, `evaluate` and other CTranslate2 users
(`config.json` says add_source_eos: give it sentencepiece pieces).

Sampling and n-gram blocking are CTranslate2's own (`sampling_topk`, `sampling_topp`, `sampling_temperature`,
`no_repeat_ngram_size`: the same meaning). Its random generators are seeded when a model loads, so each sampling
call reloads the model after `ctranslate2.set_random_seed(seed)`: the same call gives the same samples, but a line's
samples depend on its batch (ours do not).

Decoding differences, none of which shows on ordinary sentences: CTranslate2's beam search divides scores by
length^α where ours uses GNMT's ((5 + length) / 6)^α (§6.1 reference); its length cap is one number per batch, so
a batch runs to the largest of its sentences' caps (max_len_a * src_len + max_len_b) and each output is then cut at
its own (exact for greedy decoding; for beam search the cut hypothesis may rank differently). The parity test checks
greedy output equal on ≥ 99% of test_2016_flickr lines and BLEU within 0.1 (beam 4: within 0.2).

`ctranslate2` is an optional dependency: `pip install 'transformer-nmt[ct2]'` (`make install` includes it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from .checkpoint import load_for_inference
from .config import Config, DecodingConfig, OptionError, config_from_dict
from .decoding import max_output_length
from .decoding.beam import gnmt_length_penalty
from .decoding.options import decoding_options, distinct_first, n_best_search, warn_length_cap
from .files import ExportError, check_replaceable, write_folder
from .passthrough import PassThrough, with_passthrough
from .tokenizer import SPECIAL_PIECES, Tokenizer
from .translate import check_workers

logger = logging.getLogger(__name__)

METADATA = "transformer_nmt.json"
QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16", "float32")


def _ctranslate2() -> Any:
    try:
        import ctranslate2
    except ImportError:
        raise ExportError("CTranslate2 is not installed: pip install 'transformer-nmt[ct2]' "
                          "(or ctranslate2>=4.5)") from None
    return ctranslate2


def is_ctranslate2_dir(path: str | Path) -> bool:
    """True for a folder written by `export_ctranslate2`."""
    return Path(path).is_dir() and (Path(path) / "model.bin").is_file() and (Path(path) / METADATA).is_file()


def _vocabulary(tokenizer: Tokenizer, side: str) -> list[str]:
    size = tokenizer.src_vocab_size if side == "src" else tokenizer.tgt_vocab_size
    pieces = [tokenizer.id_to_piece(i, side) for i in range(size)]
    pieces[0] = "<blank>"  # CTranslate2's padding token (our pad id 0)
    return pieces


def _build_spec(config: Config, model: Any, tokenizer: Tokenizer) -> Any:
    """The `TransformerSpec` of our model, weights filled in (as float32 numpy arrays)."""
    from ctranslate2.specs import common_spec, transformer_spec

    m = config.model
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
                  "swish": common_spec.Activation.SWISH}[m.activation]
    spec = transformer_spec.TransformerSpec.from_config((m.n_encoder_layers, m.n_decoder_layers), m.n_heads,
                                                        pre_norm=m.norm_first, activation=activation)
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


def export_ctranslate2(checkpoint: str | Path, output_dir: str | Path, quantization: Optional[str] = None,
                       force: bool = False) -> Path:
    """Convert a checkpoint to a CTranslate2 model folder (see the module docstring).

    The folder is written beside its destination under a temporary name and renamed into place when complete, so
    a failed conversion leaves no partial folder and, with `force`, the earlier export intact.

    Args:
        quantization: weight type, one of `QUANTIZATIONS` (None: float32).
        force: replace an existing output folder, if it is an earlier export (`is_ctranslate2_dir`) or empty;
            any other folder or file is never deleted.

    Raises:
        ExportError: ctranslate2 missing, a bad quantization, the output exists without `force`, or with `force`
            is something other than an earlier export or an empty folder.
        CheckpointError: the checkpoint cannot be read.
    """
    ct2 = _ctranslate2()
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ExportError(f"--quantization {quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
    output_dir = Path(output_dir)
    _check_replaceable(output_dir, force)
    config, model, tokenizer = load_for_inference(checkpoint)
    spec = _build_spec(config, model, tokenizer)

    class _Converter(ct2.converters.Converter):
        def _load(self) -> Any:
            return spec

    def write(staging: Path) -> None:
        _Converter().convert(str(staging), quantization=quantization, force=True)
        files = tokenizer.save(staging, config.data.src_lang, config.data.tgt_lang)
        metadata = {"config": config.to_dict(),
                    "vocab_sizes": [config.model.src_vocab_size, config.model.tgt_vocab_size],
                    "checkpoint": str(checkpoint), "quantization": quantization or "float32",
                    "sentencepiece": [f.name for f in files if f.suffix == ".model"],
                    "vocab": tokenizer.vocab, "export_order": tokenizer.export_order}
        (staging / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")

    write_folder(output_dir, write)
    return output_dir


def _check_replaceable(output_dir: Path, force: bool) -> None:
    """Refuse an existing output unless `force` and it is an earlier export or an empty folder (ExportError)."""
    check_replaceable(output_dir, force, is_ctranslate2_dir, f"no model.bin and {METADATA}")


class CTranslate2Translator:
    """The `Translator` interface (`translate`, `translate_n_best`, `decoding_options`, `config`, `tokenizer`)
    on an exported CTranslate2 model.

    Args:
        path: a folder written by `export_ctranslate2`.
        device: "cpu" or "cuda" ("auto": cuda if CTranslate2 sees a GPU).
        threads: CPU threads (0: CTranslate2's default).
        workers: batches decoded at once (CTranslate2's `inter_threads`), each on threads / workers threads
            (torch's thread count when `threads` is 0).
    """

    def __init__(self, path: str | Path, device: str = "cpu", threads: int = 0, workers: int = 1) -> None:
        check_workers(workers)
        ct2 = _ctranslate2()
        path = Path(path)
        metadata = json.loads((path / METADATA).read_text())
        self.config = config_from_dict(metadata["config"], vocab_sizes=tuple(metadata["vocab_sizes"]))
        names = metadata["sentencepiece"]
        protos = [(path / name).read_bytes() for name in names]
        self.tokenizer = Tokenizer(protos[0], protos[1] if len(protos) > 1 else None, metadata.get("vocab"),
                                   metadata.get("export_order"))
        if device == "auto":
            device = "cuda" if ct2.get_cuda_device_count() else "cpu"
        if device.split(":")[0] not in ("cpu", "cuda"):
            raise OptionError("{device}: a CTranslate2 model runs on cpu or cuda", device=device)
        index = int(device.split(":")[1]) if ":" in device else 0
        if workers > 1:
            threads = max(1, (threads or torch.get_num_threads()) // workers)
        self._open = lambda: ct2.Translator(str(path), device=device.split(":")[0], device_index=index,
                                            intra_threads=threads, inter_threads=workers)
        self.model = self._open()
        self._passthrough = PassThrough(self.tokenizer)
        self._runs: list[list[str]] = []
        self._runs_of = 0  # the max_repeat that _runs is for
        self._told_length_penalty = False  # warned once that beam search ranks differently

    def decoding_options(self, **overrides: Any) -> DecodingConfig:
        """The config's decoding section with the given (non-None) overrides, validated (as `Translator`'s)."""
        return decoding_options(self.config.decoding, **overrides)

    def translate(self, sentences: list[str], prefixes: Optional[list[Optional[str]]] = None,
                  **options: Any) -> list[str]:
        return [hyps[0][0] for hyps in self.translate_n_best(sentences, n_best=1, scores=False, prefixes=prefixes,
                                                             **options)]

    def translate_n_best(self, sentences: list[str], n_best: Optional[int] = None, scores: bool = True,
                         prefixes: Optional[list[Optional[str]]] = None,
                         **options: Any) -> list[list[tuple[str, float]]]:
        """Per sentence, the n best (text, score) pairs, best first with distinct texts first as `Translator`'s
        (empty input: one empty output); with scores=False CTranslate2 does not compute them and each score is NaN.
        `prefixes`: as `Translator`'s (CTranslate2's target_prefix). Text the vocabulary lacks is copied through as
        by `Translator`, at its relative position (`transformer/passthrough.py`)."""
        opts = self.decoding_options(n_best=n_best, **options)
        if prefixes is not None and len(prefixes) != len(sentences):
            raise OptionError(f"prefixes: one per sentence ({len(sentences)}), got {len(prefixes)}")
        if opts.beam_size > 1 and opts.length_penalty > 0 and not self._told_length_penalty:
            self._told_length_penalty = True
            logger.warning("CTranslate2 ranks beam hypotheses by log-probability / |Y|^%g, our decoder by / ((5 + |Y|) "
                           "/ 6)^%g: beam outputs differ from the .pt checkpoint's on some sentences (measured in "
                           "docs/decoding.md, CTranslate2 export)", opts.length_penalty, opts.length_penalty)
        # no attention to align with: copied spans go back at their relative positions
        return with_passthrough(self._passthrough, sentences, prefixes,
                                lambda texts, ids: self._translate_n_best(texts, ids, opts, scores, prefixes),
                                opts.copy_unknown)[0]

    def _translate_n_best(self, texts: list[str], ids: list[list[int]], opts: DecodingConfig, scores: bool,
                          prefixes: Optional[list[Optional[str]]]) -> list[list[tuple[str, float]]]:
        """`translate_n_best` of stripped sentences and their source ids (`Tokenizer.src_ids`)."""
        results: list[list[tuple[str, float]]] = [[("", 0.0)] * opts.n_best for _ in texts]
        searched, distinct = n_best_search(opts)  # beam search's n-best: distinct texts first, as `Translator`'s
        kept = [i for i, t in enumerate(texts) if t]
        limit = self.config.model.max_positions - 1  # source pieces before the eos CTranslate2 adds
        tokenizer = self.tokenizer
        pieces = {i: [tokenizer.id_to_piece(t, "src") for t in ids[i][:limit]] for i in kept}
        targets = {i: [tokenizer.id_to_piece(t) for t in tokenizer.tgt_ids([prefixes[i]])[0]]
                   if prefixes is not None and prefixes[i] and prefixes[i].strip() else None for i in kept}
        order = sorted(kept, key=lambda i: -len(pieces[i]))  # longest first, like `Translator`
        n_hit = 0  # best outputs cut at the length cap
        if opts.sampling and kept:  # CTranslate2 seeds its threads' generators when it loads a model: reload, seeded
            _ctranslate2().set_random_seed(opts.seed)
            self.model = self._open()
        for start in range(0, len(order), opts.batch_size):
            chunk = order[start:start + opts.batch_size]
            source = [pieces[i] for i in chunk]
            caps = [max_output_length(len(p) + 1, opts.max_len_a, opts.max_len_b, self.config.model.max_positions)
                    for p in source]
            sampling = dict(sampling_topk=opts.top_k, sampling_topp=opts.top_p,
                            sampling_temperature=opts.temperature) if opts.sampling else {}
            out = self.model.translate_batch(
                source, beam_size=opts.beam_size, length_penalty=opts.length_penalty if opts.beam_size > 1 else 0.0,
                num_hypotheses=searched.n_best, max_decoding_length=max(caps), min_decoding_length=opts.min_len,
                no_repeat_ngram_size=opts.no_repeat_ngram_size, return_scores=False, max_batch_size=opts.batch_size,
                target_prefix=[targets[i] for i in chunk] if prefixes is not None else None,
                suppress_sequences=self._long_runs(opts.max_repeat), **sampling)
            # One cap per batch in CTranslate2: each output is cut at its own sentence's cap, as ours are. As in our
            # search, a hypothesis is finished when it ended with eos within its cap: fewer than `cap` pieces.
            hyps = [[h[:cap] for h in result.hypotheses] for cap, result in zip(caps, out)]
            finished = [[len(h) < cap for h in sentence] for cap, sentence in zip(caps, hyps)]
            hyp_scores = (self._scores(source, hyps, finished, opts) if scores
                          else [[float("nan")] * len(h) for h in hyps])
            for i, sentence, done, sentence_scores in zip(chunk, hyps, finished, hyp_scores):
                found = [(tokenizer.decode_tgt(tokenizer.piece_ids(h)), score, f)
                         for h, score, f in zip(sentence, sentence_scores, done)]
                if distinct:  # as `Translator`'s: by our scores, finished first, then distinct texts first
                    if scores:
                        found.sort(key=lambda hyp: (not hyp[2], -hyp[1]))
                    found = [found[j] for j in distinct_first([t for t, _, _ in found], opts.n_best,
                                                              [f for _, _, f in found])]
                results[i] = [(text, score) for text, score, _ in found]
                n_hit += not found[0][2]
        warn_length_cap(n_hit, len(texts), opts)
        return results

    def _long_runs(self, max_repeat: int) -> Optional[list[list[str]]]:
        """decoding.max_repeat for CTranslate2: every target piece (but the special ones) max_repeat + 1 times in
        a row, as sequences it must not generate; None for no limit."""
        if not max_repeat:
            return None
        if self._runs_of != max_repeat:
            vocab = range(len(SPECIAL_PIECES), self.tokenizer.tgt_vocab_size)
            self._runs = [[self.tokenizer.id_to_piece(i)] * (max_repeat + 1) for i in vocab]
            self._runs_of = max_repeat
        return self._runs

    def _scores(self, source: list[list[str]], hyps: list[list[list[str]]], finished: list[list[bool]],
                options: DecodingConfig) -> list[list[float]]:
        """Our score of each hypothesis (as `Hypothesis.score`): the sum of its tokens' log-probabilities, eos
        included for a finished one (not for one cut at the length cap), divided by the GNMT length penalty
        ((5 + |Y|) / 6)^α in beam search (`decoding/beam.py`; |Y| counts the eos when there is one). CTranslate2's
        own scores divide by |Y|^α instead, so the tokens are scored again (`score_batch`, which always scores an
        eos after them)."""
        pairs = [(src, h) for src, sentence_hyps in zip(source, hyps) for h in sentence_hyps]
        scored = self.model.score_batch([src for src, _ in pairs], [h for _, h in pairs],
                                        max_batch_size=options.batch_size)
        ends = [f for sentence in finished for f in sentence]
        log_probs = [r.log_probs if end else r.log_probs[:-1] for r, end in zip(scored, ends)]
        flat = [sum(lp) / (gnmt_length_penalty(len(lp), options.length_penalty) if options.beam_size > 1 else 1.0)
                for lp in log_probs]
        it = iter(flat)
        return [[next(it) for _ in sentence_hyps] for sentence_hyps in hyps]


def open_translator(checkpoint: str | Path | list[str | Path], device: str = "cpu",
                    quantization: Optional[str] = None, workers: int = 1, compile: bool = False) -> Any:
    """A `Translator` for a checkpoint file (an ensemble for several), or a `CTranslate2Translator` for an exported
    folder.

    Raises:
        OptionError: a quantization for a CTranslate2 folder (its weight type was chosen by `transformer export`), or
            compile (ours only, one model); a CTranslate2 folder in an ensemble.
    """
    if isinstance(checkpoint, (list, tuple)) and len(checkpoint) == 1:
        checkpoint = checkpoint[0]
    if isinstance(checkpoint, (list, tuple)):
        from .translate import Translator

        folders = [str(path) for path in checkpoint if is_ctranslate2_dir(path)]
        if folders:
            raise OptionError(f"an ensemble is of our checkpoints: {folders[0]} is a CTranslate2 folder (CTranslate2 "
                              "decodes one model)")
        if compile:
            raise OptionError("{compile} compiles one model's decoder, not an ensemble", compile=True)
        return Translator.from_checkpoints(list(checkpoint), device=device, quantization=quantization,
                                           workers=workers)
    if is_ctranslate2_dir(checkpoint):
        if compile:
            raise OptionError(f"{{compile}} compiles our own decoder; {checkpoint} is a CTranslate2 folder, "
                              "which decodes with CTranslate2's own decoder", compile=True)
        if quantization:
            raise OptionError(f"{{quantization}}: {checkpoint} is a CTranslate2 folder, whose weight type "
                              "is chosen when exporting (transformer export --quantization ...)",
                              quantization=quantization)
        return CTranslate2Translator(checkpoint, device=device, workers=workers)
    from .translate import Translator
    return Translator.from_checkpoint(checkpoint, device=device, quantization=quantization, workers=workers,
                                      compile=compile)


__all__ = ["CTranslate2Translator", "ExportError", "export_ctranslate2", "is_ctranslate2_dir", "open_translator"]
