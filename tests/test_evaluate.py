import logging

import sacrebleu

from transformer.evaluate import bleu_tokenizer, corpus_scores


def test_scores_equal_sacrebleu_and_carry_signatures():
    hyps = ["A man rides a bike .", "Two dogs play in the snow."]
    refs = ["A man is riding a bike.", "Two dogs are playing in the snow."]
    scores = corpus_scores(hyps, refs, "en")
    assert scores.bleu == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert scores.chrf == sacrebleu.corpus_chrf(hyps, [refs]).score
    assert "tok:13a" in scores.bleu_signature and "nrefs:1" in scores.bleu_signature
    assert scores.n_sentences == 2


def test_languages_without_spaces_get_their_tokenizer():
    assert bleu_tokenizer("en") == "13a" and bleu_tokenizer("de") == "13a"
    assert bleu_tokenizer("zh") == "zh"
    assert bleu_tokenizer("ja") in ("ja-mecab", "char")  # char when the mecab extra is not installed
    hyps, refs = ["猫が座った。"], ["猫が座っていた。"]
    assert corpus_scores(hyps, refs, "zh").bleu_signature.count("tok:zh") == 1
    assert corpus_scores(hyps, refs, "en", tokenize="char").bleu > corpus_scores(hyps, refs, "en").bleu


def test_detokenized_hypotheses_ending_in_a_spaced_period_raise_no_detokenize_warning(caplog):
    """A weak model writes "a dog runs ." (its output, detokenized by us): sacrebleu must not tell the user that
    they forgot to detokenize their test data."""
    from transformer.evaluate import corpus_scores

    hyps = ["a dog runs ."] * 120
    with caplog.at_level(logging.WARNING):
        scores = corpus_scores(hyps, ["A dog runs."] * 120)
    assert 0 < scores.bleu < 100
    assert "detokenize" not in caplog.text


def test_translate_test_set_names_truncated_lines_once_from_each_calls_notes(caplog):
    from types import SimpleNamespace

    from transformer import evaluate
    from transformer.request import Translation

    class Stub:
        engine = SimpleNamespace(max_source_len=8)

        def request(self, lines, options):
            return lines

        def run(self, lines, scores):  # the call's own notes say which lines were cut
            return Translation([[(line.upper(), 0.0)] for line in lines], [[True] for _ in lines],
                               truncated=[i for i, line in enumerate(lines) if len(line) > 5])

    with caplog.at_level(logging.WARNING):
        out = evaluate.translate_test_set(Stub(), ["a", "long line", "b"], options=None)
    assert out == ["A", "LONG LINE", "B"] and len(caplog.records) == 1
    assert "1 source lines" in caplog.text and "(lines 2)" in caplog.text
