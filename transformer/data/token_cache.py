"""The token cache: a training split encoded once into memory-mapped numpy files, shared by every process.

fairseq's answer to the same problem is a one-off binarization (`fairseq-preprocess`); this is ours, built on the
first `transformer train` (or ahead of it by `transformer prepare`) and found again by every later start, by
`--resume`, by every torchrun process and by any new run with the same data and tokenizer. Pages are shared through
the operating system's page cache: no process holds the corpus in its heap.

One cache is a folder `<cache dir>/<split>.<src>-<tgt>.<key>/`:

    meta.json          format version, what it was built from (`spec`), counts, dtype, size, build time, and
                       the kept pairs with characters the tokenizer maps to unk (`coverage.UnknownCharacters`)
    src_ids.bin        the source ids of every kept pair (eos included), concatenated; uint16 when both
                       vocabularies have at most 65,536 pieces, int32 otherwise
    tgt_ids.bin        the target ids (no bos/eos), concatenated
    src_offsets.npy    `(n_pairs + 1,)` int64: pair i's source is src_ids[src_offsets[i]:src_offsets[i + 1]]
    tgt_offsets.npy    the same for the target

The key is the SHA-256 of the spec: the format version, the corpus fingerprint (local files: resolved path, size
and SHA-256 of both files' bytes, so that changed data is never fed from an old cache even when a copy kept its
size and modification time; the digest is remembered in `<cache dir>/file_sha256.json` until the file is written
again; `datasets`: id, config, split and the table's fingerprint), the SHA-256 of
the sentencepiece model(s), the version of how text becomes ids (`tokenizer.ENCODING_VERSION`), `data.max_len` and
the two languages. Changing any of them changes the key, so a stale
cache is never found; the log says which of them differ from the caches already there. A cache is written into a
temporary folder and renamed into place only when complete (meta.json written last), under a file lock, so
concurrent processes build it once and a crash or a full disk never leaves a folder a later run would trust.

The cache folder is `data.cache_dir`, else `$TRANSFORMER_NMT_CACHE`, else `~/.cache/transformer-nmt`.

Why our own numpy format rather than `datasets`' Arrow tables, which the project also depends on: the two build
and gather batches about equally fast (sentencepiece dominates building; docs/experiments.md), but `datasets`
leaves large intermediate Arrow files beside its result, runs several processes, and keys the reuse of a `map`
result on a hash of the mapping function (for a sentencepiece model loaded in the workers, on its path rather
than its content). Two flat arrays with offsets, written by one process, are the simplest thing to key on the
tokenizer's content, to make atomic and to check for truncation.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from tqdm import tqdm

from ..config import EOS_ID, DataConfig
from ..tokenizer import ENCODING_VERSION, Tokenizer
from .coverage import UnknownCharacters
from .datasets import SplitSource, open_split
from .text import DataError

if TYPE_CHECKING:
    from .batching import Batch

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
"""Bumped whenever the layout changes: the key includes it, so old caches are simply not found."""


class TokenCacheError(DataError):
    """A token cache is unreadable, truncated, or was built from other data or another tokenizer."""


class EncodedPairs:
    """Token ids of aligned sentence pairs, stored flat: memory-mapped from a token cache, or in memory.

    Pair i's source is `src_ids[src_offsets[i]:src_offsets[i + 1]]` (eos included, as `Tokenizer.encode_src`
    gives it) and its target `tgt_ids[tgt_offsets[i]:tgt_offsets[i + 1]]` (no bos/eos, as `encode_tgt`).

    Attributes:
        src_lengths: `(n,)` int32, source tokens as fed to the model (eos included).
        tgt_lengths: `(n,)` int32, target tokens as predicted (pieces + eos).
        spec: what a token cache was built from (`cache_spec`, from its meta.json); None for pairs in memory.
        unknown_characters: `UnknownCharacters.to_dict()` of a token cache (None for pairs in memory, or a cache
            built before it was counted).
    """

    def __init__(
        self,
        src_ids: np.ndarray,
        src_offsets: np.ndarray,
        tgt_ids: np.ndarray,
        tgt_offsets: np.ndarray,
        spec: Optional[dict[str, Any]] = None,
        unknown_characters: Optional[dict[str, Any]] = None,
    ) -> None:
        self.spec, self.unknown_characters = spec, unknown_characters
        self.src_ids, self.src_offsets = src_ids, src_offsets
        self.tgt_ids, self.tgt_offsets = tgt_ids, tgt_offsets
        self.src_lengths = np.diff(src_offsets).astype(np.int32)
        self.tgt_lengths = (np.diff(tgt_offsets) + 1).astype(np.int32)

    @classmethod
    def from_lists(cls, src: list[list[int]], tgt: list[list[int]]) -> "EncodedPairs":
        """In-memory pairs from `Tokenizer.encode_src` / `encode_tgt` output (e.g. the validation set)."""

        def flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
            offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
            np.cumsum([len(s) for s in seqs], out=offsets[1:])
            return np.fromiter(chain.from_iterable(seqs), np.int32, count=int(offsets[-1])), offsets

        return cls(*flat(src), *flat(tgt))

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    def src(self, i: int) -> np.ndarray:
        """Source ids of pair i, eos included."""
        return self.src_ids[self.src_offsets[i] : self.src_offsets[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        """Target ids of pair i, without bos/eos."""
        return self.tgt_ids[self.tgt_offsets[i] : self.tgt_offsets[i + 1]]

    def batch(self, indices: np.ndarray | list[int]) -> Batch:
        """The padded `Batch` of these pairs, in this order."""
        from .batching import (
            make_batch,
        )  # torch: not imported by the processes that only write caches

        return make_batch([self.src(i) for i in indices], [self.tgt(i) for i in indices])


# --------------------------------------------------------------------------------------------------
# Finding, building and opening a cache
# --------------------------------------------------------------------------------------------------


def cache_root(data: DataConfig) -> Path:
    """The folder that holds token caches: data.cache_dir, $TRANSFORMER_NMT_CACHE or ~/.cache/transformer-nmt."""
    folder = data.cache_dir or os.environ.get("TRANSFORMER_NMT_CACHE") or "~/.cache/transformer-nmt"
    return Path(folder).expanduser()


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """SHA-256 of the serialized sentencepiece model(s) and of the tokenizer's own vocabulary, if any."""
    return tokenizer.digest()


def cache_spec(source: SplitSource, tokenizer: Tokenizer, data: DataConfig) -> dict[str, Any]:
    """Everything a cache's content depends on (its key is the hash of this)."""
    memo = cache_root(data) / "file_sha256.json"
    spec = {
        "format": CACHE_FORMAT,
        "corpus": source.fingerprint(memo if memo.parent.is_dir() else None),
        "tokenizer_sha256": tokenizer_digest(tokenizer),
        "encoding": ENCODING_VERSION,
        "max_len": data.max_len,
        "src_lang": data.src_lang,
        "tgt_lang": data.tgt_lang,
    }
    prefix = tokenizer.source_prefix(
        data.corpus
    )  # a corpus with marks (a language token) starts each source with them
    return {**spec, "src_prefix": prefix} if prefix else spec


def cache_folder(root: Path, split: str, data: DataConfig, spec: dict[str, Any]) -> Path:
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{split}.{data.src_lang}-{data.tgt_lang}.{key}"


def get_token_cache(
    data: DataConfig,
    split: str,
    tokenizer: Tokenizer,
    build: bool = True,
    source: Optional[SplitSource] = None,
    threads: int = 0,
) -> EncodedPairs:
    """The token cache of one split for this tokenizer, built first if it is not there.

    Args:
        data: the data section (source, max_len, cache_dir).
        split: usually data.train_split.
        tokenizer: the run's tokenizer.
        build: False for processes that must not build (torchrun ranks other than local rank 0): they wait for
            the cache to appear, then map it.
        source: the split, if already opened.
        threads: sentencepiece encoding threads (0: every core this process may use).

    Returns:
        The memory-mapped pairs (pairs longer than data.max_len or with an empty side are not in it).

    Raises:
        DataError: bad corpus files (misaligned, invalid UTF-8...), or no pair left after filtering.
        TokenCacheError: the cache cannot be written (e.g. the disk is full; nothing is left behind) or read.
    """
    source = source or open_split(data, split)
    spec = cache_spec(source, tokenizer, data)
    root = cache_root(data)
    folder = cache_folder(root, split, data, spec)
    if not build:
        logged = False
        while not (folder / "meta.json").exists():
            if not logged:
                logger.info("waiting for local rank 0 to build the token cache %s", folder)
                logged = True
            time.sleep(1.0)
        return open_token_cache(folder, spec)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise TokenCacheError(
            f"cannot create the token cache folder {root} ({err}); set data.cache_dir"
        ) from None
    if (folder / "meta.json").exists() and not os.access(root, os.W_OK):
        return _open_existing(
            folder, spec
        )  # a complete cache in a read-only (shared) folder: nothing to lock
    with file_lock(root / f".{folder.name}.lock"):
        if (folder / "meta.json").exists():
            return _open_existing(folder, spec)
        _explain_rebuild(root, split, data, spec, folder)
        build_token_cache(
            source,
            tokenizer,
            data.max_len,
            folder,
            spec,
            threads,
            src_prefix=tuple(spec.get("src_prefix", ())),
        )
    return open_token_cache(folder, spec)


def _open_existing(folder: Path, spec: dict[str, Any]) -> EncodedPairs:
    pairs = open_token_cache(folder, spec)
    meta = json.loads((folder / "meta.json").read_text())
    logger.info(
        "token cache: %s (%d pairs, %.1f MB, built %s)",
        folder,
        meta["n_pairs"],
        meta["bytes"] / 1e6,
        meta["created"],
    )
    return pairs


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock (flock) on `path`: one builder per cache, the others wait.

    Raises:
        TokenCacheError: the lock file cannot be created (a folder this process cannot write).
    """
    try:
        handle = open(path, "a")
    except OSError as err:
        raise TokenCacheError(
            f"cannot write the token cache folder {path.parent} ({err.strerror}): make it "
            "writable or set data.cache_dir to another folder"
        ) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is building the token cache (%s)", path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _explain_rebuild(
    root: Path, split: str, data: DataConfig, spec: dict[str, Any], folder: Path
) -> None:
    """Log why no cache fits, in one short line: of the caches of the same split and languages (the cache folder may
    be shared by other checkouts), the closest one and what differs (values shortened: file names, digest starts)."""
    closest: Optional[tuple[int, str, str]] = None
    n_other = 0
    for meta_path in sorted(root.glob(f"{split}.{data.src_lang}-{data.tgt_lang}.*/meta.json")):
        try:
            other = json.loads(meta_path.read_text())["spec"]
        except (OSError, ValueError, KeyError):
            continue
        diff = _spec_differences(other, spec, short=True)
        if diff:
            n_other += 1
            candidate = (diff.count(" (this run: "), meta_path.parent.name, diff)
            closest = min(closest, candidate) if closest else candidate
    if closest:
        logger.info(
            "token cache: building %s; no existing cache fits (%d of this split); the closest, %s, was built with %s",
            folder.name,
            n_other,
            closest[1],
            closest[2],
        )
    else:
        logger.info("token cache: building %s", folder)


def _short(value: Any) -> str:
    """A spec value for a log line: a path as its file name, a long string as its start."""
    if isinstance(value, str) and "/" in value:
        value = Path(value).name
    text = json.dumps(value)
    return text if len(text) <= 24 else text[:13] + '..."'


def _spec_differences(old: dict[str, Any], new: dict[str, Any], short: bool = False) -> str:
    """'key=old value (this run: new value), ...' for every leaf that differs (nested keys dotted); `short`: the
    values shortened (`_short`)."""

    def leaves(value: Any, prefix: str) -> dict[str, Any]:
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = ((str(i), v) for i, v in enumerate(value))
        else:
            return {prefix: value}
        out: dict[str, Any] = {}
        for key, item in items:
            out.update(leaves(item, f"{prefix}.{key}" if prefix else str(key)))
        return out

    a, b = leaves(old, ""), leaves(new, "")
    shown = _short if short else json.dumps
    return ", ".join(
        f"{k}={shown(a.get(k))} (this run: {shown(b.get(k))})"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    )


def open_token_cache(folder: str | Path, spec: Optional[dict[str, Any]] = None) -> EncodedPairs:
    """Memory-map a built cache.

    Args:
        folder: the cache folder.
        spec: what the caller expects it to hold (`cache_spec`); None skips the check.

    Raises:
        TokenCacheError: no or unreadable meta.json, another format, a spec that differs from `spec` (naming both
            values of every differing key), or files whose sizes disagree with meta.json (truncated).
    """
    folder = Path(folder)
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise TokenCacheError(f"{folder}: not a complete token cache ({err})") from None
    if meta.get("spec", {}).get("format") != CACHE_FORMAT:
        raise TokenCacheError(
            f"{folder}: token cache format {meta.get('spec', {}).get('format')}, this version "
            f"reads format {CACHE_FORMAT}; delete the folder to rebuild it"
        )
    if spec is not None and meta["spec"] != spec:
        raise TokenCacheError(
            f"{folder}: this token cache was built from other data or another tokenizer: "
            f"{_spec_differences(meta['spec'], spec)}"
        )
    try:
        arrays = [
            np.memmap(folder / f"{side}_ids.bin", dtype=meta["dtype"], mode="r")
            for side in ("src", "tgt")
        ]
        offsets = [
            np.load(folder / f"{side}_offsets.npy", mmap_mode="r") for side in ("src", "tgt")
        ]
    except (OSError, ValueError) as err:
        raise TokenCacheError(
            f"{folder}: unreadable token cache ({err}); delete the folder to rebuild it"
        ) from None
    for ids, off, side in zip(arrays, offsets, ("src", "tgt")):
        if len(off) != meta["n_pairs"] + 1 or off[-1] != len(ids):
            raise TokenCacheError(
                f"{folder}: {side}_ids.bin holds {len(ids)} ids and {side}_offsets.npy "
                f"{len(off) - 1} pairs ending at {off[-1]}, meta.json says {meta['n_pairs']} "
                "pairs: truncated? Delete the folder to rebuild it"
            )
    return EncodedPairs(
        arrays[0], offsets[0], arrays[1], offsets[1], meta["spec"], meta.get("unknown_characters")
    )


ChunkEncoder = Callable[
    [Iterator[tuple[list[str], list[str]]]], Iterator[tuple[list[list[int]], list[list[int]]]]
]
"""Maps the corpus's chunks (source texts, target texts), in order, to their (source ids, target ids) without eos, in
the same order: how a cache's chunks are encoded."""


def build_token_cache(
    source: SplitSource,
    tokenizer: Tokenizer,
    max_len: int,
    folder: Path,
    spec: dict[str, Any],
    threads: int = 0,
    chunk_size: int = 50_000,
    encode: Optional[ChunkEncoder] = None,
    progress: bool = True,
    label: str = "token cache",
    src_prefix: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Encode `source` into a new cache at `folder` (see the module docstring for the layout).

    Pairs with an empty side, a source longer than max_len tokens (eos included) or a target longer than
    max_len - 1 pieces (so that target + eos fits) are dropped and counted. Both sides are encoded by
    sentencepiece with `threads` threads, each source after the ids `src_prefix` (or by `encode`), `chunk_size` pairs
    at a time;
    a tqdm bar shows the progress unless `progress` is False. `label` names the result in the log.

    Returns:
        The meta.json record.

    Raises:
        DataError: bad corpus files, or no pair left.
        TokenCacheError: writing failed (e.g. a full disk); the temporary folder is removed.
    """
    threads = threads or len(os.sched_getaffinity(0))
    if encode is None:

        def encode(
            chunks: Iterator[tuple[list[str], list[str]]],
        ) -> Iterator[tuple[list[list[int]], list[list[int]]]]:
            for src, tgt in chunks:
                yield (
                    [[*src_prefix, *ids] for ids in tokenizer.src_ids(src, num_threads=threads)],
                    tokenizer.tgt_ids(tgt, num_threads=threads),
                )

    vocab = max(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.int32)
    tmp = folder.with_name(f".{folder.name}.tmp")
    if tmp.exists():  # left by a process that died while building (we hold the lock)
        shutil.rmtree(tmp)
    start = time.perf_counter()
    try:
        tmp.mkdir(parents=True)
        unknown = UnknownCharacters(tokenizer)
        counts = _encode_into(tmp, source, encode, max_len, dtype, chunk_size, progress, unknown)
        n_bytes = sum(p.stat().st_size for p in tmp.iterdir())
        meta = {
            "spec": spec,
            "origin": source.origin,
            "dtype": dtype.name,
            **counts,
            "unknown_characters": unknown.to_dict(),
            "bytes": n_bytes,
            "build_seconds": round(time.perf_counter() - start, 1),
            "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        _write_synced(tmp / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
        os.rename(tmp, folder)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise TokenCacheError(
                f"building the token cache {folder} failed: {err}; nothing was kept "
                "(free disk space or set data.cache_dir, then start again)"
            ) from err
        raise
    logger.info(
        "%s: kept %d of %d pairs; dropped %d with an empty side and %d longer than "
        "data.max_len=%d tokens; %d source tokens (eos included) + %d target pieces stored; %.1f MB on disk; "
        "built in %.0f s",
        label,
        meta["n_pairs"],
        meta["n_read"],
        meta["dropped_empty"],
        meta["dropped_too_long"],
        max_len,
        meta["src_tokens"],
        meta["tgt_tokens"],
        n_bytes / 1e6,
        meta["build_seconds"],
    )
    return meta


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _encode_into(
    folder: Path,
    source: SplitSource,
    encode: ChunkEncoder,
    max_len: int,
    dtype: np.dtype,
    chunk_size: int,
    progress: bool,
    unknown: UnknownCharacters,
) -> dict[str, int]:
    n_read = n_empty = n_long = 0
    # the chunks `encode` has taken and not yet given back
    texts: deque[tuple[list[str], list[str]]] = deque()

    def chunks() -> Iterator[tuple[list[str], list[str]]]:
        for chunk in source.chunks(chunk_size):
            texts.append(chunk)
            yield chunk

    src_lengths: list[np.ndarray] = []
    tgt_lengths: list[np.ndarray] = []
    total, unit = source.progress()
    with (
        open(folder / "src_ids.bin", "wb") as src_file,
        open(folder / "tgt_ids.bin", "wb") as tgt_file,
        tqdm(
            total=total,
            unit=unit,
            unit_scale=True,
            desc="token cache",
            mininterval=2.0,
            dynamic_ncols=True,
            disable=not progress,
        ) as bar,
    ):
        for src, tgt in encode(chunks()):
            src_text, tgt_text = texts.popleft()
            src_len = np.fromiter(map(len, src), np.int64, len(src))  # pieces, without eos
            tgt_len = np.fromiter(map(len, tgt), np.int64, len(tgt))
            empty = (src_len == 0) | (tgt_len == 0)
            too_long = ~empty & ((src_len + 1 > max_len) | (tgt_len + 1 > max_len))
            kept = np.flatnonzero(~(empty | too_long))
            n_read += len(src)
            n_empty += int(empty.sum())
            n_long += int(too_long.sum())
            src_ids = np.fromiter(
                chain.from_iterable(src[i] for i in kept), dtype, count=int(src_len[kept].sum())
            )
            tgt_ids = np.fromiter(
                chain.from_iterable(tgt[i] for i in kept), dtype, count=int(tgt_len[kept].sum())
            )
            unknown.add(
                [src_text[i] for i in kept],
                [tgt_text[i] for i in kept],
                src_ids,
                src_len[kept],
                tgt_ids,
                tgt_len[kept],
            )
            src_ids = np.insert(
                src_ids, np.cumsum(src_len[kept]), EOS_ID
            )  # eos after every sentence
            src_file.write(src_ids.tobytes())
            tgt_file.write(tgt_ids.tobytes())
            src_lengths.append(src_len[kept] + 1)
            tgt_lengths.append(tgt_len[kept])
            bar.update(source.position() - bar.n)
        bar.update(total - bar.n)
        for f in (src_file, tgt_file):
            f.flush()
            os.fsync(f.fileno())
    n_pairs = sum(len(a) for a in src_lengths)
    if n_pairs == 0:
        raise DataError(
            f"{source.origin}: no training pair is left after dropping {n_empty} with an empty side and "
            f"{n_long} longer than data.max_len={max_len} tokens"
        )
    for side, lengths in (("src", src_lengths), ("tgt", tgt_lengths)):
        offsets = np.zeros(n_pairs + 1, dtype=np.int64)
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
        with open(folder / f"{side}_offsets.npy", "wb") as f:
            np.save(f, offsets)
            f.flush()
            os.fsync(f.fileno())
    return {
        "n_read": n_read,
        "n_pairs": n_pairs,
        "dropped_empty": n_empty,
        "dropped_too_long": n_long,
        "src_tokens": int(sum(a.sum() for a in src_lengths)),
        "tgt_tokens": int(sum(a.sum() for a in tgt_lengths)),
    }
