"""Text in, text out: tokenize, batch, decode, detokenize. The Python API is `Translator`.

    from transformer import Translator
    translator = Translator.from_checkpoint("runs/multi30k_de_en/checkpoints/best.pt", device="cpu")
    translator.translate(["Ein Mann fährt Fahrrad."])            # -> ["A man is riding a bike."]

Guarantees: one output per input, in input order; empty or whitespace-only inputs give empty outputs; an
input longer than the model's max_positions is truncated with a warning (counted in `stats`); text the source
vocabulary cannot represent is copied into the output once, unchanged (`passthrough.py`; `copy_unknown`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from .checkpoint import load_for_inference
from .config import BOS_ID, EOS_ID, Config, DecodingConfig, OptionError
from .data import make_batch
from .decoding import Hypothesis, beam_search, greedy_decode
from .decoding.alignment import align_words
from .decoding.ensemble import EnsembleDecoder
from .decoding.options import decoding_options, distinct_first, n_best_search, warn_length_cap
from .decoding.sampling import sample_decode
from .device import resolve_device
from .fast import decoder_for
from .hf import UNKNOWN_PAIR
from .model import Transformer
from .passthrough import PassThrough, with_passthrough
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# torch's intra-op thread count is one setting for the whole process: decoding with workers > 1 lowers it for the
# duration of the call, and this lock keeps two such calls (from two threads, two Translators) from interleaving
# their save and restore, which would leave the process on the lowered count.
_THREAD_COUNT_LOCK = threading.Lock()


@dataclass
class TranslationStats:
    """Counts of the last call (`translate`, `translate_n_best` or `decode_ids`) only: sentences, truncated
    inputs, outputs cut at the length cap, output tokens (eos excluded), sentences with text copied through
    untranslated (`transformer/passthrough.py`)."""

    n_sentences: int = 0
    n_truncated: int = 0
    n_hit_max_len: int = 0
    n_output_tokens: int = 0
    n_copied_unknown: int = 0


class Translator:
    """A trained model with its tokenizer and decoding defaults.

    Args:
        model: the Transformer (moved to `device`, put in eval mode); kept as `model`, the readable model.
        tokenizer: its sentencepiece models.
        config: the run's config (decoding defaults come from `config.decoding`).
        device: where to decode.
        quantization: None (float32, as trained) or "int8": linear layers int8 dynamically quantized (CPU only).
        workers: batches decoded at once (CPU only), each in its own thread on torch's thread count divided
            by `workers` (at least 1), which `decode_ids` sets for the duration of the call and then restores.
            That count is process-wide: calls with workers > 1 from several threads take turns, and a one-worker
            call running beside one of them decodes on the lowered count. The outputs are the same.
        compile: decode with the incremental step compiled by torch.compile (`fast.CompiledDecoder`): compiled
            at the first greedy batch and the first beam search (or by `warm_up`); the same tokens. CPU only; not
            with int8 or workers > 1.

    The searches run on `decoder`: `fast.decoder_for(model, quantization, compile)`, the CPU speed paths of
    `transformer/fast/` on the CPU and the model itself elsewhere.

    Raises:
        OptionError: naming the parameters: an unknown quantization, int8 on a device other than the CPU, or int8
            unavailable in this PyTorch build; workers < 1, or workers > 1 on a device other than the CPU;
            compile with int8, with workers > 1 or on a device other than the CPU.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: Config,
                 device: torch.device | str = "cpu", quantization: Optional[str] = None, workers: int = 1,
                 compile: bool = False) -> None:
        self.device = torch.device(device)
        check_workers(workers)
        if workers > 1 and self.device.type != "cpu":
            raise OptionError(f"{{workers}} decodes on the CPU only, not on {self.device}", workers=workers)
        if compile and workers > 1:  # compiled kernels keep the thread count they were compiled for
            raise OptionError("{compile} decodes with one worker (on every thread), not {workers}", compile=True,
                              workers=workers)
        self.workers = workers
        self._warned_oversubscribed = False
        self.model = model.to(self.device).eval()
        self.num_parameters = self.model.num_parameters()
        self.decoder = decoder_for(self.model, quantization, compile)
        self.members = [self.model]  # the models decoding together (more than one: `from_checkpoints`)
        self.quantization = quantization
        self.compile = compile
        self.tokenizer = tokenizer
        self._passthrough = PassThrough(tokenizer)
        self.config = config
        self.stats = TranslationStats()

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "cpu", quantization: Optional[str] = None,
                        workers: int = 1, compile: bool = False) -> "Translator":
        """Rebuild model, tokenizer and config from one checkpoint file (whatever device trained it).

        Raises:
            CheckpointError: the file is missing, corrupt or unsafe.
            DeviceError: the device is not available.
            OptionError: as `Translator`, for the quantization, workers and compile.
        """
        resolved = resolve_device(device)
        config, model, tokenizer = load_for_inference(path)
        return cls(model, tokenizer, config, resolved, quantization=quantization, workers=workers, compile=compile)

    @classmethod
    def from_checkpoints(cls, paths: list[str | Path], device: str = "cpu", quantization: Optional[str] = None,
                         workers: int = 1) -> "Translator":
        """An ensemble (`decoding/ensemble.py`) of the checkpoints, or `from_checkpoint` for one. The first one's
        config gives the decoding defaults and `model` (attention plots).

        Raises:
            CheckpointError: a file is missing, corrupt or unsafe.
            OptionError: the checkpoints' tokenizers or vocabularies, or their language pairs (data.src_lang,
                data.tgt_lang), differ (naming both files); as `Translator`.
        """
        if len(paths) == 1:
            return cls.from_checkpoint(paths[0], device, quantization, workers)
        loaded = [load_for_inference(path) for path in paths]
        first, data = loaded[0][2].digest(), loaded[0][0].data
        for path, (config, _, tokenizer) in zip(paths[1:], loaded[1:]):
            if tokenizer.digest() != first:
                raise OptionError(f"an ensemble needs one tokenizer and vocabulary: {paths[0]} and {path} have "
                                  "different ones")
            pairs = {(config.data.src_lang, config.data.tgt_lang), (data.src_lang, data.tgt_lang)}
            if len(pairs) > 1 and UNKNOWN_PAIR not in pairs:
                raise OptionError(f"an ensemble translates one language pair: {paths[0]} is {data.src_lang}->"
                                  f"{data.tgt_lang}, {path} {config.data.src_lang}->{config.data.tgt_lang}")
        config, model, tokenizer = loaded[0]
        translator = cls(model, tokenizer, config, resolve_device(device), quantization=quantization,
                         workers=workers)
        translator.members = [m.to(translator.device).eval() for _, m, _ in loaded]
        translator.decoder = EnsembleDecoder([translator.decoder] + [decoder_for(m, quantization, False)
                                                                     for m in translator.members[1:]])
        return translator

    def warm_up(self) -> float:
        """With `compile=True`, compile now what would otherwise compile at the first greedy batch and the first beam
        search (20-60 s each): decode three short sentences both ways, three steps at least. For a server, whose
        first requests should not wait for it (`transformer serve --compile`). Without compile it does nothing.

        Returns:
            The seconds it took.
        """
        start = time.perf_counter()
        if self.compile:
            # Any ids: the sizes matter. Sizes that coincide here (sentences, source length, beams times sentences)
            # can be taken as equal by the compiler, which then compiles again for sizes where they differ.
            batch = make_batch([[5, 6, 7, 8, EOS_ID], [8, EOS_ID], [9, 10, EOS_ID]]).to(self.device)
            for beam_size in (1, 2):
                options = self.decoding_options(beam_size=beam_size, n_best=1, min_len=3, max_len_a=0.0,
                                                max_len_b=4)
                with torch.no_grad():
                    self._decode_batch(batch.src, batch.src_key_padding_mask, options, scores=False)
        return time.perf_counter() - start

    def decoding_options(self, **overrides: Optional[float]) -> DecodingConfig:
        """The config's decoding section with the given (non-None) overrides, validated
        (`decoding/options.py: decoding_options`).

        Raises:
            ConfigError: an option out of range (e.g. n_best > beam_size), or a sampling option without sampling.
        """
        return decoding_options(self.config.decoding, **overrides)

    def translate(self, sentences: list[str], prefixes: Optional[list[Optional[str]]] = None,
                  **options: Any) -> list[str]:
        """Translate sentences; unset options take the config's `decoding` defaults.

        Args:
            prefixes: per sentence, the text its translation must start with (None or "": free); see
                `translate_n_best`.
            options: any of `DecodingConfig`'s fields but n_best (beam_size, length_penalty, batch_size, max_len_a,
                max_len_b, min_len, no_repeat_ngram_size, max_repeat, sampling, top_k, top_p, temperature, seed,
                copy_unknown).

        Returns:
            One detokenized string per input, in input order (with sampling: the first sample).
        """
        return [hyps[0][0] for hyps in self.translate_n_best(sentences, n_best=1, scores=False, prefixes=prefixes,
                                                             **options)]

    def translate_n_best(self, sentences: list[str], n_best: Optional[int] = None, scores: bool = True,
                         prefixes: Optional[list[Optional[str]]] = None,
                         **options: Any) -> list[list[tuple[str, float]]]:
        """Translate sentences and return the n best (text, score) pairs of each, best first; with sampling, n_best
        independent samples in the order drawn, each scored by the model's log-probability of its tokens.

        Beam search's n-best texts are distinct where its beam found that many distinct texts (`distinct_first`:
        two piece sequences can spell the same text, e.g. `▁truck` and `▁tr u ck` after BPE-dropout training):
        distinct texts come first, best first, then any repeats; samples are independent draws and may repeat.

        With scores=False greedy decoding (beam_size 1) skips the log-softmax and reports NaN scores (see
        `decode_ids`); beam search and sampling compute them anyway.

        Args:
            prefixes: per sentence, a target prefix (None or "": none): its pieces are produced first, with the
                model's scores (part of each hypothesis' score), then decoding goes on freely; the text returned
                starts with it.
            options: as `translate`.

        Raises:
            ConfigError: an option is out of range (e.g. n_best > beam_size), or a sampling option is given
                without sampling.
            OptionError: an unknown option, or prefixes not one per sentence.
        """
        options = self.decoding_options(n_best=n_best, **options)
        if prefixes is not None and len(prefixes) != len(sentences):
            raise OptionError(f"prefixes: one per sentence ({len(sentences)}), got {len(prefixes)}")
        prefix_ids = None if prefixes is None else [self.tokenizer.encode_tgt([p])[0] if p and p.strip() else None
                                                    for p in prefixes]

        searched, distinct = n_best_search(options)

        def translate(texts: list[str], ids: list[list[int]]) -> list[list[tuple[str, float]]]:
            src_ids, n_truncated = self._with_eos(texts, ids)
            hypotheses = self.decode_ids(src_ids, searched, scores=scores, prefix_ids=prefix_ids)
            self.stats.n_truncated = n_truncated
            outputs = [[(self.tokenizer.decode_tgt(h.tokens), h) for h in hyps] for hyps in hypotheses]
            if distinct:
                outputs = [[out[i] for i in distinct_first([t for t, _ in out], options.n_best,
                                                           [h.finished for _, h in out])] for out in outputs]
            return [[(text, h.score) for text, h in out] for out in outputs]

        results, n_copied = with_passthrough(self._passthrough, sentences, prefixes, translate, options.copy_unknown,
                                             self.align)
        self.stats.n_copied_unknown = n_copied
        return results

    @torch.no_grad()
    def align(self, sentences: list[str], translations: list[str], layer: int = -1,
              head: Optional[int] = None) -> list[list[tuple[int, int]]]:
        """Word alignments of each (sentence, translation) pair from the encoder-decoder attention of the readable
        model (`decoding/alignment.py`): the translation is tokenized and fed teacher-forced, so any target text can
        be aligned, not only our own output.

        Args:
            layer: the decoder layer (default: the last).
            head: one head, or None for the mean of the layer's heads.

        Returns:
            Per pair, sorted (source word, target word) index pairs over whitespace words (0-based).

        Raises:
            OptionError: a layer or head the model does not have, or lists of different lengths.
        """
        n_layers, n_heads = self.model.config.n_decoder_layers, self.model.config.n_heads
        if not -n_layers <= layer < n_layers or (head is not None and not 0 <= head < n_heads):
            raise OptionError(f"alignment layer {layer} / head {head}: the model has {n_layers} decoder layers and "
                              f"{n_heads} heads")
        if len(sentences) != len(translations):
            raise OptionError(f"{len(sentences)} sentences but {len(translations)} translations to align")
        limit = self.model.config.max_positions
        out = []
        for sentence, translation in zip(sentences, translations):
            src_ids = self.tokenizer.encode_src([sentence.strip()])[0][-limit:]
            tgt_ids = self.tokenizer.encode_tgt([translation.strip()])[0][: limit - 1]
            if len(src_ids) < 2 or not tgt_ids:
                out.append([])
                continue
            src = torch.tensor([src_ids], device=self.device)
            tgt_in = torch.tensor([[BOS_ID] + tgt_ids], device=self.device)
            _, weights = self.model.forward_with_attention(src, tgt_in)
            cross = weights.cross[layer][0]  # (n_heads, tgt_len + 1, src_len)
            cross = cross.mean(0) if head is None else cross[head]
            src_pieces = [self.tokenizer.id_to_piece(i, "src") for i in src_ids[:-1]]
            # row k is the position that produces target piece k (its input: bos, then the pieces before it)
            out.append(align_words(cross.cpu(), src_pieces, self.tokenizer.tgt_pieces(tgt_ids)))
        return out

    def _with_eos(self, texts: list[str], ids: list[list[int]]) -> tuple[list[Optional[list[int]]], int]:
        """Per stripped sentence and its source ids (`Tokenizer.src_ids`), the ids with eos (None for an empty
        sentence), truncated to max_positions with a warning; and the number truncated."""
        n_truncated = 0
        limit = self.decoder.config.max_positions
        out: list[Optional[list[int]]] = []
        for i, (text, sentence_ids) in enumerate(zip(texts, ids)):
            if not text:
                out.append(None)
                continue
            if len(sentence_ids) + 1 > limit:
                logger.warning("input %d has %d tokens, more than the model's max_positions=%d: truncated",
                               i + 1, len(sentence_ids) + 1, limit)
                n_truncated += 1
                sentence_ids = sentence_ids[:limit - 1]
            out.append(sentence_ids + [EOS_ID])
        return out, n_truncated

    @torch.no_grad()
    def decode_ids(self, src_ids: list[Optional[list[int]]], options: DecodingConfig, scores: bool = True,
                   prefix_ids: Optional[list[Optional[list[int]]]] = None) -> list[list[Hypothesis]]:
        """Decode source id sequences in batches of similar length; a None input gives `options.n_best` empty
        hypotheses (score 0).

        Args:
            src_ids: per sentence, source ids ending in eos (or None for an empty input).
            options: decoding settings (see `decoding_options`).
            scores: compute greedy hypotheses' log-probabilities; False skips the per-step log-softmax over the
                vocabulary (same tokens, `Hypothesis.score` NaN), as CTranslate2 does unless asked for scores.
            prefix_ids: per sentence, forced target tokens (or None).

        Returns:
            Per input, `options.n_best` hypotheses, best first.
        """
        self.stats = TranslationStats(n_sentences=len(src_ids))
        results: list[list[Hypothesis]] = [[Hypothesis([], 0.0, True)] * options.n_best for _ in src_ids]
        order = sorted((i for i, ids in enumerate(src_ids) if ids is not None), key=lambda i: -len(src_ids[i]))
        chunks = _sentence_batches(order, [len(ids) if ids else 0 for ids in src_ids], options)

        def decode_chunk(chunk: list[int]) -> list[list[Hypothesis]]:
            with torch.no_grad():  # grad mode is per thread: a worker thread needs its own
                batch = make_batch([src_ids[i] for i in chunk]).to(self.device)
                prefixes = None if prefix_ids is None else [prefix_ids[i] for i in chunk]
                return self._decode_batch(batch.src, batch.src_key_padding_mask, options, scores, prefixes)

        if self.workers > 1 and len(chunks) > 1:
            with _THREAD_COUNT_LOCK:  # concurrent multi-worker calls take turns (see the lock's comment)
                threads = torch.get_num_threads()
                if self.workers > threads and not self._warned_oversubscribed:
                    logger.warning("--workers %d with %d CPU threads: each worker gets one thread, so %d threads "
                                   "share %d; --workers %d or fewer decodes without oversubscription", self.workers,
                                   threads, self.workers, threads, threads)
                    self._warned_oversubscribed = True
                torch.set_num_threads(max(1, threads // self.workers))
                try:  # longest batches first, each to the next free worker; results come back in batch order
                    with ThreadPoolExecutor(self.workers) as pool:
                        decoded_chunks = list(pool.map(decode_chunk, chunks))
                finally:
                    torch.set_num_threads(threads)
        else:
            decoded_chunks = [decode_chunk(chunk) for chunk in chunks]
        for chunk, decoded in zip(chunks, decoded_chunks):
            for i, hyps in zip(chunk, decoded):
                results[i] = hyps
        for hyps in results:
            self.stats.n_hit_max_len += not hyps[0].finished
            self.stats.n_output_tokens += len(hyps[0].tokens)
        warn_length_cap(self.stats.n_hit_max_len, len(src_ids), options)
        return results

    def _decode_batch(self, src: torch.Tensor, mask: torch.Tensor, options: DecodingConfig, scores: bool,
                      prefixes: Optional[list[Optional[list[int]]]] = None) -> list[list[Hypothesis]]:
        o = options
        if o.sampling:
            return sample_decode(self.decoder, src, mask, o.n_best, o.top_k, o.top_p, o.temperature, o.seed,
                                 o.max_len_a, o.max_len_b, o.min_len, o.no_repeat_ngram_size, prefixes, o.max_repeat)
        if o.beam_size == 1:
            hyps = greedy_decode(self.decoder, src, mask, o.max_len_a, o.max_len_b, o.min_len, scores=scores,
                                 no_repeat_ngram_size=o.no_repeat_ngram_size, prefixes=prefixes,
                                 max_repeat=o.max_repeat)
            return [[h] for h in hyps]
        return beam_search(self.decoder, src, mask, o.beam_size, o.length_penalty, o.n_best, o.max_len_a,
                           o.max_len_b, o.min_len, o.no_repeat_ngram_size, prefixes, o.max_repeat)


def check_workers(workers: int) -> None:
    """Raises OptionError unless `workers` (batches decoded at once) is at least 1."""
    if workers < 1:
        raise OptionError("{workers}: must be at least 1", workers=workers)


def _sentence_batches(order: list[int], lengths: list[int], options: DecodingConfig) -> list[list[int]]:
    """Cut `order` (sorted longest first) into batches of at most batch_size sentences and, if
    max_tokens_per_batch is set, at most that many padded source tokens."""
    batches: list[list[int]] = [[]]
    for i in order:
        batch = batches[-1]
        too_many_tokens = (options.max_tokens_per_batch and batch
                           and (len(batch) + 1) * lengths[batch[0]] > options.max_tokens_per_batch)
        if len(batch) == options.batch_size or too_many_tokens:
            batches.append([])
        batches[-1].append(i)
    return [b for b in batches if b]
