"""The CTranslate2 engine: a folder written by `transformer export --format ctranslate2` (`ct2.py`), decoded by
CTranslate2's own C++ decoder.

Sampling and n-gram blocking are CTranslate2's own (`sampling_topk`, `sampling_topp`, `sampling_temperature`,
`no_repeat_ngram_size`: the same meaning); `max_repeat` is given to it as sequences it must not generate. Its random
generators are seeded when a model loads, so a call that samples reloads the model after
`ctranslate2.set_random_seed(seed)`: the same call gives the same samples, but a line's samples depend on its batch
and on how many are drawn (ours do not). top_k 1 draws the greedy output (CTranslate2 decodes it greedily, once).

Beam search: CTranslate2 searches (and prunes) by its own ranking, log-probability / |Y|^α; the search always
returns its whole beam, which is then ranked as ours ranks its hypotheses: finished ones first, by log-probability /
((5 + |Y|) / 6)^α (GNMT's penalty, §6.1 reference), then those cut at the length cap (`_rank_as_ours`). So the 1-best
output is the first of every n-best list, whatever n_best, and is ours wherever the two searches kept the same
hypotheses. Scores, when asked for, are the model's log-probabilities, scored again (`score_batch`): the same
number as the .pt checkpoint gives the same hypothesis.

Decoding differences that remain: the hypotheses CTranslate2's search keeps (its pruning by |Y|^α; with
no_repeat_ngram_size its log-probabilities are renormalised over the tokens not blocked, ours are not); its length
cap is one number per batch, so a batch runs to the largest of its sentences' caps (max_len_a * src_len +
max_len_b) and each output is then cut at its own (exact for greedy decoding; for beam search the hypotheses cut
differ from the live ones ours keeps at the cap). The parity test checks greedy output equal on >= 99% of
test_2016_flickr lines and BLEU within 0.1 (beam 4: within 0.2).
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Optional

import torch

from ..config import Config, DecodingConfig, OptionError, config_from_dict
from ..config.languages import reserved_pieces
from ..ct2 import METADATA, ctranslate2_module
from ..decoding import Hypothesis, gnmt_length_penalty, max_output_length
from ..decoding.sampling import FLOAT32_TEMPERATURES
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

    def __init__(
        self, path: str | Path, device: str = "cpu", threads: int = 0, workers: int = 1
    ) -> None:
        check_workers(workers)
        ct2 = ctranslate2_module()
        path = Path(path)
        metadata = json.loads((path / METADATA).read_text())
        self.config: Config = config_from_dict(
            metadata["config"], vocab_sizes=tuple(metadata["vocab_sizes"])
        )
        protos = [(path / name).read_bytes() for name in metadata["sentencepiece"]]
        self.tokenizer = Tokenizer(
            protos[0], protos[1] if len(protos) > 1 else None, metadata.get("vocab")
        )
        if device == "auto":
            device = "cuda" if ct2.get_cuda_device_count() else "cpu"
        if device.split(":")[0] not in ("cpu", "cuda"):
            raise OptionError("{device}: a CTranslate2 model runs on cpu or cuda", device=device)
        self.device, self.workers = device, workers
        index = int(device.split(":")[1]) if ":" in device else 0
        if workers > 1:
            threads = max(1, (threads or torch.get_num_threads()) // workers)
        self._open = lambda: ct2.Translator(
            str(path),
            device=device.split(":")[0],
            device_index=index,
            intra_threads=threads,
            inter_threads=workers,
        )
        self.model = self._open()
        self.max_source_len = self.config.model.max_positions  # eos included: CTranslate2 adds it
        self._runs: list[list[str]] = []
        self._runs_of = 0  # the max_repeat that _runs is for
        # the pieces sources carry as marks (language tokens, tags) are never written, as in our searches
        self._marks = [[piece] for piece in reserved_pieces(self.config.data)]
        self._told_length_penalty = False  # warned once that beam search ranks differently

    def warm_up(self) -> float:
        """Nothing to prepare: 0 seconds."""
        return 0.0

    def search(
        self, batches: list[SourceBatch], options: DecodingConfig, scores: bool
    ) -> list[list[list[Hypothesis]]]:
        """`Engine.search` through `ctranslate2.Translator.translate_batch`, one call per batch."""
        if options.beam_size > 1 and options.length_penalty > 0 and not self._told_length_penalty:
            self._told_length_penalty = True
            logger.warning(
                "CTranslate2's beam search ranks by log-probability / |Y|^%g (ours: / ((5 + |Y|) / 6)^%g): "
                "some beam outputs can differ from the .pt checkpoint's (docs/decoding.md)",
                options.length_penalty,
                options.length_penalty,
            )
        # CTranslate2 seeds its threads' generators when it loads a model: reload
        if options.sampling and batches:
            ctranslate2_module().set_random_seed(options.seed)
            self.model = self._open()
        return [self._search(batch, options, scores) for batch in batches]

    def _search(
        self, batch: SourceBatch, options: DecodingConfig, scores: bool
    ) -> list[list[Hypothesis]]:
        tokenizer = self.tokenizer
        source = [
            [tokenizer.id_to_piece(t, "src") for t in ids[:-1]] for ids in batch.src_ids
        ]  # it adds the eos
        prefix_lengths = [len(p) if p else 0 for p in batch.prefixes or [None] * len(batch.src_ids)]
        caps = [
            max_output_length(
                len(ids), options.max_len_a, options.max_len_b, self.config.model.max_positions, k
            )
            for ids, k in zip(batch.src_ids, prefix_lengths)
        ]
        targets = (
            None
            if batch.prefixes is None
            else [
                None if p is None else [tokenizer.id_to_piece(t) for t in p] for p in batch.prefixes
            ]
        )
        low, high = (
            FLOAT32_TEMPERATURES  # beyond them float32 makes the temperature 0 or inf: the limits instead
        )
        # -> 0: the most probable token (greedy)
        top_k = 1 if options.temperature < low else options.top_k
        sampling = (
            dict(
                sampling_topk=top_k,
                sampling_topp=options.top_p,
                sampling_temperature=min(options.temperature, high),  # -> inf: uniform (as at 1e37)
            )
            if options.sampling
            else {}
        )
        beam = options.beam_size > 1 and not options.sampling
        # CTranslate2 decodes it greedily: one hypothesis
        greedy_draws = options.sampling and top_k == 1
        out = self.model.translate_batch(
            source,
            beam_size=options.beam_size,
            length_penalty=options.length_penalty if options.beam_size > 1 else 0.0,
            num_hypotheses=options.beam_size if beam else 1 if greedy_draws else options.n_best,
            max_decoding_length=max(caps),
            min_decoding_length=options.min_len,
            no_repeat_ngram_size=options.no_repeat_ngram_size,
            return_scores=beam,
            max_batch_size=options.batch_size,
            target_prefix=targets,
            suppress_sequences=(self._long_runs(options.max_repeat) or []) + self._marks or None,
            **sampling,
        )
        # One cap per batch in CTranslate2: each output is cut at its own sentence's cap, as ours are. As in our
        # search, a hypothesis is finished when it ended with eos within its cap: fewer than `cap` pieces.
        pieces = [[h[:cap] for h in result.hypotheses] for cap, result in zip(caps, out)]
        finished = [[len(h) < cap for h in sentence] for cap, sentence in zip(caps, pieces)]
        if beam:  # the whole beam, ranked as ours (whatever n_best: the 1-best is the n-best list's first)
            ranked = [
                order[: options.n_best]
                for order in self._rank_as_ours(source, out, pieces, finished, targets, options)
            ]
            pieces = [[sentence[k] for k in order] for sentence, order in zip(pieces, ranked)]
            finished = [[done[k] for k in order] for done, order in zip(finished, ranked)]
        elif greedy_draws:
            pieces, finished = (
                [h * options.n_best for h in pieces],
                [f * options.n_best for f in finished],
            )
        hyp_scores = (
            self._scores(source, pieces, finished, options)
            if scores
            else [[float("nan")] * len(h) for h in pieces]
        )
        return [
            [Hypothesis(tokenizer.piece_ids(h), score, done) for h, score, done in zip(*sentence)]
            for sentence in zip(pieces, hyp_scores, finished)
        ]

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

    def _rank_as_ours(
        self,
        source: list[list[str]],
        results: list,
        pieces: list[list[list[str]]],
        finished: list[list[bool]],
        prefixes: Optional[list[Optional[list[str]]]],
        options: DecodingConfig,
    ) -> list[list[int]]:
        """The order of each sentence's beam hypotheses (CTranslate2's `results`, ranked by its own length penalty)
        as our beam search ranks them (`decoding/beam.py: pick_n_best`): the finished ones first, best first by our
        score (log-probability / ((5 + |Y|) / 6)^α), then those cut at the length cap, likewise.

        A finished hypothesis' score comes from CTranslate2's own: the log-probability of its pieces after the
        forced prefix, eos included, divided by |Y|^α (|Y|: all its pieces and the eos); ours is that times |Y|^α,
        plus the prefix's log-probability (scored once per sentence), over ((5 + |Y|) / 6)^α. CTranslate2's
        log-probabilities are those of its search, normalised over the tokens it may produce at each step: they
        leave out tokens it never produces (pad, the start token), which makes them exceed the model's by about
        1e-3 over a sentence (two hypotheses that close may rank either way; `_scores` reports the model's), and the
        tokens its rules block (min_len's eos, no_repeat_ngram_size's n-grams, max_repeat's runs), by up to about 1
        where those rules act. So the hypotheses where a rule may have acted (any with min_len or
        no_repeat_ngram_size set, those with a run of max_repeat pieces) are scored again (`_scores`), as are those
        cut at their sentence's cap (CTranslate2 scored more pieces, or none without an eos).

        Returns:
            Per sentence, indices into its hypotheses, best first.
        """
        alpha = options.length_penalty
        again = [
            (i, k)
            for i, done in enumerate(finished)
            for k, ended in enumerate(done)
            if not ended or _rules_acted(results[i].hypotheses[k], options)
        ]
        exact = dict(
            zip(
                again,
                (
                    s
                    for [s] in self._scores(
                        [source[i] for i, _ in again],
                        [[pieces[i][k]] for i, k in again],
                        [[finished[i][k]] for i, k in again],
                        options,
                    )
                ),
            )
        )
        prefix_log_prob = [0.0] * len(source)
        with_prefix = [i for i, prefix in enumerate(prefixes or []) if prefix]
        if with_prefix:  # score_batch scores an eos after the prefix: left out
            scored = self.model.score_batch(
                [source[i] for i in with_prefix],
                [prefixes[i] for i in with_prefix],
                max_batch_size=options.batch_size,
            )
            for i, result in zip(with_prefix, scored):
                prefix_log_prob[i] = sum(result.log_probs[:-1])

        def ours(i: int, k: int) -> float:
            if (i, k) in exact:
                return exact[i, k]
            length = len(results[i].hypotheses[k]) + 1
            return (
                results[i].scores[k] * length**alpha + prefix_log_prob[i]
            ) / gnmt_length_penalty(length, alpha)

        return [
            sorted(range(len(done)), key=lambda k: (not done[k], -ours(i, k)))
            for i, done in enumerate(finished)
        ]

    def _scores(
        self,
        source: list[list[str]],
        hyps: list[list[list[str]]],
        finished: list[list[bool]],
        options: DecodingConfig,
    ) -> list[list[float]]:
        """Our score of each hypothesis (as `Hypothesis.score`): the sum of its tokens' log-probabilities, eos
        included for a finished one (not for one cut at the length cap), divided by the GNMT length penalty
        ((5 + |Y|) / 6)^α in beam search (`decoding/beam.py`; |Y| counts the eos when there is one). CTranslate2's
        own scores divide by |Y|^α instead, so the tokens are scored again (`score_batch`, which always scores an
        eos after them)."""
        pairs = [(src, h) for src, sentence_hyps in zip(source, hyps) for h in sentence_hyps]
        if not pairs:
            return [[] for _ in hyps]
        scored = self.model.score_batch(
            [src for src, _ in pairs], [h for _, h in pairs], max_batch_size=options.batch_size
        )
        ends = [f for sentence in finished for f in sentence]
        log_probs = [r.log_probs if end else r.log_probs[:-1] for r, end in zip(scored, ends)]
        flat = [
            sum(lp)
            / (
                gnmt_length_penalty(len(lp), options.length_penalty)
                if options.beam_size > 1
                else 1.0
            )
            for lp in log_probs
        ]
        it = iter(flat)
        return [[next(it) for _ in sentence_hyps] for sentence_hyps in hyps]


def _rules_acted(pieces: list[str], options: DecodingConfig) -> bool:
    """Whether a rule on the next token may have blocked a token while CTranslate2 produced `pieces` (which then
    changes its normalised log-probabilities): always with min_len (eos at the first steps) or no_repeat_ngram_size;
    with max_repeat R, when the pieces hold a run of R equal pieces (the next one was blocked)."""
    if options.min_len or options.no_repeat_ngram_size:
        return True
    return (
        bool(options.max_repeat)
        and max((len(list(run)) for _, run in itertools.groupby(pieces)), default=0)
        >= options.max_repeat
    )
