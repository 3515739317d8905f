"""Safe files: the errors of reading a model and of writing an export, and folders written all at once.

An export (CTranslate2, Hugging Face) is built under a temporary name beside its destination and renamed into place
when complete (`write_folder`), and replaces an existing folder only when asked to and only if that folder is an
earlier export or empty (`check_replaceable`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


class CheckpointError(ValueError):
    """A checkpoint file (or model folder) is missing, truncated, corrupt, or holds more than plain data."""


class ExportError(ValueError):
    """A model cannot be exported (or imported), an output folder cannot be replaced, or a converter is missing."""


def check_replaceable(
    output_dir: Path, force: bool, is_earlier_export: Callable[[Path], bool], marks: str
) -> None:
    """Refuse an existing output unless `force` and it is an earlier export or an empty folder.

    Args:
        is_earlier_export: tells an earlier export of the same kind.
        marks: what such an export holds, for the message (e.g. "no model.bin and transformer_nmt.json").

    Raises:
        ExportError: naming the folder and what it holds.
    """
    if not output_dir.exists() and not output_dir.is_symlink():
        return
    if not force:
        raise ExportError(f"{output_dir} exists; use --force to replace it")
    if output_dir.is_symlink() or not output_dir.is_dir():
        raise ExportError(
            f"--output {output_dir} is not a folder; --force replaces only an earlier export's folder"
        )
    if not is_earlier_export(output_dir) and any(output_dir.iterdir()):
        names = sorted(p.name for p in output_dir.iterdir())
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ExportError(
            f"--output {output_dir} holds files ({shown}) but is not an earlier export ({marks}); "
            "--force replaces only an export or an empty folder: choose another --output"
        )


def with_default_mode(path: Path) -> None:
    """Give `path` (a file, or a folder and everything in it) the permissions that open() and mkdir() give under
    the process's umask: temporary files and folders are created private (0600, 0700), and a checkpoint or export
    renamed from one would stay unreadable to other users."""
    umask = os.umask(0)
    os.umask(umask)
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~umask)


def write_file(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write the file `path` whole or not at all: `write(f)` into a temporary file beside it, flushed to disk and
    given the usual permissions (`with_default_mode`), then renamed over `path`. A failure, or a process killed
    while writing, leaves `path` as it was (a kill can leave the hidden temporary file).

    Raises:
        OSError: the folder cannot be written (a full disk, a folder in the way); whatever `write` raises.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        with_default_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_folder(output_dir: Path, write: Callable[[Path], None]) -> None:
    """Build a folder under a temporary name beside `output_dir` (`write(staging)`), then rename it into place.

    A failure leaves no partial folder; an existing `output_dir` (already checked by `check_replaceable`) is
    replaced only once the new one is complete, and is put back if the rename fails.
    """
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        write(staging)
        with_default_mode(staging)
        # an earlier export or an empty folder (checked): out of the way, then gone
        if output_dir.exists():
            retired = Path(
                tempfile.mkdtemp(prefix=f".{output_dir.name}.old.", dir=output_dir.parent)
            )
            output_dir.rename(retired / output_dir.name)
            try:
                staging.rename(output_dir)
            except BaseException:
                (retired / output_dir.name).rename(
                    output_dir
                )  # the earlier export back in its place
                raise
            shutil.rmtree(retired)
        else:
            staging.rename(output_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def sha256_of(path: Path) -> str:
    """SHA-256 of a file's bytes, or of a folder's files' bytes in name order (how `origin.json` names a model)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        with open(file, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()
