"""The one text reader: every text file the project reads (training and validation corpora, evaluation sources and
references, translation input, stdin) goes through `LineReader`, `StreamLineReader` or `split_lines`, with the
same rules.

Rules, in the order they apply:
- The file is UTF-8, plain or gzip-compressed (chosen by the `.gz` suffix).
- A UTF-8 byte-order mark (EF BB BF) at the very start of the file is dropped (editors on Windows add it).
- A line ends at "\\n" only — never at U+2028, U+0085 or the other characters `str.splitlines` treats as line
  breaks — so that the two sides of a parallel corpus stay aligned.
- "\\r\\n" endings: the "\\r" before the "\\n" is dropped; a "\\r" anywhere else is kept.
- A last line without "\\n" is a line; an empty file has no lines.
- Invalid UTF-8 or a NUL byte: `DataError` naming the file and the 1-based line (a NUL byte means a binary or
  corrupt file, and sentencepiece would silently cut the sentence there).

The reader streams: `LineReader.read(n)` decodes blocks of a few MB at a time, so a corpus of any size is read in
bounded memory.
"""

from __future__ import annotations

import gzip
import io
import os
import select
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Optional, TextIO

from tqdm import tqdm


class DataError(ValueError):
    """A corpus file is missing, empty, unreadable or misaligned, or a language is not in the source."""


_BOM = "\ufeff"


def decode_lines(
    block: bytes, name: str, first_line: int = 1, at_file_start: bool = True
) -> list[str]:
    """Decode a block of complete lines (the block's last line needs no "\\n") by the rules above.

    Args:
        block: UTF-8 bytes; every "\\n" ends a line. An empty block is one empty line.
        name: file name for messages.
        first_line: 1-based number of the block's first line in the file.
        at_file_start: the block starts the file (a byte-order mark is dropped).

    Raises:
        DataError: invalid UTF-8 or a NUL byte, naming `name` and the line.
    """
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + block.count(b"\n", 0, err.start)
        column = err.start - (block.rfind(b"\n", 0, err.start) + 1)
        raise DataError(
            f"{name}, line {line}: not valid UTF-8 ({err.reason} at byte {column} of the line)"
        ) from None
    if "\x00" in text:
        line = first_line + text.count("\n", 0, text.index("\x00"))
        raise DataError(f"{name}, line {line}: contains a NUL byte (a binary or corrupt file?)")
    if at_file_start and text.startswith(_BOM):
        text = text[1:]
    lines = text.split("\n")
    if "\r" in text:
        lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    return lines


def split_lines(raw: bytes, name: str) -> list[str]:
    """All lines of in-memory bytes (e.g. stdin), by the rules above."""
    if not raw:
        return []
    return decode_lines(raw[:-1] if raw.endswith(b"\n") else raw, name)


class StreamLineReader:
    """Lines of a stream that may still be being written (stdin: a pipe, a terminal), by the rules above.

    `read_available(n)` waits for one complete line (or the end of the stream), then takes the further complete
    lines that have already arrived, up to n, without waiting: typed input is translated line by line, piped input
    in chunks. It reads the file descriptor directly (`os.read`, `select`), so nothing sits unseen in a buffer.

    Args:
        stream: a binary stream with a file descriptor (e.g. `sys.stdin.buffer`).
        name: the name used in error messages.
    """

    def __init__(self, stream: BinaryIO, name: str = "<stdin>") -> None:
        self.stream = stream  # held: the descriptor closes with it
        self.fd = stream.fileno()
        self.name = name
        self._buffer = b""
        self._eof = False
        self.lines_read = 0

    WAKE_SECONDS = 0.5
    """While waiting for input, return to Python this often: a Ctrl-C (SIGINT) that lands in the instant before the
    wait begins (or in another thread) does not interrupt the wait; Python acts on it at its next return."""

    def _read_more(self, wait: bool) -> bool:
        """Read what the descriptor has (waiting for something if `wait`); False if nothing was there."""
        while not select.select([self.fd], [], [], self.WAKE_SECONDS if wait else 0)[0]:
            if not wait:
                return False
        block = os.read(self.fd, 1 << 16)
        if not block:
            self._eof = True
        self._buffer += block
        return True

    def read_available(self, n: int) -> list[str]:
        """At least one line unless the stream has ended, then at most n - 1 more that are already there."""
        while b"\n" not in self._buffer and not self._eof:
            self._read_more(wait=True)
        while self._buffer.count(b"\n") < n and not self._eof and self._read_more(wait=False):
            pass
        parts = self._buffer.split(b"\n", n)
        if len(parts) > n:
            complete, self._buffer = parts[:n], parts[n]
        else:
            complete, self._buffer = parts[:-1], parts[-1]
        if self._eof and self._buffer and len(complete) < n:  # a last line without "\n"
            complete.append(self._buffer)
            self._buffer = b""
        if not complete:
            return []
        lines = decode_lines(
            b"\n".join(complete), self.name, self.lines_read + 1, self.lines_read == 0
        )
        self.lines_read += len(lines)
        return lines


class LineReader:
    """Lines of one text file, read incrementally by the rules above.

    Args:
        path: a plain or `.gz` UTF-8 file.
        block_size: bytes read (decompressed) per block.

    Raises:
        DataError: the file is missing or unreadable (on creation), or holds text the rules refuse (on read).
    """

    def __init__(self, path: str | Path, block_size: int = 1 << 22) -> None:
        self.path = Path(path)
        self.name = str(path)
        self.block_size = block_size
        try:
            self._raw: BinaryIO = open(self.path, "rb")
        except FileNotFoundError:
            raise DataError(f"{self.path}: file not found") from None
        except OSError as err:
            raise DataError(f"{self.path}: cannot read ({err})") from None
        self._file: BinaryIO = (
            gzip.GzipFile(fileobj=self._raw) if self.path.suffix == ".gz" else self._raw
        )
        self.size = self.path.stat().st_size
        self._pending = b""
        self._lines: list[str] = []
        self._pos = 0
        self._decoded = 0  # lines decoded so far
        self.lines_read = 0
        """Lines returned so far."""
        self._eof = False

    @property
    def bytes_read(self) -> int:
        """Position in the file on disk (compressed bytes for .gz), for progress bars."""
        return self._raw.tell()

    def _fill(self) -> None:
        try:
            block = self._file.read(self.block_size)
        except (OSError, EOFError) as err:
            raise DataError(f"{self.path}: cannot read ({err})") from None
        at_start = self._decoded == 0 and not self._pending
        if not block:
            self._eof = True
            if self._pending:
                self._append(decode_lines(self._pending, self.name, self._decoded + 1, at_start))
                self._pending = b""
            return
        data = self._pending + block
        cut = data.rfind(b"\n")
        if cut < 0:
            self._pending = data
            return
        self._pending = data[cut + 1 :]
        self._append(decode_lines(data[:cut], self.name, self._decoded + 1, at_start))

    def _append(self, lines: list[str]) -> None:
        if self._pos:
            del self._lines[: self._pos]
            self._pos = 0
        self._lines.extend(lines)
        self._decoded += len(lines)

    def read(self, n: int) -> list[str]:
        """The next `n` lines; fewer only at the end of the file."""
        while len(self._lines) - self._pos < n and not self._eof:
            self._fill()
        out = self._lines[self._pos : self._pos + n]
        self._pos += len(out)
        self.lines_read += len(out)
        return out

    def read_all(self) -> list[str]:
        lines: list[str] = []
        while chunk := self.read(1 << 20):
            lines.extend(chunk)
        return lines

    def close(self) -> None:
        self._file.close()
        self._raw.close()

    def __enter__(self) -> "LineReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_lines(path: str | Path) -> list[str]:
    """All lines of a text file (plain or .gz) by the rules above.

    Raises:
        DataError: missing file, invalid UTF-8 or a NUL byte (naming the file and line).
    """
    with LineReader(path) as reader:
        return reader.read_all()


def count_lines(path: str | Path, block_size: int = 1 << 24) -> int:
    """Number of lines of a text file by the rules above, without decoding it (for sampling and progress)."""
    path = Path(path)
    opener: Optional[type] = gzip.open if path.suffix == ".gz" else open
    n, last = 0, b"\n"
    try:
        with opener(path, "rb") as f:
            while block := f.read(block_size):
                n += block.count(b"\n")
                last = block[-1:]
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError) as err:
        raise DataError(f"{path}: cannot read ({err})") from None
    return n + (last != b"\n")


def utf8_stdout():
    """stdout, writing UTF-8 whatever the locale (LC_ALL=C) or PYTHONIOENCODING say: input is always read as UTF-8,
    and a translation with "ä" must not fail or change encoding on the way out."""
    if (
        hasattr(sys.stdout, "reconfigure")
        and (sys.stdout.encoding or "").lower().replace("-", "") != "utf8"
    ):
        sys.stdout.reconfigure(encoding="utf-8", errors="strict")
    return sys.stdout


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of a broken or full stdout stays quiet."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (stdout replaced, e.g. by a test harness)
        pass


def write_and_flush(out: TextIO, text: str, name: str) -> None:
    """Write `text` to `out` and flush it.

    Raises:
        BrokenPipeError: the reader of a pipe went away (the CLI stops quietly).
        DataError: any other write error (a full disk, /dev/full), naming `name`; stdout is then silenced.
    """
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as err:
        if out is sys.stdout:
            silence_stdout()
        raise DataError(f"{name}: cannot write the translations: {err.strerror or err}") from None


def close_output(out: TextIO, name: str) -> None:
    """Close a file that `write_and_flush` wrote to.

    Raises:
        DataError: the close failed (it writes what a failed write left in the buffer: a full disk), naming
            `name`; it replaces the error of that failed write, which said the same.
    """
    try:
        out.close()
    except OSError as err:
        raise DataError(f"{name}: cannot write the translations: {err.strerror or err}") from None


class TranslationOutput:
    """Where `transformer translate` writes: stdout, or a file written whole. A file's translations go to
    `PATH.partial`, renamed to PATH once every line is done (replacing an earlier PATH); a run that stops early (an
    error, Ctrl-C) leaves PATH as it was and keeps `PATH.partial` with the translations written so far (and says so
    on stderr), or removes it when there were none. A PATH that exists and is not a regular file (a pipe, a device)
    is written directly.

    Args:
        path: the output file, or None for stdout.
    """

    def __init__(self, path: Optional[str]) -> None:
        self.path, self.n_lines = path, 0
        direct = path is not None and os.path.exists(path) and not os.path.isfile(path)
        # a symbolic link: the file it names is replaced
        self._final = os.path.realpath(path) if path else None
        self.partial = Path(f"{self._final}.partial") if path and not direct else None
        if self.partial is not None:
            self.partial.parent.mkdir(parents=True, exist_ok=True)
        target = self.partial or path
        self.file = open(target, "w", encoding="utf-8") if target else utf8_stdout()

    def write(self, text: str, n_lines: int) -> None:
        """Write and flush the translations of `n_lines` input lines (`write_and_flush`)."""
        write_and_flush(self.file, text, self.path or "stdout")
        self.n_lines += n_lines

    def close(self, complete: bool) -> None:
        """Finish: a complete file takes its place; see the class docstring for the rest.

        Raises:
            DataError: the file could not be written whole (`close_output`); the partial file is removed.
        """
        if self.partial is None:
            if self.path:
                close_output(self.file, self.path)
            return
        try:
            close_output(self.file, str(self.path))
        except DataError:
            self.partial.unlink(missing_ok=True)
            raise
        if complete:
            os.replace(self.partial, str(self._final))
        elif self.n_lines:
            print(
                f"translate: stopped after {self.n_lines} input lines; their translations are in {self.partial} "
                f"({self.path} was not written)",
                file=sys.stderr,
            )
        else:
            self.partial.unlink(missing_ok=True)


FIRST_CHUNK = 16
"""Lines in the first chunk that `input_chunks` reads when its output streams (`growing`)."""


def is_streaming(stream: TextIO) -> bool:
    """Whether `stream` is a pipe, a socket or a terminal (a reader waits on it), not a regular file or a buffer."""
    try:
        return not stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError, io.UnsupportedOperation):
        return False


def chunk_sizes(buffer_size: int, first: int) -> Iterator[int]:
    """`first`, twice that, ... up to buffer_size, then buffer_size for ever."""
    size = min(first, buffer_size)
    while True:
        yield size
        size = min(2 * size, buffer_size)


def input_chunks(
    sentences: list[str],
    path: Optional[str],
    buffer_size: int,
    progress: bool,
    growing: bool = False,
) -> Iterator[list[str]]:
    """Input lines in chunks of at most buffer_size lines: the `sentences` given (one chunk), else the file at `path`
    read incrementally (with a progress bar on stderr if `progress`), else stdin as lines arrive
    (`StreamLineReader`). With `growing`, the chunks start at FIRST_CHUNK lines and double up to buffer_size: for
    output that streams (a pipe, a terminal), whose reader (`head -n 2`) gets the first lines after a short chunk
    and may stop there, while later lines come in large, well-batched chunks."""
    if sentences:
        yield list(sentences)
        return
    sizes = chunk_sizes(buffer_size, FIRST_CHUNK if growing else buffer_size)
    if path:
        with (
            LineReader(path) as reader,
            tqdm(
                total=count_lines(path),
                unit="line",
                disable=not progress,
                file=sys.stderr,
                desc="translate",
            ) as bar,
        ):
            while chunk := reader.read(next(sizes)):
                yield chunk
                bar.update(len(chunk))
        return
    reader = StreamLineReader(sys.stdin.buffer)
    while chunk := reader.read_available(next(sizes)):
        yield chunk
