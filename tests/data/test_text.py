"""The one text reader: its rules for line endings, byte-order marks, NUL bytes and invalid UTF-8, streamed or not."""

import gzip

import pytest

from transformer.data import DataError, LineReader, read_lines, split_lines
from transformer.data.text import count_lines


def _write(path, raw: bytes):
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


@pytest.mark.parametrize("name", ["a.txt", "a.txt.gz"])
def test_rules(tmp_path, name):
    raw = "\ufeffeins\r\nzwei\rdrei\n\nvier\u2028fünf\x85\nlast".encode()
    path = _write(tmp_path / name, raw)
    expected = ["eins", "zwei\rdrei", "", "vier\u2028fünf\x85", "last"]
    assert read_lines(path) == expected  # BOM dropped, \r\n -> \n, lone \r kept, no split on U+2028/U+0085
    assert split_lines(raw, "<stdin>") == expected
    assert count_lines(path) == len(expected)


def test_bom_only_at_the_start(tmp_path):
    path = _write(tmp_path / "a.txt", "\ufeffa\n\ufeffb\n".encode())
    assert read_lines(path) == ["a", "\ufeffb"]


def test_streamed_in_small_blocks_equals_whole(tmp_path):
    lines = [f"Satz {i} " + "ä" * (i % 7) for i in range(1000)]
    path = _write(tmp_path / "a.txt", ("\r\n".join(lines) + "\r\n").encode())
    reader = LineReader(path, block_size=37)  # blocks cut lines and multi-byte characters
    got = []
    while chunk := reader.read(13):
        got.extend(chunk)
    assert got == lines and reader.lines_read == 1000
    assert count_lines(path) == 1000


def test_empty_file_and_trailing_newline(tmp_path):
    assert read_lines(_write(tmp_path / "e.txt", b"")) == []
    assert read_lines(_write(tmp_path / "n.txt", b"\n")) == [""]
    assert read_lines(_write(tmp_path / "t.txt", b"a\nb\n")) == ["a", "b"]
    assert split_lines(b"", "x") == [] and split_lines(b"a\nb", "x") == ["a", "b"]


@pytest.mark.parametrize("block_size", [4, 1 << 20])
def test_invalid_utf8_names_file_and_line(tmp_path, block_size):
    path = _write(tmp_path / "x.de", b"ok\nalso ok\nbad \xff byte\nfine\n")
    with pytest.raises(DataError, match=r"x\.de, line 3: not valid UTF-8 .* at byte 4 of the line"):
        LineReader(path, block_size=block_size).read_all()


def test_nul_byte_names_file_and_line(tmp_path):
    path = _write(tmp_path / "x.en", b"one\ntwo\nthr\x00ee\n")
    with pytest.raises(DataError, match=r"x\.en, line 3: contains a NUL byte"):
        read_lines(path)
    with pytest.raises(DataError, match=r"<stdin>, line 2: contains a NUL byte"):
        split_lines(b"a\n\x00\n", "<stdin>")


def test_missing_and_corrupt_gzip(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        read_lines(tmp_path / "nope.txt")
    bad = tmp_path / "bad.gz"
    bad.write_bytes(gzip.compress(b"a\nb\n" * 1000)[:-30])
    with pytest.raises(DataError, match=r"bad\.gz: cannot read"):
        read_lines(bad)


# --------------------------------------------------------------------------------------------------
# StreamLineReader: stdin as it arrives
# --------------------------------------------------------------------------------------------------


def _pipe_reader():
    import os

    from transformer.data import StreamLineReader
    read_fd, write_fd = os.pipe()
    return StreamLineReader(os.fdopen(read_fd, "rb")), write_fd


def test_stream_reader_returns_what_has_arrived_without_waiting_for_more():
    import os

    reader, w = _pipe_reader()
    os.write(w, "\ufeffeins\r\nzwei\ndr".encode())
    assert reader.read_available(10) == ["eins", "zwei"]  # "dr" is not a line yet: not waited for
    os.write(w, b"ei\nvier\nf")
    assert reader.read_available(1) == ["drei"]  # at most n
    assert reader.read_available(10) == ["vier"]
    os.write(w, "\u00fcnf\n\nsechs".encode())
    os.close(w)
    assert reader.read_available(10) == ["fünf", "", "sechs"]  # a last line without "\n" at the end
    assert reader.read_available(10) == []


def test_stream_reader_applies_the_same_rules():
    import os

    reader, w = _pipe_reader()
    os.write(w, b"gut\n\xef\xbb\xbfmitten\nkaputt \xff\n")
    os.close(w)
    with pytest.raises(DataError, match=r"<stdin>, line 3: not valid UTF-8"):
        reader.read_available(10)
    reader, w = _pipe_reader()
    os.write(w, b"a\nb\n")
    assert reader.read_available(10) == ["a", "b"]
    os.write(w, b"c\x00\n")
    os.close(w)
    with pytest.raises(DataError, match=r"<stdin>, line 3: contains a NUL byte"):
        reader.read_available(10)


def test_stream_reader_acts_on_a_ctrl_c_that_did_not_interrupt_its_wait():
    """SIGINT raised in another thread sets Python's flag without interrupting the main thread's wait, as a Ctrl-C
    landing just before the wait begins does (`transformer translate` then hung on typed input until the next
    line); the reader must wake and raise KeyboardInterrupt within a second, not when the next line comes (5 s)."""
    import os
    import signal
    import threading
    import time

    reader, w = _pipe_reader()
    # Python's Ctrl-C handler, as from a terminal (a shell's background job, `make test &`, starts with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    late_line = threading.Timer(5.0, os.write, [w, b"late\n"])  # ends the wait if the reader never wakes
    try:
        threading.Timer(0.2, signal.raise_signal, [signal.SIGINT]).start()
        late_line.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            reader.read_available(10)
        elapsed = time.monotonic() - start
    finally:
        signal.signal(signal.SIGINT, previous)
        late_line.cancel()
        late_line.join()
        os.close(w)
    assert elapsed < 2.0
