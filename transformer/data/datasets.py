"""Parallel corpora from local text files or from Hugging Face `datasets`.

Local layout (Multi30k): a folder with `{split}.{lang}` or `{split}.{lang}.gz`, one sentence per line.
Lines are split on "\\n" only (never on U+2028, U+0085 or other characters that `str.splitlines` treats as
line breaks), so that the two sides stay aligned.

`datasets` sources: a hub id with an optional config name (`bentrevett/multi30k`; `wmt14` with `de-en`),
or a loader name (`json`, `csv`, `parquet`) with local `data_files`; rows hold either a `translation`
mapping {lang: text} or one column per language.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..config import DataConfig
from .text import DataError, LineReader, count_lines

logger = logging.getLogger(__name__)


@dataclass
class ParallelCorpus:
    """Aligned source and target sentences of one split, in memory (validation and test sets).

    Attributes:
        src, tgt: lists of the same length.
        origin: where the data came from, for messages (file names or dataset id).
    """

    src: list[str]
    tgt: list[str]
    origin: str

    def __len__(self) -> int:
        return len(self.src)


def _local_file(folder: Path, split: str, lang: str) -> Path:
    for name in (f"{split}.{lang}.gz", f"{split}.{lang}"):
        if (folder / name).exists():
            return folder / name
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    langs = sorted(
        {p.split(".")[1] for p in present if p.startswith(f"{split}.") and p.count(".") >= 1}
    )
    hint = (
        f"; languages present for split {split!r}: {', '.join(langs)}"
        if langs
        else f"; files there: {', '.join(present[:12]) or 'none'}"
    )
    raise DataError(f"{folder}: no file {split}.{lang}.gz or {split}.{lang}{hint}")


class SplitSource:
    """One split of a parallel corpus, read in chunks of pairs without holding it whole.

    Built by `open_split`. Local text files are read with `text.LineReader` (its rules apply); `datasets`
    sources are Arrow tables that `datasets` memory-maps, read a chunk at a time.

    Attributes:
        origin: where the data comes from, for messages.
    """

    origin: str

    def __len__(self) -> int:
        """Number of pairs."""
        raise NotImplementedError

    def fingerprint(self, hash_memo: Optional[Path] = None) -> dict[str, Any]:
        """What identifies the content, for cache keys (see `token_cache.py`).

        Args:
            hash_memo: a JSON file that remembers local files' SHA-256 by their (path, size, mtime, ctime, inode),
                so that an unchanged file is hashed once; None: hash every time.
        """
        raise NotImplementedError

    def chunks(self, size: int) -> Iterator[tuple[list[str], list[str]]]:
        """(source sentences, target sentences) of up to `size` pairs at a time, in order.

        Raises:
            DataError: misaligned files (naming both and their line counts), or text the reader refuses.
        """
        raise NotImplementedError

    def progress(self) -> tuple[int, str]:
        """(total, unit) for a progress bar over `chunks`; `position()` gives the current value."""
        return len(self), "pairs"

    def position(self) -> int:
        return self._position

    _position = 0

    def read_all(self) -> ParallelCorpus:
        src: list[str] = []
        tgt: list[str] = []
        for s, t in self.chunks(1 << 16):
            src.extend(s)
            tgt.extend(t)
        return ParallelCorpus(src, tgt, self.origin)

    def sample(self, n: int, seed: int) -> tuple[list[str], list[str]]:
        """A uniform random sample of min(n, len) pairs (without replacement), in corpus order.

        Fixed by `seed`; when n >= len(self), every pair.
        """
        total = len(self)
        if n >= total:
            corpus = self.read_all()
            return corpus.src, corpus.tgt
        chosen = np.sort(np.random.default_rng(seed).choice(total, size=n, replace=False))
        src: list[str] = []
        tgt: list[str] = []
        start = 0
        for s, t in self.chunks(1 << 16):
            lo, hi = np.searchsorted(chosen, [start, start + len(s)])
            for i in chosen[lo:hi] - start:
                src.append(s[i])
                tgt.append(t[i])
            start += len(s)
        return src, tgt


class LocalSplit(SplitSource):
    """`{split}.{lang}[.gz]` files in a folder.

    The fingerprint is each file's resolved path, size and the SHA-256 of its bytes (`file_sha256`, remembered
    between starts while the file's status is unchanged): any edit changes it, even one that keeps the size and
    modification time; copying the folder elsewhere makes a new one.
    """

    def __init__(self, folder: Path, split: str, data: DataConfig) -> None:
        self.src_path = _local_file(folder, split, data.src_lang)
        self.tgt_path = _local_file(folder, split, data.tgt_lang)
        self.origin = f"{self.src_path} + {self.tgt_path}"
        self._len: int | None = None
        self._reader: LineReader | None = None

    def __len__(self) -> int:
        if self._len is None:
            n_src, n_tgt = count_lines(self.src_path), count_lines(self.tgt_path)
            self._check_counts(n_src, n_tgt)
            self._len = n_src
        return self._len

    def _check_counts(self, n_src: int, n_tgt: int) -> None:
        if n_src != n_tgt:
            raise DataError(
                f"{self.src_path} has {n_src} lines but {self.tgt_path} has {n_tgt}: "
                "parallel files must have one sentence per line on both sides"
            )

    def fingerprint(self, hash_memo: Optional[Path] = None) -> dict[str, Any]:
        """The files' resolved paths, sizes and SHA-256 of their bytes: the content itself, since editors,
        `rsync -a`, `cp -p` and tar can give changed data the same size and modification time."""

        def describe(path: Path) -> dict[str, Any]:
            return {
                "path": str(path.resolve()),
                "size": path.stat().st_size,
                "sha256": file_sha256(path, hash_memo),
            }

        return {"files": [describe(self.src_path), describe(self.tgt_path)]}

    def chunks(self, size: int) -> Iterator[tuple[list[str], list[str]]]:
        with LineReader(self.src_path) as src, LineReader(self.tgt_path) as tgt:
            self._reader, self._position = src, 0
            while True:
                s, t = src.read(size), tgt.read(size)
                if len(s) != len(
                    t
                ):  # one file ended first: count the rest of the other for the message
                    while src.read(1 << 16) or tgt.read(1 << 16):
                        pass
                    self._check_counts(src.lines_read, tgt.lines_read)
                if not s:
                    break
                yield s, t
            self._position, self._reader = src.bytes_read, None

    def progress(self) -> tuple[int, str]:
        return self.src_path.stat().st_size, "B"

    def position(self) -> int:
        return self._reader.bytes_read if self._reader is not None else self._position


class HuggingFaceSplit(SplitSource):
    """A split of a `datasets` source (hub id or json/csv/parquet loader), memory-mapped by `datasets`.

    The fingerprint is the dataset id, config, split and the `datasets` fingerprint of the loaded table (it
    changes with the dataset's revision or the local files' contents).
    """

    def __init__(self, split: str, data: DataConfig) -> None:
        try:
            import datasets
        except (
            ImportError
        ) as err:  # a dependency, but an install with --no-deps (a GPU image) can lack it
            missing = "" if data.path is None else f" (data.path {data.path} does not exist)"
            raise DataError(
                f"data.hf_dataset {data.hf_dataset!r}{missing}: loading it needs the datasets package: "
                f"pip install datasets ({err})"
            ) from None
        for library in (
            "datasets",
            "huggingface_hub",
        ):  # they print with a handler of their own: not twice
            logging.getLogger(library).propagate = False
        hf_split = data.hf_split_names.get(split, split)
        origin = (
            data.hf_dataset
            if data.data_files is None
            else f"{data.hf_dataset} files {data.data_files}"
        )
        kwargs = {}
        if data.data_files is not None:
            if split not in data.data_files:
                raise DataError(
                    f"data.data_files has no file for split {split!r} "
                    f"(it has {', '.join(data.data_files)})"
                )
            kwargs["data_files"] = {hf_split: data.data_files[split]}
        try:
            dataset = datasets.load_dataset(
                data.hf_dataset, data.hf_config, split=hf_split, **kwargs
            )
        except ValueError as err:  # e.g. unknown split or config
            raise DataError(f"{origin}: cannot load split {hf_split!r}: {err}") from None
        except FileNotFoundError as err:
            raise DataError(f"{origin}: not found ({err})") from None
        except OSError as err:  # ConnectionError and the hub's other network failures
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            hint = ""
            if data.path is not None:
                hint = (
                    f"; the local data.path {data.path} (here: {Path(data.path).resolve()}) does not exist: set "
                    "data.path to the folder with the {split}.{lang}.gz files, e.g. --set data.path=DIR"
                )
            raise DataError(
                f"{origin}: cannot load split {hf_split!r} from the Hugging Face hub: {reason}{hint}"
            ) from None
        self.origin = f"{origin} [{hf_split}]"
        self._spec = {
            "dataset": data.hf_dataset,
            "config": data.hf_config,
            "split": hf_split,
            "data_files": data.data_files and data.data_files.get(split),
        }
        self.dataset = dataset
        self.src_lang, self.tgt_lang = data.src_lang, data.tgt_lang
        columns = dataset.column_names
        if "translation" in columns:
            first = dataset[0]["translation"] if len(dataset) else {}
            missing = [lang for lang in (data.src_lang, data.tgt_lang) if lang not in first]
            if missing:
                raise DataError(
                    f"{self.origin}: the translation column has languages {', '.join(sorted(first))}, "
                    f"not {', '.join(missing)} (data.src_lang={data.src_lang}, "
                    f"data.tgt_lang={data.tgt_lang})"
                )
            self._columns = ["translation"]
        else:
            missing = [lang for lang in (data.src_lang, data.tgt_lang) if lang not in columns]
            if missing:
                raise DataError(
                    f"{self.origin}: no column {', '.join(missing)}; columns are {', '.join(columns)} "
                    "(expected a 'translation' column or one column per language)"
                )
            self._columns = [data.src_lang, data.tgt_lang]

    def __len__(self) -> int:
        return len(self.dataset)

    def fingerprint(self, hash_memo: Optional[Path] = None) -> dict[str, Any]:
        return {**self._spec, "fingerprint": self.dataset._fingerprint}

    def chunks(self, size: int) -> Iterator[tuple[list[str], list[str]]]:
        self._position = 0
        for rows in self.dataset.select_columns(self._columns).iter(batch_size=size):
            if "translation" in rows:
                pairs = rows["translation"]
                src, tgt = [p[self.src_lang] for p in pairs], [p[self.tgt_lang] for p in pairs]
            else:
                src, tgt = rows[self.src_lang], rows[self.tgt_lang]
            self._position += len(src)
            yield [s or "" for s in src], [t or "" for t in tgt]


def open_split(data: DataConfig, split: str) -> SplitSource:
    """One split, from `data.path` if that folder exists, otherwise from `data.hf_dataset`, ready to stream.

    Raises:
        DataError: missing folder/file/split/language, naming what is there.
    """
    if data.path is not None and Path(data.path).is_dir():
        return LocalSplit(Path(data.path), split, data)
    if data.hf_dataset is not None:
        if data.path is not None:
            logger.warning(
                "data.path %s does not exist (here: %s); loading %s from the Hugging Face dataset %s",
                data.path,
                Path(data.path).resolve(),
                split,
                data.hf_dataset,
            )
        return HuggingFaceSplit(split, data)
    raise DataError(f"data.path: folder {data.path} does not exist (and no data.hf_dataset is set)")


def load_split(data: DataConfig, split: str) -> ParallelCorpus:
    """Load one split into memory (for validation and test sets; training data goes through `token_cache`).

    Args:
        data: the data section of the config.
        split: our split name (e.g. "train", "val", "test_2016_flickr").

    Returns:
        The aligned corpus.

    Raises:
        DataError: missing folder/file/split/language, mismatched line counts, or an empty split,
            naming the file(s) and the counts.
    """
    corpus = open_split(data, split).read_all()
    if len(corpus) == 0:
        raise DataError(f"{corpus.origin}: split {split!r} is empty")
    return corpus


def file_sha256(path: Path, memo: Optional[Path] = None) -> str:
    """SHA-256 of a file's bytes, remembered in `memo` (a JSON file) under the file's resolved path, size,
    modification time, status-change time and inode. Any write to the file changes its status-change time (which
    no copying tool can set back), so a remembered digest is only reused for a file nobody has written since; the
    memo is best effort (a folder that cannot be written just means hashing again)."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}"
    known: dict[str, str] = {}
    if memo is not None and memo.is_file():
        try:
            known = json.loads(memo.read_text())
        except (OSError, ValueError):
            known = {}
        if key in known:
            return known[key]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if memo is not None:
        known = {k: v for k, v in known.items() if not k.startswith(f"{path.resolve()}|")}
        known[key] = digest
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(known, indent=0))
            os.replace(tmp, memo)
        except OSError:
            tmp.unlink(missing_ok=True)
    return digest
