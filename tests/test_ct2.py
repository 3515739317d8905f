"""Export to CTranslate2 and decoding with it: the same translations as our decoder, from the same CLI."""

import gzip
import json
import logging
import math

import pytest
import sacrebleu

from tests.conftest import longest_run
from transformer.cli import main

ct2 = pytest.importorskip("ctranslate2")  # installed by `make install` (the [ct2] extra); CI runs these


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("ct2") / "model"
    assert main(["export", "--checkpoint", str(trained_run / "checkpoints" / "best.pt"), "--format", "ctranslate2",
                 "--output", str(out)]) == 0
    return out


def test_export_writes_a_complete_model_folder(exported, trained_run, capsys):
    for name in ("model.bin", "config.json", "spm.model", "transformer_nmt.json"):
        assert (exported / name).is_file(), name
    assert json.loads((exported / "config.json").read_text())["add_source_eos"] is True
    assert main(["export", "--checkpoint", str(trained_run / "checkpoints" / "best.pt"), "--output",
                 str(exported)]) == 2  # not overwritten without --force
    assert "exists; use --force" in capsys.readouterr().err


def test_force_replaces_only_an_earlier_export(exported, trained_run, tmp_path, capsys, monkeypatch):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    run_like = tmp_path / "run"  # e.g. a run folder given as --output by mistake
    (run_like / "checkpoints").mkdir(parents=True)
    (run_like / "notes.txt").write_text("keep me")
    assert main(["export", "--checkpoint", ckpt, "--output", str(run_like), "--force"]) == 2
    assert "is not an earlier export" in capsys.readouterr().err and (run_like / "notes.txt").read_text() == "keep me"
    a_file = tmp_path / "model.bin"
    a_file.write_text("x")
    assert main(["export", "--checkpoint", ckpt, "--output", str(a_file), "--force"]) == 2
    assert "is not a folder" in capsys.readouterr().err and a_file.read_text() == "x"
    # An earlier export is replaced; a conversion that fails leaves it as it was and no temporary folder behind.
    again = tmp_path / "again"
    assert main(["export", "--checkpoint", ckpt, "--output", str(again)]) == 0
    before = {p.name: p.read_bytes() for p in again.iterdir()}
    from transformer.tokenizer import Tokenizer

    def broken_save(*args):  # after the model is converted into the temporary folder
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(Tokenizer, "save", broken_save)
    with pytest.raises(RuntimeError, match="conversion failed"):
        main(["export", "--checkpoint", ckpt, "--output", str(again), "--force"])
    assert {p.name: p.read_bytes() for p in again.iterdir()} == before
    monkeypatch.undo()
    assert main(["export", "--checkpoint", ckpt, "--output", str(again), "--force", "--quantization", "int8"]) == 0
    assert json.loads((again / "transformer_nmt.json").read_text())["quantization"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "model.bin", "run"]  # no temporary folders left


def test_ctranslate2_decodes_like_our_decoder(exported, trained_run, multi30k_subset):
    from transformer.engines import CTranslate2Engine
    from transformer.translate import Translator

    src = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().split("\n")[:100]
    ref = gzip.open(multi30k_subset / "test_2016_flickr.en.gz", "rt", encoding="utf-8").read().split("\n")[:100]
    ours = Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt")
    theirs = Translator(CTranslate2Engine(exported, threads=1))
    for beam_size, max_bleu_gap in ((1, 0.1), (4, 0.2)):
        a, b = ours.translate(src, beam_size=beam_size), theirs.translate(src, beam_size=beam_size)
        bleu_a, bleu_b = (sacrebleu.corpus_bleu(h, [ref]).score for h in (a, b))
        assert abs(bleu_a - bleu_b) <= max_bleu_gap, (beam_size, bleu_a, bleu_b)
        if beam_size == 1:
            assert sum(x == y for x, y in zip(a, b)) >= 0.99 * len(src)
    # n-best scores on our scale (log-probabilities summed, eos included, over the GNMT penalty in beam search):
    # equal for the hypotheses both engines found (at α 2.0 this weak model's beam outputs differ between the two
    # engines' length normalisations, docs/decoding.md)
    for beam_size, alpha in ((1, 0.0), (4, 0.6), (4, 1.0)):
        a = ours.translate_n_best(src[:30], n_best=1, beam_size=beam_size, length_penalty=alpha)
        b = theirs.translate_n_best(src[:30], n_best=1, beam_size=beam_size, length_penalty=alpha)
        same = [(x[0][1], y[0][1]) for x, y in zip(a, b) if x[0][0] == y[0][0]]
        assert len(same) >= 25 and all(abs(x - y) < 1e-4 for x, y in same), (beam_size, alpha, same)


def test_outputs_cut_at_the_length_cap_are_scored_and_ranked_as_ours(exported, trained_run, multi30k_subset,
                                                                     caplog):
    """With a cap of 4 pieces nearly every output is cut: its score has no eos (CTranslate2's rescoring adds one),
    the n-best lists are ordered as ours, and the cut outputs are counted in a warning."""
    from transformer.engines import CTranslate2Engine
    from transformer.translate import Translator

    src = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().split("\n")[:20]
    ours = Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt")
    theirs = Translator(CTranslate2Engine(exported, threads=1))
    fixed, mixed = dict(max_len_a=0.0, max_len_b=4), dict(max_len_a=0.3, max_len_b=2)  # mixed: a cap per sentence
    for cap, beam_size, n_best, alpha in ((fixed, 1, 1, 0.0), (fixed, 4, 4, 0.0), (fixed, 4, 3, 1.0),
                                          (mixed, 1, 1, 0.0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            a = ours.translate_n_best(src, n_best=n_best, beam_size=beam_size, length_penalty=alpha, **cap)
            b = theirs.translate_n_best(src, n_best=n_best, beam_size=beam_size, length_penalty=alpha, **cap)
        warnings = [r.getMessage() for r in caplog.records if "reached the length cap" in r.getMessage()]
        assert len(warnings) == 2 and warnings[0].split(" of ")[0] == warnings[1].split(" of ")[0], warnings
        assert int(warnings[1].split(" of ")[0]) >= 12  # most cut
        ours_scores = {(i, text): score for i, hyps in enumerate(a) for text, score in hyps}
        same = [(ours_scores[i, text], score) for i, hyps in enumerate(b) for text, score in hyps
                if (i, text) in ours_scores]
        assert len(same) >= 0.8 * len(src) * n_best and all(abs(x - y) < 1e-4 for x, y in same), (beam_size, same)
        if alpha == 0.0:  # the same search in both engines: the same lists in the same order (finished first,
            # then distinct texts first, each group best first by our score)
            assert sum([t for t, _ in x] == [t for t, _ in y] for x, y in zip(a, b)) >= 0.9 * len(src)


def test_a_beam_is_ranked_as_ours_its_1_best_first_in_every_n_best_list(exported, trained_run, multi30k_subset):
    """CTranslate2 searches by its own length penalty (|Y|^α); its final beam is ranked by ours: the 1-best output
    (n_best 1, or plain translation) is the first of the n-best list, the lists are best first by our score, a
    hypothesis scores what the .pt checkpoint scores it, and with beam 4 at α 1 and 2 the 1-best is ours on nearly
    every line (CTranslate2's own ranking differs on about 1 line in 10 at α 1, 1 in 6 at α 2). With prefixes
    (CTranslate2's scores leave out the prefix) and n-gram blocking (its log-probabilities are renormalised) alike."""
    from transformer.engines import CTranslate2Engine
    from transformer.translate import Translator

    src = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().split("\n")[:60]
    ours = Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt")
    theirs = Translator(CTranslate2Engine(exported, threads=1))
    for options in (dict(beam_size=4, length_penalty=1.0), dict(beam_size=4, length_penalty=2.0),
                    dict(beam_size=5, length_penalty=2.0, prefixes=["A"] * 30 + [None] * 30),
                    dict(beam_size=4, length_penalty=1.0, no_repeat_ngram_size=2)):
        best = theirs.translate(src, **options)
        assert [hyps[0][0] for hyps in theirs.translate_n_best(src, n_best=1, **options)] == best, options
        lists = theirs.translate_n_best(src, n_best=options["beam_size"], **options)
        assert [hyps[0][0] for hyps in lists] == best, options
        prefixes = options.get("prefixes") or [None] * len(src)
        beams = theirs.decode_ids(theirs.tokenizer.encode_src(src), theirs.decoding_options(
            n_best=options["beam_size"], **{k: v for k, v in options.items() if k != "prefixes"}),
            prefix_ids=[theirs.tokenizer.encode_tgt([p])[0] if p else None for p in prefixes])
        for beam in beams:  # the engine's ranking: finished first, each group best first by our score
            assert [h.finished for h in beam] == sorted((h.finished for h in beam), reverse=True)
            for group in (True, False):  # ranked from CTranslate2's scores, within their 1e-3 of the model's
                scores = [h.score for h in beam if h.finished == group]
                assert all(a >= b - 2e-3 for a, b in zip(scores, scores[1:])), (options, beam)
        scored = {(i, text): score for i, hyps in enumerate(ours.translate_n_best(src, n_best=options["beam_size"],
                                                                                  **options)) for text, score in hyps}
        same = [(scored[i, text], score) for i, hyps in enumerate(lists) for text, score in hyps if (i, text) in scored]
        assert len(same) >= len(src) and all(abs(x - y) < 1e-4 for x, y in same), options
        if len(options) == 2:  # beam 4 as it is (n-gram blocking renormalised keeps other hypotheses, docs/decoding.md)
            assert sum(x == y for x, y in zip(best, ours.translate(src, **options))) >= 0.95 * len(src), options


def test_samples_of_top_k_1_are_the_greedy_output_n_times(exported, trained_run, multi30k_subset):
    from transformer.translate import Translator

    src = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().split("\n")[:5]
    theirs = Translator.from_checkpoint(exported)
    greedy = theirs.translate(src, beam_size=1)
    samples = theirs.translate_n_best(src, n_best=3, sampling=True, top_k=1)
    assert [[text for text, _ in hyps] for hyps in samples] == [[g] * 3 for g in greedy]


def test_temperatures_beyond_float32_are_greedy_or_uniform_draws_as_in_our_engine(exported, multi30k_subset):
    """CTranslate2 samples in float32: a temperature it would make 0 (1e-50) draws the most probable token, one it
    would make inf (1e39, 1e308) draws uniformly, as 1e37 does (our engine divides in float64: the same rule)."""
    from transformer.translate import Translator

    src = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().split("\n")[:5]
    theirs = Translator.from_checkpoint(exported)
    greedy = theirs.translate(src, beam_size=1)
    cold = theirs.translate_n_best(src, n_best=2, sampling=True, temperature=1e-50)
    assert [[text for text, _ in hyps] for hyps in cold] == [[g] * 2 for g in greedy]
    uniform = theirs.translate(src, sampling=True, temperature=1e37, seed=3, max_repeat=0)
    for temperature in (1e39, 1e308):
        assert theirs.translate(src, sampling=True, temperature=temperature, seed=3, max_repeat=0) == uniform


def test_ctranslate2_stops_loops_at_max_repeat_as_our_searches(looping_checkpoint, multi30k_subset, tmp_path):
    """A run of one piece stops at decoding.max_repeat in our searches and in CTranslate2 (suppressed sequences),
    on a model that repeats one piece to the length cap without the limit."""
    from transformer.engines import CTranslate2Engine
    from transformer.translate import Translator

    assert main(["export", "--checkpoint", str(looping_checkpoint), "--format", "ctranslate2",
                 "--output", str(tmp_path / "ct2")]) == 0
    src = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().split("\n")[:40]
    ours, theirs = Translator.from_checkpoint(looping_checkpoint), Translator(CTranslate2Engine(tmp_path / "ct2"))
    src_ids = ours.tokenizer.encode_src(src)
    free = ours.decode_ids(src_ids, ours.decoding_options(beam_size=1, max_repeat=0))
    assert all(longest_run(hyps[0].tokens) > 3 for hyps in free)
    for beam_size in (1, 4):
        limited = ours.decode_ids(src_ids, ours.decoding_options(beam_size=beam_size))  # the default, 3
        assert max(longest_run(hyps[0].tokens) for hyps in limited) <= 3
        theirs_limited = theirs.translate(src, beam_size=beam_size)
        assert max(longest_run(ours.tokenizer.encode_tgt([t])[0]) for t in theirs_limited) <= 3
    assert theirs.translate(src, beam_size=1) == ours.translate(src, beam_size=1)
    assert theirs.translate(src, beam_size=1, max_repeat=0) == ours.translate(src, beam_size=1, max_repeat=0)


def test_the_beam_length_normalisation_difference_is_told_once(exported, caplog):
    from transformer.engines import CTranslate2Engine
    from transformer.translate import Translator

    theirs = Translator(CTranslate2Engine(exported))
    with caplog.at_level(logging.WARNING, logger="transformer.engines.ctranslate2"):
        theirs.translate(["Ein Hund läuft."], beam_size=1)
        theirs.translate(["Ein Hund läuft."], beam_size=4, length_penalty=0.0)
        assert "beam search ranks by" not in caplog.text  # greedy, or no length penalty: the same search
        theirs.translate(["Ein Hund läuft."], beam_size=4, length_penalty=1.0)
        theirs.translate(["Ein Hund läuft."], beam_size=4, length_penalty=1.0)
    assert caplog.text.count("beam search ranks by log-probability / |Y|^1") == 1


def test_without_scores_both_engines_give_nan(exported, trained_run, multi30k_subset):
    """`scores=False` means the same on every engine: NaN scores, from greedy decoding, beam search and sampling
    alike; the outputs are those asked for (greedy: the same texts as with scores)."""
    from transformer.engines import CTranslate2Engine, PyTorchEngine
    from transformer.translate import Translator

    src = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().split("\n")[:6]
    ours = Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt")
    theirs = Translator.from_checkpoint(exported)
    assert isinstance(ours.engine, PyTorchEngine) and isinstance(theirs.engine, CTranslate2Engine)
    for translator in (ours, theirs):
        for options in (dict(beam_size=1), dict(beam_size=4, n_best=2), dict(sampling=True, n_best=2, seed=3)):
            without = translator.translate_n_best(src, scores=False, **options)
            assert [len(hyps) for hyps in without] == [options.get("n_best", 1)] * len(src)
            assert all(math.isnan(score) for hyps in without for _, score in hyps), (translator.engine.name, options)
            assert all(text for hyps in without for text, _ in hyps)
            with_scores = translator.translate_n_best(src, scores=True, **options)
            assert all(math.isfinite(score) and score <= 0 for hyps in with_scores for _, score in hyps)
            if options.get("beam_size") == 1:
                assert [[t for t, _ in hyps] for hyps in without] == [[t for t, _ in hyps] for hyps in with_scores]


def test_translate_and_evaluate_accept_the_exported_folder(exported, trained_run, capsys):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    sentences = ["Ein Mann fährt Fahrrad.", "", "Zwei Hunde spielen im Schnee."]
    outputs = []
    for model in (ckpt, str(exported)):
        assert main(["translate", "--checkpoint", model, "--beam-size", "1", *sentences]) == 0
        outputs.append(capsys.readouterr().out)
        # greedy with --n-best asks for scores (plain greedy translation does not compute them)
        assert main(["translate", "--checkpoint", model, "--beam-size", "1", "--n-best", "1", sentences[0]]) == 0
        index, score, text, end = capsys.readouterr().out.rstrip("\n").split("\t")
        assert index == "0" and math.isfinite(float(score)) and float(score) <= 0 and text and end in ("eos", "cut")
    assert outputs[0] == outputs[1] and outputs[0].split("\n")[1] == ""
    assert main(["translate", "--checkpoint", str(exported), "--beam-size", "4", "--n-best", "2",
                 "Ein Hund läuft."]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == ["0", "0"] and float(rows[0][1]) >= float(rows[1][1])
    assert main(["evaluate", "--checkpoint", str(exported), "--split", "test"]) == 0
    assert "BLEU = " in capsys.readouterr().out


def test_int8_export_translates(trained_run, tmp_path, capsys):
    out = tmp_path / "int8"
    assert main(["export", "--checkpoint", str(trained_run / "checkpoints" / "best.pt"), "--output", str(out),
                 "--quantization", "int8"]) == 0
    assert json.loads((out / "transformer_nmt.json").read_text())["quantization"] == "int8"
    assert main(["translate", "--checkpoint", str(out), "Ein Mann fährt Fahrrad."]) == 0
    assert capsys.readouterr().out.strip()


def test_quantization_flag_refused_for_an_exported_folder(exported, capsys):
    assert main(["translate", "--checkpoint", str(exported), "--quantization", "int8", "Ein Hund."]) == 2
    err = capsys.readouterr().err
    assert "--quantization int8" in err and "CTranslate2 folder" in err and "transformer export" in err


def test_what_reads_our_attention_refuses_an_exported_folder_in_one_line(exported, tmp_path, capsys):
    assert main(["translate", "--checkpoint", str(exported), "--alignment", "Ein Hund."]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--alignment reads our model's attention" in err[0], err
    assert main(["attention", "--checkpoint", str(exported), "Ein Hund.", "--out", str(tmp_path / "a.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CTranslate2 folder has no attention to read" in err[0], err
    assert not (tmp_path / "a.json").exists()
