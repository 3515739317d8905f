"""Parallel corpora from local text files or from Hugging Face `datasets`.

Local layout (Multi30k): a folder with `{split}.{lang}` or `{split}.{lang}.gz`, one sentence per line.
Lines are split on "\\n" only (never on U+2028, U+0085 or other characters that `str.splitlines` treats as
line breaks), so that the two sides stay aligned.

`datasets` sources: a hub id with an optional config name (`bentrevett/multi30k`; `wmt14` with `de-en`),
or a loader name (`json`, `csv`, `parquet`) with local `data_files`; rows hold either a `translation`
mapping {lang: text} or one column per language.
"""

from __future__ import annotations

import gzip
import logging
from dataclasses import dataclass
from pathlib import Path

from ..config import DataConfig

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A corpus file is missing, empty, unreadable or misaligned, or a language is not in the source."""


@dataclass
class ParallelCorpus:
    """Aligned source and target sentences of one split.

    Attributes:
        src, tgt: lists of the same length.
        origin: where the data came from, for messages (file names or dataset id).
    """

    src: list[str]
    tgt: list[str]
    origin: str

    def __len__(self) -> int:
        return len(self.src)


def read_lines(path: str | Path) -> list[str]:
    """Read a UTF-8 text file (plain or .gz), one item per "\\n"-terminated line.

    Raises:
        DataError: if the file is missing, or a line is not valid UTF-8 (naming the line number).
    """
    path = Path(path)
    try:
        raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError) as err:
        raise DataError(f"{path}: cannot read ({err})") from None
    return split_lines(raw, str(path))


def split_lines(raw: bytes, name: str) -> list[str]:
    """Decode UTF-8 bytes into lines split on "\n" only ("\r\n" endings tolerated).

    Raises:
        DataError: if a line is not valid UTF-8, naming `name` and the line number.
    """
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for number, line in enumerate(lines, start=1):
        try:
            out.append(line.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as err:
            raise DataError(f"{name}, line {number}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    return out


def _local_file(folder: Path, split: str, lang: str) -> Path:
    for name in (f"{split}.{lang}.gz", f"{split}.{lang}"):
        if (folder / name).exists():
            return folder / name
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    langs = sorted({p.split(".")[1] for p in present if p.startswith(f"{split}.") and p.count(".") >= 1})
    hint = f"; languages present for split {split!r}: {', '.join(langs)}" if langs else \
        f"; files there: {', '.join(present[:12]) or 'none'}"
    raise DataError(f"{folder}: no file {split}.{lang}.gz or {split}.{lang}{hint}")


def _load_local(folder: Path, split: str, data: DataConfig) -> ParallelCorpus:
    src_path = _local_file(folder, split, data.src_lang)
    tgt_path = _local_file(folder, split, data.tgt_lang)
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: "
                        "parallel files must have one sentence per line on both sides")
    return ParallelCorpus(src, tgt, f"{src_path} + {tgt_path}")


def _load_hf(split: str, data: DataConfig) -> ParallelCorpus:
    import datasets

    hf_split = data.hf_split_names.get(split, split)
    origin = data.hf_dataset if data.data_files is None else f"{data.hf_dataset} files {data.data_files}"
    kwargs = {}
    if data.data_files is not None:
        if split not in data.data_files:
            raise DataError(f"data.data_files has no file for split {split!r} (it has {', '.join(data.data_files)})")
        kwargs["data_files"] = {hf_split: data.data_files[split]}
    try:
        dataset = datasets.load_dataset(data.hf_dataset, data.hf_config, split=hf_split, **kwargs)
    except ValueError as err:  # e.g. unknown split or config
        raise DataError(f"{origin}: cannot load split {hf_split!r}: {err}") from None
    except FileNotFoundError as err:
        raise DataError(f"{origin}: not found ({err})") from None
    columns = dataset.column_names
    if "translation" in columns:
        first = dataset[0]["translation"] if len(dataset) else {}
        missing = [lang for lang in (data.src_lang, data.tgt_lang) if lang not in first]
        if missing:
            raise DataError(f"{origin} split {hf_split!r}: the translation column has languages "
                            f"{', '.join(sorted(first))}, not {', '.join(missing)} "
                            f"(data.src_lang={data.src_lang}, data.tgt_lang={data.tgt_lang})")
        pairs = dataset["translation"]
        src, tgt = [p[data.src_lang] for p in pairs], [p[data.tgt_lang] for p in pairs]
    else:
        missing = [lang for lang in (data.src_lang, data.tgt_lang) if lang not in columns]
        if missing:
            raise DataError(f"{origin} split {hf_split!r}: no column {', '.join(missing)}; columns are "
                            f"{', '.join(columns)} (expected a 'translation' column or one column per language)")
        src, tgt = dataset[data.src_lang], dataset[data.tgt_lang]
    return ParallelCorpus([s or "" for s in src], [t or "" for t in tgt], f"{origin} [{hf_split}]")


def load_split(data: DataConfig, split: str) -> ParallelCorpus:
    """Load one split from `data.path` if that folder exists, otherwise from `data.hf_dataset`.

    Args:
        data: the data section of the config.
        split: our split name (e.g. "train", "val", "test_2016_flickr").

    Returns:
        The aligned corpus.

    Raises:
        DataError: missing folder/file/split/language, mismatched line counts, or an empty split,
            naming the file(s) and the counts.
    """
    if data.path is not None and Path(data.path).is_dir():
        corpus = _load_local(Path(data.path), split, data)
    elif data.hf_dataset is not None:
        if data.path is not None:
            logger.info("data.path %s does not exist; loading %s from %s", data.path, split, data.hf_dataset)
        corpus = _load_hf(split, data)
    else:
        raise DataError(f"data.path: folder {data.path} does not exist (and no data.hf_dataset is set)")
    if len(corpus) == 0:
        raise DataError(f"{corpus.origin}: split {split!r} is empty")
    return corpus
