"""Subword sampling: lossless, reproducible across processes, fresh per epoch, BPE-dropout at alpha 0 equal to
sentencepiece; the background builder's samples and their clean-up."""

import dataclasses
import gzip
import multiprocessing
import os
import pickle
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from transformer.config import UNK_ID, ConfigError, DataConfig
from transformer.data import DataError, open_split, subword_sampling
from transformer.data.subword_sampling import (
    SAMPLES_FOLDER,
    SampledEpochs,
    SubwordSampler,
    _SentencePieceSide,
    build_sample,
    sample_folder,
    sample_spec,
)
from transformer.data.token_cache import EncodedPairs, cache_spec, get_token_cache, open_token_cache
from transformer.tokenizer import SPECIAL_PIECES, Tokenizer, train_tokenizer


def _lines(folder, split, lang):
    return gzip.open(folder / f"{split}.{lang}.gz", "rt", encoding="utf-8").read().splitlines()


@pytest.fixture(scope="module")
def corpus(multi30k_subset):
    return multi30k_subset, _lines(multi30k_subset, "train", "de"), _lines(multi30k_subset, "train", "en")


def _data(corpus, tmp_path, **changes):
    return DataConfig(**{"path": str(corpus[0]), "vocab_size": 1000, "max_len": 64, "subword_sampling": True,
                         "cache_dir": str(tmp_path / "cache"), **changes})


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory):
    return train_tokenizer(corpus[1][:2000], corpus[2][:2000], _data(corpus, tmp_path_factory.mktemp("bpe")))


@pytest.fixture(scope="module")
def unigram(corpus, tmp_path_factory):
    data = _data(corpus, tmp_path_factory.mktemp("uni"), spm_model_type="unigram")
    return train_tokenizer(corpus[1][:2000], corpus[2][:2000], data)


def _words(pieces):
    words, word = [], []
    for piece in [*pieces, "\u2581"]:
        if piece.startswith("\u2581") and word:
            words.append(word)
            word = []
        word.append(piece)
    return words


def test_bpe_merges_without_dropout_give_sentencepieces_segmentation(corpus, bpe):
    side = _SentencePieceSide(bpe.src)
    n_words = 0
    for pieces in bpe.src.encode(corpus[1] + corpus[2], out_type=str):
        for word in _words(pieces):
            assert side._merge("".join(word), 0.0, random.Random(0), []) == word
            n_words += 1
    assert n_words > 50_000


@pytest.mark.parametrize("model", ["bpe", "unigram"])
def test_samples_are_lossless_and_differ_from_the_deterministic_segmentation(corpus, model, request, tmp_path):
    tokenizer = request.getfixturevalue(model)
    sampler = SubwordSampler(tokenizer, _data(corpus, tmp_path, spm_model_type=model))
    texts = corpus[1][:500]
    sampled = sampler.src_ids(texts, random.Random(1))
    plain = tokenizer.src_ids(texts)
    assert [tokenizer.decode_tgt(ids) for ids in sampled] == [tokenizer.decode_tgt(ids) for ids in plain]
    differ = sum(a != b for a, b in zip(sampled, plain))
    assert differ > 100, differ
    assert sum(map(len, sampled)) > sum(map(len, plain))  # sampled segmentations use shorter pieces
    again = sampler.src_ids(texts, random.Random(1))
    assert again == sampled
    assert sampler.src_ids(texts, random.Random(2)) != sampled


def test_more_dropout_gives_more_pieces(corpus, bpe, tmp_path):
    texts = corpus[2][:500]
    counts = [sum(map(len, SubwordSampler(bpe, _data(corpus, tmp_path, subword_alpha=alpha)).tgt_ids(
        texts, random.Random(0)))) for alpha in (0.05, 0.1, 0.3)]
    assert counts[0] < counts[1] < counts[2]


def test_unigram_samples_come_from_the_n_best_and_a_large_alpha_picks_the_best(corpus, unigram, tmp_path):
    texts = corpus[2][:200]
    best = unigram.tgt.encode(texts, out_type=str)
    side = _SentencePieceSide(unigram.tgt)
    rng = random.Random(0)
    for text in texts[:50]:
        nbests = unigram.tgt.nbest_encode(text, nbest_size=4, out_type="proto").nbests
        nbest = [[p.piece for p in n.pieces] for n in nbests]
        assert side.nbest_sample(text, 4, 0.5, rng) in nbest
    greedy = [side.nbest_sample(text, 16, 1000.0, rng) for text in texts]
    assert greedy == best


def _build_in_subprocess(args):
    data, tokenizer_state, folder, spec = args
    build_sample(open_split(data, "train"), Tokenizer.from_dict(tokenizer_state), data, 7, 3, folder, spec)


def test_a_sample_depends_only_on_seed_and_epoch_not_on_the_process(corpus, bpe, tmp_path, monkeypatch):
    data = _data(corpus, tmp_path)
    spec = sample_spec(cache_spec(open_split(data, "train"), bpe, data), data, 7, 3)
    context = multiprocessing.get_context("spawn")
    folders = [tmp_path / f"sample_{i}" for i in range(2)]
    with context.Pool(2) as pool:  # two fresh processes
        pool.map(_build_in_subprocess, [(data, bpe.to_dict(), folder, spec) for folder in folders])
    build_sample(open_split(data, "train"), bpe, data, 7, 3, tmp_path / "here", spec)
    a, b, c = (open_token_cache(folder, spec) for folder in [*folders, tmp_path / "here"])
    for x in (b, c):
        assert np.array_equal(a.src_ids, x.src_ids) and np.array_equal(a.tgt_ids, x.tgt_ids)
        assert np.array_equal(a.src_offsets, x.src_offsets)
    # Chunks spread over 2 processes give the same sample as one process encoding them all.
    monkeypatch.setattr(subword_sampling, "CHUNK_PAIRS", 500)
    small = sample_spec(cache_spec(open_split(data, "train"), bpe, data), data, 7, 3)
    build_sample(open_split(data, "train"), bpe, data, 7, 3, tmp_path / "one", small)
    two_workers = dataclasses.replace(data, subword_workers=2)
    build_sample(open_split(data, "train"), bpe, two_workers, 7, 3, tmp_path / "two", small)
    one, two = (open_token_cache(tmp_path / name, small) for name in ("one", "two"))
    assert np.array_equal(one.src_ids, two.src_ids) and np.array_equal(one.tgt_ids, two.tgt_ids)
    monkeypatch.undo()
    other_epoch = sample_spec(cache_spec(open_split(data, "train"), bpe, data), data, 7, 4)
    build_sample(open_split(data, "train"), bpe, data, 7, 4, tmp_path / "epoch4", other_epoch)
    d = open_token_cache(tmp_path / "epoch4", other_epoch)
    assert len(d) > 3000 and not np.array_equal(a.tgt_ids[:1000], d.tgt_ids[:1000])


def test_sampled_epochs_build_ahead_and_remove_what_is_done(corpus, bpe, tmp_path):
    data = _data(corpus, tmp_path)
    cache = get_token_cache(data, "train", bpe)
    run_dir = tmp_path / "run"
    epochs = SampledEpochs(cache, data, bpe, 7, run_dir)
    try:
        assert epochs.epoch(0) is cache  # epoch 0: the token cache
        epochs.prefetch(1)  # epoch 1 starts building in the background
        one = epochs.epoch(1)
        assert len(one) > 3000 and not np.array_equal(one.tgt_lengths, cache.tgt_lengths)
        two = epochs.epoch(2)  # not asked for ahead: built now
        assert not sample_folder(run_dir, 1).exists() and (sample_folder(run_dir, 2) / "meta.json").exists()
        assert not np.array_equal(one.tgt_ids[:1000], two.tgt_ids[:1000])
        assert not sample_folder(run_dir, 3).exists()  # nothing is built without being asked for
        epochs.prefetch(3)
        deadline = time.time() + 300
        while not (sample_folder(run_dir, 3) / "meta.json").exists() and time.time() < deadline:
            time.sleep(0.2)  # epoch 3 is built ahead, in the background
        assert (sample_folder(run_dir, 3) / "meta.json").exists()
        process = epochs._workers[3]
        while process.returncode is None and time.time() < deadline:
            time.sleep(0.05)  # nobody waits for it until epoch 3 starts: its watcher thread reaps it (no zombie)
        assert process.returncode == 0
        with pytest.raises(ChildProcessError):
            os.waitpid(process.pid, os.WNOHANG)  # already reaped
    finally:
        epochs.close()
    # A process that does not build (another rank on this machine) reads what the builder wrote.
    reader = SampledEpochs(cache, data, bpe, 7, run_dir, build=False)
    assert np.array_equal(reader.epoch(2).tgt_ids, two.tgt_ids)
    assert sorted(p.name for p in (run_dir / SAMPLES_FOLDER).iterdir() if not p.name.startswith(".")) == [
        "epoch_2", "epoch_3"]


_SCRIPT_WITHOUT_MAIN_GUARD = """
import pickle, sys
from pathlib import Path
from transformer.data.subword_sampling import SampledEpochs
from transformer.data.token_cache import get_token_cache
from transformer.tokenizer import Tokenizer

data, state = pickle.loads(Path(sys.argv[1]).read_bytes())
tokenizer = Tokenizer.from_dict(state)
epochs = SampledEpochs(get_token_cache(data, "train", tokenizer), data, tokenizer, 7, Path(sys.argv[2]))
try:
    print(len(epochs.epoch(0)), len(epochs.epoch(1)))
finally:
    epochs.close()
"""


def test_the_background_process_imports_neither_torch_nor_the_main_module(corpus, bpe, tmp_path):
    # A script without `if __name__ == "__main__":` (multiprocessing's spawn would run it again in the child), and a
    # `torch` on the path that fails to import: the data path, the builder included, works without torch.
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    (tmp_path / "script.py").write_text(_SCRIPT_WITHOUT_MAIN_GUARD)
    (tmp_path / "job.pkl").write_bytes(pickle.dumps((_data(corpus, tmp_path), bpe.to_dict())))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(poison.parent), *sys.path])}
    result = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(tmp_path / "job.pkl"),
                             str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    n_cache, n_sample = map(int, result.stdout.split())
    assert n_cache > 3000 and n_sample > 3000
    assert "torch was imported" not in result.stderr


def test_a_failing_background_build_is_an_error_naming_the_setting(corpus, bpe, tmp_path):
    data = _data(corpus, tmp_path)
    cache = get_token_cache(data, "train", bpe)
    (tmp_path / "empty").mkdir()
    missing = dataclasses.replace(data, path=str(tmp_path / "empty"))  # the training files are gone
    epochs = SampledEpochs(cache, missing, bpe, 7, tmp_path / "run")
    try:
        with pytest.raises(DataError, match="data.subword_sampling"):
            epochs.epoch(1)
    finally:
        epochs.close()
    in_memory = EncodedPairs.from_lists([[5, 6, 3]], [[7, 8]])  # no spec: nothing to build samples from
    with pytest.raises(ValueError, match="token cache"):
        SampledEpochs(in_memory, data, bpe, 7, tmp_path / "run")


@pytest.mark.parametrize("changes, key", [({"subword_alpha": 0.0}, "data.subword_alpha"),
                                          ({"subword_alpha": 1.5}, "data.subword_alpha"),
                                          ({"subword_nbest_size": 1, "spm_model_type": "unigram"},
                                           "data.subword_nbest_size")])
def test_bad_sampling_settings_name_the_key(changes, key):
    with pytest.raises(ConfigError, match=key):
        DataConfig(path="x", subword_sampling=True, **changes)


def test_train_cli_with_subword_sampling_logs_the_samples(tmp_path, multi30k_subset):
    from tests.conftest import write_small_config

    config = write_small_config(tmp_path, multi30k_subset, training={"max_steps": 40, "eval_every_steps": 40},
                                data={"subword_sampling": True, "max_tokens_per_batch": 8192})
    result = subprocess.run([sys.executable, "-m", "transformer", "train", "--config", str(config), "--run-dir",
                             str(tmp_path / "run")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "subword sampling (data.subword_sampling): BPE-dropout, alpha 0.1" in result.stderr
    assert "epoch 1: subword sample of" in result.stderr
    assert "the first log line comes at update 25 (training.log_every_steps=25)" in result.stderr  # redirected
    assert not list((tmp_path / "run" / SAMPLES_FOLDER).glob(".*.tmp"))


def test_piece_ids_map_pieces_as_encoding_does_with_and_without_an_own_vocabulary(corpus, bpe):
    texts = corpus[1][:200]
    pieces = bpe.src.encode(texts, out_type=str)
    assert [bpe.piece_ids(p, "src") for p in pieces] == bpe.src_ids(texts)
    assert bpe.piece_ids(["no-such-piece"]) == [UNK_ID]
    # An imported vocabulary orders the pieces its own way (here: reversed after the special pieces).
    own = list(SPECIAL_PIECES) + [bpe.src.id_to_piece(i) for i in range(bpe.src.get_piece_size() - 1, 3, -1)]
    imported = Tokenizer(bpe.src_proto, vocab=own)
    assert [imported.piece_ids(p, "src") for p in pieces] == imported.src_ids(texts)
    assert imported.piece_ids(pieces[0]) == [own.index(p) for p in pieces[0]] != bpe.piece_ids(pieces[0])
    assert imported.piece_ids(["no-such-piece"]) == [UNK_ID]
