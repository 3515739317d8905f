"""The CTranslate2 engine: a folder written by `transformer export --format ctranslate2` (`ct2.py`), decoded by
CTranslate2's own C++ decoder.

Sampling and n-gram blocking are CTranslate2's own (`sampling_topk`, `sampling_topp`, `sampling_temperature`,
`no_repeat_ngram_size`: the same meaning); `max_repeat` is given to it as sequences it must not generate. Its random
generators are seeded when a model loads, so a call that samples reloads the model after
`ctranslate2.set_random_seed(seed)`: the same call gives the same samples, but a line's samples depend on its batch
(ours do not).

Decoding differences, none of which shows on ordinary sentences: CTranslate2's beam search ranks hypotheses by
log-probability / length^α where ours uses GNMT's ((5 + length) / 6)^α (§6.1 reference); its length cap is one
number per batch, so a batch runs to the largest of its sentences' caps (max_len_a * src_len + max_len_b) and each
output is then cut at its own (exact for greedy decoding; for beam search the cut hypothesis may rank differently).
Scores, when asked for, are ours: the hypotheses are scored again (`score_batch`) and divided by the GNMT penalty,
so a beam's hypotheses are ranked as ours are. The parity test checks greedy output equal on >= 99% of
test_2016_flickr lines and BLEU within 0.1 (beam 4: within 0.2).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch

from ..config import Config, DecodingConfig, OptionError, config_from_dict
from ..ct2 import METADATA, ctranslate2_module
from ..decoding import Hypothesis, gnmt_length_penalty, max_output_length
from ..model import Transformer
from ..tokenizer import SPECIAL_PIECES, Tokenizer
from .base import SourceBatch
from .pytorch import check_workers

logger = logging.getLogger(__name__)


class CTranslate2Engine:
    """An exported CTranslate2 model (the `Engine` protocol).

    Args:
        path: a folder written by `export_ctranslate2`.
        device: "cpu" or "cuda" ("auto": cuda if CTranslate2 sees a GPU).
        threads: CPU threads (0: CTranslate2's default).
        workers: batches decoded at once (CTranslate2's `inter_threads`), each on threads / workers threads
            (torch's thread count when `threads` is 0).

    Raises:
        ExportError: ctranslate2 is not installed.
        OptionError: a device other than cpu or cuda; workers < 1.
    """

    name = "ctranslate2"
    attention_model: Optional[Transformer] = None
    parameters: Optional[int] = None
    quantization: Optional[str] = None
    compile = False

    def __init__(self, path: str | Path, device: str = "cpu", threads: int = 0, workers: int = 1) -> None:
        check_workers(workers)
        ct2 = ctranslate2_module()
        path = Path(path)
        metadata = json.loads((path / METADATA).read_text())
        self.config: Config = config_from_dict(metadata["config"], vocab_sizes=tuple(metadata["vocab_sizes"]))
        protos = [(path / name).read_bytes() for name in metadata["sentencepiece"]]
        self.tokenizer = Tokenizer(protos[0], protos[1] if len(protos) > 1 else None, metadata.get("vocab"),
                                   metadata.get("export_order"))
        if device == "auto":
            device = "cuda" if ct2.get_cuda_device_count() else "cpu"
        if device.split(":")[0] not in ("cpu", "cuda"):
            raise OptionError("{device}: a CTranslate2 model runs on cpu or cuda", device=device)
        self.device, self.workers = device, workers
        index = int(device.split(":")[1]) if ":" in device else 0
        if workers > 1:
            threads = max(1, (threads or torch.get_num_threads()) // workers)
        self._open = lambda: ct2.Translator(str(path), device=device.split(":")[0], device_index=index,
                                            intra_threads=threads, inter_threads=workers)
        self.model = self._open()
        self.max_source_len = self.config.model.max_positions  # eos included: CTranslate2 adds it
        self._runs: list[list[str]] = []
        self._runs_of = 0  # the max_repeat that _runs is for
        self._told_length_penalty = False  # warned once that beam search ranks differently

    def warm_up(self) -> float:
        """Nothing to prepare: 0 seconds."""
        return 0.0

    def search(self, batches: list[SourceBatch], options: DecodingConfig, scores: bool) -> list[list[list[Hypothesis]]]:
        """`Engine.search` through `ctranslate2.Translator.translate_batch`, one call per batch."""
        if options.beam_size > 1 and options.length_penalty > 0 and not self._told_length_penalty:
            self._told_length_penalty = True
            logger.warning("CTranslate2 ranks beam hypotheses by log-probability / |Y|^%g, our decoder by / ((5 + |Y|) "
                           "/ 6)^%g: beam outputs differ from the .pt checkpoint's on some sentences (measured in "
                           "docs/decoding.md, CTranslate2 export)", options.length_penalty, options.length_penalty)
        if options.sampling and batches:  # CTranslate2 seeds its threads' generators when it loads a model: reload
            ctranslate2_module().set_random_seed(options.seed)
            self.model = self._open()
        return [self._search(batch, options, scores) for batch in batches]

    def _search(self, batch: SourceBatch, options: DecodingConfig, scores: bool) -> list[list[Hypothesis]]:
        tokenizer = self.tokenizer
        source = [[tokenizer.id_to_piece(t, "src") for t in ids[:-1]] for ids in batch.src_ids]  # it adds the eos
        caps = [max_output_length(len(ids), options.max_len_a, options.max_len_b, self.config.model.max_positions)
                for ids in batch.src_ids]
        targets = None if batch.prefixes is None else [
            None if p is None else [tokenizer.id_to_piece(t) for t in p] for p in batch.prefixes]
        sampling = dict(sampling_topk=options.top_k, sampling_topp=options.top_p,
                        sampling_temperature=options.temperature) if options.sampling else {}
        out = self.model.translate_batch(
            source, beam_size=options.beam_size,
            length_penalty=options.length_penalty if options.beam_size > 1 else 0.0,
            num_hypotheses=options.n_best, max_decoding_length=max(caps), min_decoding_length=options.min_len,
            no_repeat_ngram_size=options.no_repeat_ngram_size, return_scores=False,
            max_batch_size=options.batch_size, target_prefix=targets,
            suppress_sequences=self._long_runs(options.max_repeat), **sampling)
        # One cap per batch in CTranslate2: each output is cut at its own sentence's cap, as ours are. As in our
        # search, a hypothesis is finished when it ended with eos within its cap: fewer than `cap` pieces.
        pieces = [[h[:cap] for h in result.hypotheses] for cap, result in zip(caps, out)]
        finished = [[len(h) < cap for h in sentence] for cap, sentence in zip(caps, pieces)]
        hyp_scores = (self._scores(source, pieces, finished, options) if scores
                      else [[float("nan")] * len(h) for h in pieces])
        found = [[Hypothesis(tokenizer.piece_ids(h), score, done) for h, score, done in zip(*sentence)]
                 for sentence in zip(pieces, hyp_scores, finished)]
        if scores and not options.sampling:  # a beam's hypotheses ranked by our scores, finished first
            for hyps in found:
                hyps.sort(key=lambda h: (not h.finished, -h.score))
        return found

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
