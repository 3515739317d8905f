"""The token cache: equals in-memory encoding, is found again, is rebuilt when its inputs change, never half-built."""

import errno
import hashlib
import json
import logging
import os

import numpy as np
import pytest

from transformer.config import EOS_ID, DataConfig
from transformer.data import EncodedPairs, TokenCacheError, get_token_cache, make_batch, open_split
from transformer.data import token_cache as tc
from transformer.tokenizer import train_tokenizer

SRC = ["Ein Hund läuft.", "Zwei Katzen schlafen im Gras.", "", "Ein Mann fährt Fahrrad auf der Straße.",
       "Kinder spielen.", "wort " * 40, "Eine Frau singt."]
TGT = ["A dog runs.", "Two cats sleep in the grass.", "Nothing.", "A man rides a bike on the street.", "",
       "word " * 40, "A woman sings."]


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.de").write_text("".join(s + "\n" for s in SRC * 30), encoding="utf-8")
    (folder / "train.en").write_text("".join(s + "\n" for s in TGT * 30), encoding="utf-8")
    return folder


def _config(corpus, tmp_path, **changes):
    return DataConfig(**{"path": str(corpus), "vocab_size": 120, "max_len": 20, "cache_dir": str(tmp_path / "cache"),
                         **changes})


@pytest.fixture
def tokenizer(corpus, tmp_path):
    data = _config(corpus, tmp_path)
    return train_tokenizer(SRC * 30, TGT * 30, data)


def test_cache_equals_in_memory_encoding_and_drops_what_it_says(corpus, tmp_path, tokenizer):
    data = _config(corpus, tmp_path)
    pairs = get_token_cache(data, "train", tokenizer)
    assert isinstance(pairs.src_ids, np.memmap) and pairs.src_ids.dtype == np.uint16
    src, tgt = tokenizer.encode_src(SRC * 30), tokenizer.encode_tgt(TGT * 30)
    kept = [i for i in range(len(src)) if 1 < len(src[i]) <= 20 and 0 < len(tgt[i]) < 20]
    assert len(kept) == 4 * 30  # empty source, empty target, too long: dropped
    assert len(pairs) == len(kept)
    for j, i in enumerate(kept):
        assert pairs.src(j).tolist() == src[i] and pairs.src(j)[-1] == EOS_ID
        assert pairs.tgt(j).tolist() == tgt[i]
    assert pairs.src_lengths.tolist() == [len(src[i]) for i in kept]
    assert pairs.tgt_lengths.tolist() == [len(tgt[i]) + 1 for i in kept]
    expected = make_batch([src[i] for i in kept[:5]], [tgt[i] for i in kept[:5]])
    got = pairs.batch([0, 1, 2, 3, 4])
    for name in ("src", "src_key_padding_mask", "tgt_in", "tgt_out"):
        assert getattr(got, name).equal(getattr(expected, name)), name
    assert (got.n_src_tokens, got.n_tgt_tokens) == (expected.n_src_tokens, expected.n_tgt_tokens)
    (folder,) = (tmp_path / "cache").glob("train.de-en.*")
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["n_read"], meta["n_pairs"], meta["dropped_empty"], meta["dropped_too_long"]) == (210, 120, 60, 30)


def test_found_again_without_rebuilding(corpus, tmp_path, tokenizer, monkeypatch):
    data = _config(corpus, tmp_path)
    first = get_token_cache(data, "train", tokenizer)
    monkeypatch.setattr(tc, "build_token_cache", lambda *a, **k: pytest.fail("rebuilt a cache that was there"))
    again = get_token_cache(data, "train", tokenizer)
    assert np.array_equal(first.src_ids, again.src_ids) and np.array_equal(first.tgt_offsets, again.tgt_offsets)
    waiting = get_token_cache(data, "train", tokenizer, build=False)  # what torchrun's other ranks do
    assert len(waiting) == len(first)
    # The spec it was built from travels with it (subword samples extend it without fingerprinting the corpus again).
    assert first.spec == again.spec == tc.cache_spec(open_split(data, "train"), tokenizer, data)
    assert first.spec["corpus"]["files"][0]["sha256"]


def test_changed_corpus_or_tokenizer_gets_a_new_cache(corpus, tmp_path, tokenizer, caplog, monkeypatch):
    data = _config(corpus, tmp_path)
    get_token_cache(data, "train", tokenizer)
    with (corpus / "train.de").open("a") as f, (corpus / "train.en").open("a") as g:
        f.write("Noch ein Satz.\n")
        g.write("One more sentence.\n")
    with caplog.at_level(logging.INFO):
        changed = get_token_cache(data, "train", tokenizer)
    assert len(changed) == 121
    line = next(r.getMessage() for r in caplog.records if "no existing cache fits" in r.getMessage())
    assert "corpus.files.0.size=9690 (this run: 9705)" in line and len(line) < 600  # short: names and digest starts
    other = train_tokenizer(SRC * 30, TGT * 30, _config(corpus, tmp_path, vocab_size=60))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        get_token_cache(data, "train", other)
    assert "tokenizer_sha256=" in caplog.text
    assert len(list((tmp_path / "cache").glob("train.de-en.*"))) == 3
    # Opening a cache with another tokenizer's spec is refused, naming both digests.
    old_folder = tc.cache_folder(tc.cache_root(data), "train", data,
                                 tc.cache_spec(open_split(data, "train"), tokenizer, data))
    new_spec = tc.cache_spec(open_split(data, "train"), other, data)
    with pytest.raises(TokenCacheError, match="built from other data or another tokenizer: tokenizer_sha256=") as err:
        tc.open_token_cache(old_folder, new_spec)
    assert tc.tokenizer_digest(tokenizer) in str(err.value) and tc.tokenizer_digest(other) in str(err.value)
    # A cache written when text became ids another way (an earlier ENCODING_VERSION) is not found again.
    fresh = _config(corpus, tmp_path / "fresh")
    monkeypatch.setattr(tc, "ENCODING_VERSION", tc.ENCODING_VERSION - 1)
    old = get_token_cache(fresh, "train", tokenizer)
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        new = get_token_cache(fresh, "train", tokenizer)
    assert old.spec["encoding"] == tc.ENCODING_VERSION - 1 and new.spec["encoding"] == tc.ENCODING_VERSION
    assert f"encoding={tc.ENCODING_VERSION - 1} (this run: {tc.ENCODING_VERSION})" in caplog.text


def test_data_changed_behind_the_same_size_and_time_gets_a_new_cache(corpus, tmp_path, tokenizer, monkeypatch):
    """What an editor, `rsync -a`, `cp -p` or tar can do: new bytes, same size, modification time set back."""
    data = _config(corpus, tmp_path)
    get_token_cache(data, "train", tokenizer)
    path = corpus / "train.de"
    before = path.stat()
    path.write_text(path.read_text(encoding="utf-8").replace("Ein Hund läuft.", "Ein Hund rannte."), encoding="utf-8")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    changed = get_token_cache(data, "train", tokenizer)
    assert tokenizer.encode_src(["Ein Hund rannte."])[0] == changed.src(0).tolist()
    assert len(list((tmp_path / "cache").glob("train.de-en.*"))) == 2
    # A touched file with the same bytes is the same corpus: found again, and hashed again only after the touch.
    os.utime(path)
    hashed, real_digest = [], hashlib.file_digest

    def counting_digest(f, name):
        hashed.append(f.name)
        return real_digest(f, name)

    monkeypatch.setattr(tc, "build_token_cache", lambda *a, **k: pytest.fail("rebuilt for the same bytes"))
    monkeypatch.setattr(hashlib, "file_digest", counting_digest)
    assert len(get_token_cache(data, "train", tokenizer)) == len(changed)
    assert hashed == [str(path)]  # train.en's digest was remembered: not read again
    hashed.clear()
    get_token_cache(data, "train", tokenizer)
    assert hashed == []


def _refuse_lock_files(monkeypatch):
    """What a folder this process may not write does to the lock file (also when tests run as root)."""
    def open_unless_lock(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return open(path, *args, **kwargs)
    monkeypatch.setattr(tc, "open", open_unless_lock, raising=False)


def test_an_unwritable_cache_folder_is_one_line_naming_it_and_a_complete_one_is_used(corpus, tmp_path, tokenizer,
                                                                                     monkeypatch):
    shared = _config(corpus, tmp_path, cache_dir=str(tmp_path / "shared"))
    built = get_token_cache(shared, "train", tokenizer)
    with monkeypatch.context() as patch:
        _refuse_lock_files(patch)
        locked = tmp_path / "locked"
        locked.mkdir()
        with pytest.raises(TokenCacheError, match=f"cannot write the token cache folder {locked} \\(Permission "
                                                  "denied\\): make it writable or set data.cache_dir"):
            get_token_cache(_config(corpus, tmp_path, cache_dir=str(locked)), "train", tokenizer)
        real_access = os.access
        patch.setattr(tc.os, "access", lambda p, mode: False if str(p) == str(tmp_path / "shared")
                      else real_access(p, mode))
        assert np.array_equal(get_token_cache(shared, "train", tokenizer).src_ids, built.src_ids)


def test_a_full_disk_leaves_nothing_a_later_run_would_trust(corpus, tmp_path, tokenizer, monkeypatch):
    data = _config(corpus, tmp_path)
    real = tc._write_synced

    def disk_full(path, payload):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(tc, "_write_synced", disk_full)
    with pytest.raises(TokenCacheError, match="No space left on device.*nothing was kept"):
        get_token_cache(data, "train", tokenizer)
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []
    monkeypatch.setattr(tc, "_write_synced", real)
    assert len(get_token_cache(data, "train", tokenizer)) == 120


def test_stale_temporary_folder_is_replaced_and_truncation_detected(corpus, tmp_path, tokenizer):
    data = _config(corpus, tmp_path)
    spec = tc.cache_spec(open_split(data, "train"), tokenizer, data)
    folder = tc.cache_folder(tc.cache_root(data), "train", data, spec)
    stale = folder.with_name(f".{folder.name}.tmp")
    stale.mkdir(parents=True)
    (stale / "src_ids.bin").write_bytes(b"half")
    get_token_cache(data, "train", tokenizer)
    assert not stale.exists()
    with open(folder / "src_ids.bin", "r+b") as f:
        f.truncate(os.path.getsize(folder / "src_ids.bin") - 4)
    with pytest.raises(TokenCacheError, match="truncated"):
        get_token_cache(data, "train", tokenizer)


def test_misaligned_files_name_both_counts(corpus, tmp_path, tokenizer):
    with (corpus / "train.en").open("a") as f:
        f.write("extra\n")
    with pytest.raises(Exception, match=r"train\.de has 210 lines but .*train\.en has 211"):
        get_token_cache(_config(corpus, tmp_path), "train", tokenizer)


def test_huggingface_source_through_the_cache(tmp_path, tokenizer):
    pytest.importorskip("datasets")
    rows = [{"translation": {"de": s, "en": t}} for s, t in zip(SRC * 30, TGT * 30)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(hf_dataset="json", data_files={"train": str(path)}, vocab_size=120, max_len=20,
                      cache_dir=str(tmp_path / "cache"))
    pairs = get_token_cache(data, "train", tokenizer)
    assert len(pairs) == 120 and pairs.tgt(0).tolist() == tokenizer.encode_tgt([TGT[0]])[0]


def test_sample_is_seeded_aligned_and_complete_when_small(corpus, tmp_path):
    source = open_split(_config(corpus, tmp_path), "train")
    src, tgt = source.sample(50, seed=1)
    assert len(src) == 50 and all(SRC.index(s) == TGT.index(t) for s, t in zip(src, tgt) if s and t)
    assert source.sample(50, seed=1) == (src, tgt) and source.sample(50, seed=2) != (src, tgt)
    assert source.sample(10_000, seed=1) == (SRC * 30, TGT * 30)


def test_in_memory_pairs_match_the_lists():
    pairs = EncodedPairs.from_lists([[5, 6, EOS_ID], [7, EOS_ID]], [[8], [9, 10, 11]])
    assert len(pairs) == 2 and pairs.src(1).tolist() == [7, EOS_ID] and pairs.tgt(1).tolist() == [9, 10, 11]
    assert pairs.src_lengths.tolist() == [3, 2] and pairs.tgt_lengths.tolist() == [2, 4]


def test_pairs_with_characters_the_vocabulary_lacks_are_counted_and_reported(corpus, tmp_path, tokenizer, caplog):
    """Fine-tuning text the fixed vocabulary cannot spell: the cache counts the pairs and names the characters, the
    start of training warns with them, and data.unknown_characters=refuse stops instead."""
    from transformer.data import DataError
    from transformer.training.data import report_unknown_characters

    foreign = [("Ein Zug nach Łódź.", "A train to Łódź."), ("Ørsted baut.", "Ørsted builds."),
               ("Ein Škoda fährt nach Łódź.", "A Škoda drives.")]
    src = [s for s in SRC if s] * 10 + [s for s, _ in foreign] * 4
    tgt = [t for t in TGT if t][:len([s for s in SRC if s])] * 10 + [t for _, t in foreign] * 4
    (corpus / "train.de").write_text("".join(s + "\n" for s in src), encoding="utf-8")
    (corpus / "train.en").write_text("".join(t + "\n" for t in tgt), encoding="utf-8")
    data = _config(corpus, tmp_path)
    pairs = get_token_cache(data, "train", tokenizer)  # the vocabulary of the fixture: no Ł, ó, Ø, Š
    found = pairs.unknown_characters
    assert found["pairs"] == 12
    counts = dict(found["characters"])
    assert counts["Ł"] == 8 and counts["ó"] == 8 and counts["Ø"] == 4 and counts["Š"] == 4
    assert "a" not in counts and " " not in counts
    with caplog.at_level(logging.WARNING):
        report_unknown_characters(data, pairs)
    assert "12 of" in caplog.text and "'Ł' (8)" in caplog.text and "data.unknown_characters" in caplog.text
    with pytest.raises(DataError, match="unknown_characters=refuse"):
        report_unknown_characters(_config(corpus, tmp_path, unknown_characters="refuse"), pairs)
    again = get_token_cache(data, "train", tokenizer)  # found again: the count comes from meta.json
    assert again.unknown_characters == found
    clean = train_tokenizer(src, tgt, data)  # a fresh vocabulary over this text covers every character
    assert get_token_cache(data, "train", clean).unknown_characters["pairs"] == 0
