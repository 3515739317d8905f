"""The Translator on a briefly trained Multi30k model: line discipline, batching invariance, hard inputs."""

import dataclasses
import gzip
import logging
import threading
import time
import unicodedata

import pytest
import torch

from tests.conftest import longest_run
from transformer import Translator
from transformer.config import ConfigError
from transformer.engines import pytorch as pytorch_engine

SPECIAL = ("<s>", "</s>", "<pad>", "<unk>", "⁇", "▁")


@pytest.fixture(scope="module")
def translator(trained_run):
    return Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt", device="cpu")


@pytest.fixture(scope="module")
def test_lines(multi30k_subset):
    return gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt").read().split("\n")[:30]


def test_same_outputs_and_scores_at_every_batch_size(translator, test_lines):
    runs = [translator.translate_n_best(test_lines, beam_size=5, n_best=1, batch_size=b) for b in (1, 7, 30)]
    translator.config = dataclasses.replace(
        translator.config, decoding=dataclasses.replace(translator.config.decoding, max_tokens_per_batch=120))
    runs.append(translator.translate_n_best(test_lines, beam_size=5, n_best=1, batch_size=30))
    reference = runs[0]
    assert len(reference) == 30
    for other in runs[1:]:
        assert [h[0][0] for h in other] == [h[0][0] for h in reference]
        assert [h[0][1] for h in other] == pytest.approx([h[0][1] for h in reference], abs=1e-5)


def test_short_and_long_sentence_in_one_batch(translator):
    long = " ".join(["Ein Mann mit einem roten Hut geht mit seinem Hund"] * 6)  # 60 words
    for beam_size in (1, 4):
        together = translator.translate(["1.", long], beam_size=beam_size, max_len_a=2.0)
        assert together[0] == translator.translate(["1."], beam_size=beam_size, max_len_a=2.0)[0]
        assert together[1] == translator.translate([long], beam_size=beam_size, max_len_a=2.0)[0]
        assert together[0].strip()


def test_length_cap_with_n_best_falls_back_to_unfinished(translator, caplog):
    sentence = " ".join(["Eine Frau in einem blauen Kleid sitzt auf einer Bank"] * 3)[:200]  # ~25 words
    with caplog.at_level(logging.WARNING):
        hyps = translator.translate_n_best([sentence], beam_size=5, n_best=5, max_len_a=0.0, max_len_b=4)[0]
    assert len(hyps) == 5 and all(text.strip() for text, _ in hyps)
    assert "length cap" in caplog.text


def test_n_best_sorted_and_first_is_the_one_best(translator, test_lines):
    n_best = translator.translate_n_best(test_lines[:5], beam_size=5, n_best=5)
    one_best = translator.translate(test_lines[:5], beam_size=5)
    for hyps, best in zip(n_best, one_best):
        scores = [score for _, score in hyps]
        distinct = len({text for text, _ in hyps})  # distinct texts first, then any repeats, each part best first
        assert len(hyps) == 5 and scores[:distinct] == sorted(scores[:distinct], reverse=True)
        assert scores[distinct:] == sorted(scores[distinct:], reverse=True)
        assert hyps[0][0] == best


def test_distinct_first_prefers_new_texts_and_keeps_n_entries():
    from transformer.decoding.options import distinct_first

    texts = ["a", "a", "b", "a", "c"]
    assert distinct_first(texts, 3) == [0, 2, 4]
    assert distinct_first(texts, 4) == [0, 2, 4, 1]
    assert distinct_first(texts[:2], 2) == [0, 1]  # too few distinct texts: the repeat fills the list
    # Hypotheses cut at the length cap come after every finished one, repeats included, new texts first.
    assert distinct_first(["a", "a", "x", "y", "x"], 4, [True, True, False, False, False]) == [0, 1, 2, 3]
    assert distinct_first(["a", "b", "a", "c"], 3, [True, False, True, False]) == [0, 2, 1]


def test_n_best_texts_are_distinct_where_the_beam_found_them(translator, test_lines, monkeypatch):
    """Two piece sequences can spell one text. Here a decoder that keeps only each hypothesis' first word makes
    repeats common: the n-best list takes new texts from all of the beam's hypotheses before any repeat."""
    decode = translator.tokenizer.decode_tgt
    monkeypatch.setattr(translator.tokenizer, "decode_tgt", lambda ids: (decode(ids).split() or [""])[0])
    from transformer.decoding.options import distinct_first

    lines = test_lines[:8]
    everything = translator.translate_n_best(lines, beam_size=5, n_best=5)  # the whole beam
    three = translator.translate_n_best(lines, beam_size=5, n_best=3)
    found_repeats = False
    for all_hyps, hyps in zip(everything, three):
        texts = [text for text, _ in all_hyps]
        found_repeats |= len(set(texts)) < 5
        assert len(hyps) == 3 and len({t for t, _ in hyps}) == min(3, len(set(texts)))
        raw = sorted(all_hyps, key=lambda h: -h[1])  # the beam's order, by score (all finished here)
        assert hyps == [raw[i] for i in distinct_first([t for t, _ in raw], 3)]
    assert found_repeats  # the decoder above did make the beam repeat texts


def test_one_word_inputs_are_capped(translator, caplog):
    with caplog.at_level(logging.WARNING):
        out = translator.translate_n_best(["nie", "Hallo"], beam_size=4, max_len_a=1.0, max_len_b=3)
    src_lens = [len(ids) for ids in translator.tokenizer.encode_src(["nie", "Hallo"])]
    hyps = translator.decode_ids(translator.tokenizer.encode_src(["nie", "Hallo"]),
                                 translator.decoding_options(beam_size=4, max_len_a=1.0, max_len_b=3))
    for h, n in zip(hyps, src_lens):
        assert len(h[0].tokens) + h[0].finished <= n + 3
    assert len(out) == 2


def test_greedy_output_has_nothing_after_eos_and_no_special_pieces(translator):
    long = " ".join(["Zwei Kinder spielen im Sand am Strand neben dem Meer"] * 4)  # 40 words
    outputs = translator.translate(["Ja.", long], beam_size=1, max_len_a=0.0, max_len_b=200)
    hyps = translator.decode_ids(translator.tokenizer.encode_src(["Ja.", long]),
                                 translator.decoding_options(beam_size=1, max_len_a=0.0, max_len_b=200))
    for text, (h,) in zip(outputs, hyps):
        assert 3 not in h.tokens  # eos ends a hypothesis and is not part of it
        assert not any(piece in text for piece in SPECIAL)


def test_line_discipline_with_empty_and_huge_inputs(translator, caplog):
    huge = " ".join(["Hund"] * 2000)
    lines = ["Ein Hund.", "", "   ", huge, "Eine Katze schläft.", "\t"]
    with caplog.at_level(logging.WARNING):
        result = translator.run(translator.request(lines, translator.resolve_options(beam_size=2)),
                                warn_truncated=True)
        out = result.texts
    assert len(out) == len(lines)
    assert out[1] == out[2] == out[5] == ""
    assert out[0] and out[3] and out[4]
    assert result.truncated == [3] and "truncated" in caplog.text


def test_unicode_inputs(translator):
    word = "Zoë café"
    nfc, nfd = unicodedata.normalize("NFC", word), unicodedata.normalize("NFD", word)
    assert nfc != nfd
    lines = ["a︰b", nfc, nfd, "Ｅｉｎ Ｈｕｎｄ", "Ein Hund 🐕 läuft."]
    out = translator.translate(lines, beam_size=1)
    assert len(out) == len(lines)
    # NFC and NFD spellings translate identically (a word copied through untranslated keeps its spelling)
    assert unicodedata.normalize("NFC", out[1]) == unicodedata.normalize("NFC", out[2])
    assert not any("⁇" in o or "<unk>" in o for o in out)


def test_workers_give_the_same_outputs_and_restore_the_thread_count(trained_run, test_lines):
    path = trained_run / "checkpoints" / "best.pt"
    one, two = Translator.from_checkpoint(path), Translator.from_checkpoint(path, workers=2)
    threads = torch.get_num_threads()
    for beam_size in (1, 4):  # batches of 4: several batches, so that both workers decode
        reference = one.translate_n_best(test_lines, beam_size=beam_size, n_best=1, batch_size=4)
        parallel = two.translate_n_best(test_lines, beam_size=beam_size, n_best=1, batch_size=4)
        assert [h[0][0] for h in parallel] == [h[0][0] for h in reference]
        assert [h[0][1] for h in parallel] == pytest.approx([h[0][1] for h in reference], abs=1e-5)
    assert torch.get_num_threads() == threads


def test_concurrent_worker_calls_take_turns_with_the_thread_count(trained_run, test_lines, monkeypatch):
    # Two threads decode with workers=2, the second starting while the first holds the lowered count. Without
    # coordination the second would save the lowered count as "the" count, decode on 1 thread instead of 2, and
    # restore the lowered count last, leaving the process on it.
    path = trained_run / "checkpoints" / "best.pt"
    translators = [Translator.from_checkpoint(path, workers=2) for _ in range(2)]
    seen = []  # torch's thread count inside every batch decoded

    def slow_search(*args):  # the engine's search of one batch
        seen.append(torch.get_num_threads())
        time.sleep(0.05)
        return original(*args)

    original = pytorch_engine.search
    monkeypatch.setattr(pytorch_engine, "search", slow_search)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        outputs = [None, None]

        def run(i):
            outputs[i] = translators[i].translate(test_lines[:8], beam_size=1, batch_size=4)

        first = threading.Thread(target=run, args=(0,))
        second = threading.Thread(target=run, args=(1,))
        first.start()
        time.sleep(0.02)  # the first call has lowered the count and is decoding
        second.start()
        first.join()
        second.join()
        assert torch.get_num_threads() == 4
        assert seen == [2] * 4  # 2 calls x 2 batches, each on 4 // 2 threads
        assert outputs[0] == outputs[1]
    finally:
        torch.set_num_threads(threads)


def test_more_workers_than_threads_warn_once(trained_run, test_lines, caplog):
    path = trained_run / "checkpoints" / "best.pt"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fitting = Translator.from_checkpoint(path, workers=2)
        oversubscribed = Translator.from_checkpoint(path, workers=3)
        with caplog.at_level(logging.WARNING, logger="transformer.engines.pytorch"):
            fitting.translate(test_lines[:8], beam_size=1, batch_size=2)
            assert not caplog.records
            for _ in range(2):
                oversubscribed.translate(test_lines[:8], beam_size=1, batch_size=2)
        assert [r.getMessage() for r in caplog.records] == [
            "--workers 3 with 2 CPU threads: each worker gets one thread, so 3 threads share 2; --workers 2 or fewer "
            "decodes without oversubscription"]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("workers", [0, -1])
def test_bad_worker_counts_are_refused(trained_run, workers):
    with pytest.raises(ConfigError, match=f"workers={workers}: must be at least 1"):
        Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt", workers=workers)


def test_no_output_loops_on_one_piece_in_float32_or_int8(looping_checkpoint, multi30k_subset):
    """A model that would repeat one piece to the length cap (on words it barely knows, or after int8's rounding)
    stops at decoding.max_repeat (3) in every search, float32 and int8."""
    lines = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt").read().split("\n")[:40]
    for quantization in (None, "int8"):
        translator = Translator.from_checkpoint(looping_checkpoint, quantization=quantization)
        src_ids = translator.tokenizer.encode_src(lines)
        free = translator.decode_ids(src_ids, translator.decoding_options(beam_size=1, max_repeat=0))
        assert all(longest_run(hyps[0].tokens) >= 5 for hyps in free), quantization  # the test can fail
        for beam_size in (1, 4):
            limited = translator.decode_ids(src_ids, translator.decoding_options(beam_size=beam_size))
            assert max(longest_run(hyps[0].tokens) for hyps in limited) <= 3, (quantization, beam_size)


def test_the_request_module_example_runs_as_written(trained_run):
    """transformer/request.py's docstring example, executed line by line on a de->en model."""
    import transformer.request as request_module

    translator = Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt")
    lines = [line.strip().split("  #")[0] for line in request_module.__doc__.split("\n\n")[1].splitlines()]
    scope = {**vars(request_module), "config": translator.config, "tokenizer": translator.engine.tokenizer,
             "translator": translator}
    for line in lines:
        exec(line, scope)
    assert scope["translation"].texts == translator.translate(["Ein Hund rennt."], beam_size=4)
