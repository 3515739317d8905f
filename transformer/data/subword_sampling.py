"""Subword regularisation of the training split: a freshly sampled encoding for every epoch after the first.

BPE-dropout (Provilkov et al., 2020) and unigram sampling (Kudo, 2018) help small corpora, but only when the
segmentation changes from epoch to epoch: sampled once, it is just another fixed segmentation. So with
`data.subword_sampling` every epoch e >= 1 gets its own encoding of the whole training split, written in the token
cache's layout (`token_cache.py`: flat id files with offsets, memory-mapped, renamed into place when complete) to

    RUN_DIR/subword_samples/epoch_{e}/            (a multilingual run: RUN_DIR/subword_samples/{direction}/epoch_{e}/)

by a background process that starts when epoch e - 1 starts (a new interpreter that imports neither torch nor the
caller's main module), `CHUNK_PAIRS` pairs at a time, so its memory stays bounded whatever the corpus size. With
`data.subword_workers` 1 (the default) it encodes the chunks itself, on one thread; with more, a pool of that many
processes encodes them, at most two chunks per process in flight, written in order. Epoch 0 trains on the token
cache itself, so that a run starts as fast as without sampling. When a run moves to epoch e, the samples of earlier
epochs are deleted; epoch e's is kept until then, so that `--resume` finds it (otherwise it is encoded again, to the
same ids).

The sampling (`SubwordSampler`) is ours, driven by Python's `random.Random` seeded from (training.seed, epoch,
chunk) (`chunk_seed`), because sentencepiece's own sampling cannot be reproduced: its generator (Abseil's BitGen)
mixes a per-process salt into any seed. So a sample depends on nothing but the data, the tokenizer, the settings,
the seed and the epoch: not on timing, threads or the number of processes. A resumed run sees the same pieces, and
its batches (cut from the sample's lengths) are the same.

- bpe models, BPE-dropout: each word (a piece starting with ▁ and those that follow it, as sentencepiece splits
  on whitespace) is merged again from its characters, highest-scoring merge first as sentencepiece's BPE does, and
  each merge is skipped, for good, with probability data.subword_alpha. With alpha 0 this gives sentencepiece's
  own segmentation (tested on every Multi30k sentence).
- unigram models: one of the data.subword_nbest_size best segmentations of each sentence (sentencepiece's n-best
  list), drawn with probability proportional to P(segmentation)^alpha (Kudo's sampling from the l-best).

A pair whose sampled encoding is longer than data.max_len, or has an empty side, is left out of that epoch (sampled
encodings are longer, so a few more long pairs are left out than from the token cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sentencepiece as spm

from ..config import DataConfig
from ..tokenizer import Tokenizer, split_language_code
from .datasets import SplitSource, open_split
from .text import DataError
from .token_cache import EncodedPairs, build_token_cache, file_lock, open_token_cache

logger = logging.getLogger(__name__)

SAMPLES_FOLDER = "subword_samples"
"""The folder of a run directory that holds the epochs' samples."""

CHUNK_PAIRS = 20_000
"""Pairs encoded per sentencepiece call (and per seed) while sampling: bounds the builder's memory."""


class SubwordSampler:
    """One random segmentation per sentence for a tokenizer's sentencepiece model(s) (see the module docstring).

    Args:
        tokenizer: the run's tokenizer (its own vocabulary, if it has one, maps the pieces to ids).
        data: spm_model_type, subword_alpha, subword_nbest_size.
    """

    def __init__(self, tokenizer: Tokenizer, data: DataConfig) -> None:
        self.tokenizer, self.alpha, self.nbest_size = (
            tokenizer,
            data.subword_alpha,
            data.subword_nbest_size,
        )
        self.is_bpe = data.spm_model_type == "bpe"
        self.src_prefix = tokenizer.source_prefix(data.corpus)  # a language token
        self._sides = {
            side: _SentencePieceSide(sp)
            for side, sp in (("src", tokenizer.src), ("tgt", tokenizer.tgt))
        }

    def src_ids(self, texts: list[str], rng: random.Random) -> list[list[int]]:
        """Source ids of one sampled segmentation of each text, without eos (as `Tokenizer.src_ids`)."""
        tokenizer = self.tokenizer
        if tokenizer.vocab is None:
            ids = [tokenizer.piece_ids(p, "src") for p in self._pieces("src", texts, rng)]
            return [self.src_prefix + tokenizer.marks_as_text(i, "src") for i in ids]
        codes, rests = zip(*map(split_language_code, texts)) if texts else ((), ())
        pieces = self._pieces("src", list(rests), rng)
        return [
            self.src_prefix + tokenizer.piece_ids(code + p, "src") for code, p in zip(codes, pieces)
        ]

    def tgt_ids(self, texts: list[str], rng: random.Random) -> list[list[int]]:
        """Target ids of one sampled segmentation of each text, without bos/eos (as `Tokenizer.tgt_ids`)."""
        ids = [self.tokenizer.piece_ids(p) for p in self._pieces("tgt", texts, rng)]
        return (
            ids
            if self.tokenizer.vocab is not None
            else [self.tokenizer.marks_as_text(i, "tgt") for i in ids]
        )

    def _pieces(self, side: str, texts: list[str], rng: random.Random) -> list[list[str]]:
        model = self._sides[side]
        if self.is_bpe:
            return [
                model.bpe_dropout(pieces, self.alpha, rng)
                for pieces in model.sp.encode(texts, out_type=str)
            ]
        return [model.nbest_sample(text, self.nbest_size, self.alpha, rng) for text in texts]


class _SentencePieceSide:
    """One sentencepiece model with what sampling needs: the scores of its pieces (the merges BPE may make)."""

    def __init__(self, sp: spm.SentencePieceProcessor) -> None:
        self.sp = sp
        self.scores = {
            sp.id_to_piece(i): sp.get_score(i)
            for i in range(sp.get_piece_size())
            if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))
        }

    def bpe_dropout(self, pieces: list[str], alpha: float, rng: random.Random) -> list[str]:
        """BPE-dropout of one sentence, given sentencepiece's segmentation of it (`pieces`)."""
        out: list[str] = []
        word: list[str] = []
        for piece in [*pieces, WORD_START]:  # the sentinel ends the last word
            if piece.startswith(WORD_START) and word:
                # The deterministic merges of this word are len(chars) - len(pieces); if none of their draws drops
                # one, BPE-dropout follows the same path and ends in sentencepiece's pieces.
                text = "".join(word)
                draws = [rng.random() for _ in range(len(text) - len(word))]
                out.extend(
                    word if all(d >= alpha for d in draws) else self._merge(text, alpha, rng, draws)
                )
                word = []
            word.append(piece)
        return out

    def _merge(self, word: str, alpha: float, rng: random.Random, draws: list[float]) -> list[str]:
        """BPE on one word's characters, best score first (leftmost on ties), skipping each merge with probability
        alpha (a skipped pair is never merged: its two symbols only change by merging with others); `draws` are the
        first random numbers to use."""
        scores, none = self.scores, -math.inf
        symbols = list(word)
        pair_scores = [
            scores.get(a + b, none) for a, b in zip(symbols, symbols[1:])
        ]  # pair i: symbols i, i + 1
        draws.reverse()
        while pair_scores:
            best_score = max(pair_scores)
            if best_score == none:
                break
            best = pair_scores.index(best_score)
            if (draws.pop() if draws else rng.random()) < alpha:
                pair_scores[best] = none
                continue
            symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
            del pair_scores[best]
            if best > 0:
                pair_scores[best - 1] = scores.get(symbols[best - 1] + symbols[best], none)
            if best < len(pair_scores):
                pair_scores[best] = scores.get(symbols[best] + symbols[best + 1], none)
        return symbols

    def nbest_sample(
        self, text: str, nbest_size: int, alpha: float, rng: random.Random
    ) -> list[str]:
        """One of the nbest_size best segmentations of `text`, drawn with probability ∝ P(segmentation)^alpha."""
        nbests = self.sp.nbest_encode(text, nbest_size=nbest_size, out_type="proto").nbests
        if not nbests:
            return []
        top = max(n.score for n in nbests)
        weights = [math.exp(alpha * (n.score - top)) for n in nbests]
        chosen = rng.choices(nbests, weights=weights)[0]
        return [p.piece for p in chosen.pieces]


WORD_START = "\u2581"
"""sentencepiece's word-boundary mark (▁): a piece that starts with it starts a word."""


def chunk_seed(seed: int, epoch: int, chunk: int) -> int:
    """The seed of one chunk of one epoch's sample: a 64-bit hash of the three."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}:{chunk}".encode()).digest()[:8], "little")


def sample_folder(run_dir: Path, epoch: int, name: str = "") -> Path:
    """RUN_DIR/subword_samples/{name}/epoch_{epoch}, `name` a corpus's `Corpus.files` ("" for the short form's)."""
    return run_dir / SAMPLES_FOLDER / name / f"epoch_{epoch}"


def sample_spec(
    cache_spec: dict[str, Any], data: DataConfig, seed: int, epoch: int
) -> dict[str, Any]:
    """What one epoch's sample depends on: the token cache's spec (data, tokenizer, max_len, languages), the
    sampling settings, the seed and the epoch."""
    return {
        **cache_spec,
        "sampling": {
            "alpha": data.subword_alpha,
            "nbest_size": data.subword_nbest_size,
            "seed": seed,
            "epoch": epoch,
            "chunk_pairs": CHUNK_PAIRS,
        },
    }


def build_sample(
    source: SplitSource,
    tokenizer: Tokenizer,
    data: DataConfig,
    seed: int,
    epoch: int,
    folder: Path,
    spec: dict[str, Any],
) -> dict[str, Any]:
    """Encode `source` with one sampled segmentation per sentence into `folder` (the token cache's layout).

    Returns:
        The sample's meta.json record.

    Raises:
        DataError: bad corpus files, or no pair left.
        TokenCacheError: the folder cannot be written (nothing is left behind).
    """

    def encode(
        chunks: Iterator[tuple[list[str], list[str]]],
    ) -> Iterator[tuple[list[list[int]], list[list[int]]]]:
        if data.subword_workers == 1:
            _init_chunk_worker(tokenizer.to_dict(), data, seed, epoch)
            yield from (_encode_chunk(k, src, tgt)[:2] for k, (src, tgt) in enumerate(chunks))
            return
        context = multiprocessing.get_context("spawn")
        with context.Pool(
            data.subword_workers, _init_chunk_worker, (tokenizer.to_dict(), data, seed, epoch)
        ) as pool:
            pending: deque = deque()  # at most 2 chunks per process in flight: bounded memory
            for k, (src, tgt) in enumerate(chunks):
                pending.append(pool.apply_async(_encode_chunk, (k, src, tgt)))
                if len(pending) >= 2 * data.subword_workers:
                    yield _collect(pending.popleft().get())
            while pending:
                yield _collect(pending.popleft().get())

    return build_token_cache(
        source,
        tokenizer,
        data.max_len,
        folder,
        spec,
        threads=1,
        chunk_size=CHUNK_PAIRS,
        encode=encode,
        progress=False,
        label=f"subword sample of epoch {epoch}",
    )


_chunk_worker: dict[str, Any] = {}


def _init_chunk_worker(tokenizer_state: dict, data: DataConfig, seed: int, epoch: int) -> None:
    _chunk_worker.update(
        sampler=SubwordSampler(Tokenizer.from_dict(tokenizer_state), data), seed=seed, epoch=epoch
    )


def _encode_chunk(
    k: int, src: list[str], tgt: list[str]
) -> tuple[list[list[int]], list[list[int]], int]:
    """Chunk k of the sample (its random stream is seeded by (seed, epoch, k) alone, whichever process encodes it),
    and this process's peak resident memory in kB."""
    sampler, rng = (
        _chunk_worker["sampler"],
        random.Random(chunk_seed(_chunk_worker["seed"], _chunk_worker["epoch"], k)),
    )
    return sampler.src_ids(src, rng), sampler.tgt_ids(tgt, rng), _peak_rss_kb()


def _collect(
    result: tuple[list[list[int]], list[list[int]], int],
) -> tuple[list[list[int]], list[list[int]]]:
    _chunk_worker["pool_peak_rss_kb"] = max(_chunk_worker.get("pool_peak_rss_kb", 0), result[2])
    return result[0], result[1]


def _peak_rss_kb() -> int:
    """VmHWM of this process (since its exec: getrusage's maxrss would count the forked parent's pages)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _build_worker(
    data: DataConfig,
    split: str,
    tokenizer_state: dict,
    seed: int,
    epoch: int,
    folder: Path,
    spec: dict[str, Any],
) -> None:
    """The background process: build one epoch's sample unless another process has (under a file lock)."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the trainer, which stops this process
    try:
        os.nice(5)  # the training process comes first when both want a core
    except OSError:
        pass
    folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(folder.parent / f".{folder.name}.lock"):
        if (folder / "meta.json").exists():
            return
        build_sample(
            open_split(data, split),
            Tokenizer.from_dict(tokenizer_state),
            data,
            seed,
            epoch,
            folder,
            spec,
        )
        own, pool = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        (folder / "builder.json").write_text(
            json.dumps(
                {
                    "peak_rss_mb": round(
                        max(_peak_rss_kb(), _chunk_worker.get("pool_peak_rss_kb", 0)) / 1024
                    ),
                    "cpu_s": round(own.ru_utime + own.ru_stime + pool.ru_utime + pool.ru_stime, 1),
                }
            )
        )


def run_job(path: str) -> None:
    """The background process's entry point: read the arguments of `_build_worker` from the job file at `path`
    (written by `SampledEpochs`), delete it, and build."""
    job = Path(path)
    with job.open("rb") as f:
        args = pickle.load(f)
    job.unlink(missing_ok=True)
    _build_worker(**args)


def _worker_command(job: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of the background process: a fresh interpreter that imports this module
    (and so not torch, nor the caller's main module) from the same package as this process."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    code = f"import sys; from {__name__} import run_job; run_job(sys.argv[1])"
    return [sys.executable, "-c", code, str(job)], env


class SampledEpochs:
    """The training pairs of each epoch with data.subword_sampling: the token cache for epoch 0, then one fresh
    sample per epoch, each built in the background while the epoch before it trains (`prefetch`).

    Args:
        cache: the token cache of the training split (epoch 0), as `get_token_cache` opens it: its spec is part of
            every sample's spec.
        data: the data section (source, split, sampling settings).
        tokenizer: the run's tokenizer.
        seed: training.seed.
        run_dir: where the samples are written (`RUN_DIR/subword_samples/`).
        build: True for the one process per machine that builds samples (local rank 0); the others wait for them.
        name: the corpus's `Corpus.files`: "" for the one corpus of a bilingual run (RUN_DIR/subword_samples/epoch_N),
            else its own folder (.../de-en/epoch_N).

    Raises:
        ValueError: `cache` holds pairs in memory (no spec), not a token cache.
    """

    def __init__(
        self,
        cache: EncodedPairs,
        data: DataConfig,
        tokenizer: Tokenizer,
        seed: int,
        run_dir: Path,
        build: bool = True,
        name: str = "",
    ) -> None:
        if cache.spec is None:
            raise ValueError(
                "subword sampling starts from a token cache (get_token_cache), not pairs in memory"
            )
        self.cache, self.data, self.tokenizer = cache, data, tokenizer
        self.seed, self.run_dir, self.build, self.name = seed, run_dir, build, name
        self._workers: dict[int, subprocess.Popen] = {}

    def __len__(self) -> int:
        return len(self.cache)

    def epoch(self, epoch: int) -> EncodedPairs:
        """The pairs of `epoch` (waiting for its sample if it is not ready, building it now if nobody started it);
        earlier epochs' samples are removed.

        Raises:
            DataError: the background process failed (its error is in the log above).
            TokenCacheError: a sample folder is unreadable.
        """
        pairs = self.cache if epoch == 0 else self._sample(epoch)
        if self.build:
            self._remove_before(epoch)
        return pairs

    def prefetch(self, epoch: int) -> None:
        """Start building `epoch`'s sample in the background (the training loop asks while the epoch before it
        trains, unless the run ends within that epoch)."""
        if self.build and epoch > 0:
            self._start(epoch)

    def close(self) -> None:
        """Stop a background build still running (its temporary folder is removed)."""
        for epoch, process in list(self._workers.items()):
            if process.poll() is None:
                process.terminate()
            process.wait()
            folder = sample_folder(self.run_dir, epoch, self.name)
            shutil.rmtree(folder.with_name(f".{folder.name}.tmp"), ignore_errors=True)
            folder.with_name(f".{folder.name}.job").unlink(missing_ok=True)
        self._workers.clear()

    def _spec(self, epoch: int) -> dict[str, Any]:
        return sample_spec(self.cache.spec, self.data, self.seed, epoch)

    def _sample(self, epoch: int) -> EncodedPairs:
        folder, spec = sample_folder(self.run_dir, epoch, self.name), self._spec(epoch)
        start = time.perf_counter()
        if self.build and epoch not in self._workers and not self._is_complete(folder, spec):
            shutil.rmtree(folder, ignore_errors=True)  # left by a run with other settings
            self._start(epoch)
        if epoch in self._workers:
            process = self._workers.pop(epoch)
            if process.wait() != 0:
                raise DataError(
                    f"the background process that encodes epoch {epoch}'s subword sample "
                    f"(data.subword_sampling) failed with exit code {process.returncode}; its error is "
                    "in the log above"
                )
        while not (folder / "meta.json").exists():  # not the builder: local rank 0 builds it
            time.sleep(0.5)
        pairs = open_token_cache(folder, spec)
        meta = json.loads((folder / "meta.json").read_text())
        builder = _read_json(folder / "builder.json")
        logger.info(
            "epoch %d: subword sample of %d pairs (%d dropped as longer than data.max_len), built in %.1f s "
            "by the background process (%s CPU s, peak RSS %s MB); waited %.1f s for it",
            epoch,
            meta["n_pairs"],
            meta["dropped_too_long"],
            meta["build_seconds"],
            builder.get("cpu_s", "?"),
            builder.get("peak_rss_mb", "?"),
            time.perf_counter() - start,
        )
        return pairs

    def _is_complete(self, folder: Path, spec: dict[str, Any]) -> bool:
        meta = _read_json(folder / "meta.json")
        return meta.get("spec") == spec

    def _start(self, epoch: int) -> None:
        """Start the background build of `epoch`'s sample unless it is there or being built."""
        folder = sample_folder(self.run_dir, epoch, self.name)
        if epoch in self._workers or self._is_complete(folder, self._spec(epoch)):
            return
        # A new interpreter rather than a fork of this process (and its torch threads), and rather than
        # multiprocessing's spawn, which would import the main module and torch again.
        folder.parent.mkdir(parents=True, exist_ok=True)
        job = folder.with_name(f".{folder.name}.job")
        args = dict(
            data=self.data,
            split=self.data.train_split,
            tokenizer_state=self.tokenizer.to_dict(),
            seed=self.seed,
            epoch=epoch,
            folder=folder,
            spec=self._spec(epoch),
        )
        tmp = job.with_name(job.name + ".tmp")
        with tmp.open("wb") as f:
            pickle.dump(args, f)
        os.replace(tmp, job)
        command, env = _worker_command(job)
        self._workers[epoch] = process = subprocess.Popen(command, env=env)
        threading.Thread(
            target=process.wait, daemon=True
        ).start()  # reaped when it ends, not when its epoch starts

    def _remove_before(self, epoch: int) -> None:
        root = self.run_dir / SAMPLES_FOLDER / self.name
        if not root.is_dir():
            return
        for path in [
            *root.glob("epoch_*"),
            *root.glob(".epoch_*"),
        ]:  # samples, locks, jobs, temporary folders
            number = path.name.removeprefix(".").removeprefix("epoch_").split(".")[0]
            if number.isdigit() and int(number) < epoch:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(
                    missing_ok=True
                )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
