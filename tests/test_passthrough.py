"""Text the vocabulary lacks (emoji, flags, ZWJ sequences, other scripts) passes through once and unchanged, and the
text around it is translated as it would be without it: the Python API, the CLI, the server and CTranslate2."""

from __future__ import annotations

import gzip

import pytest

from scripts.benchmark_passthrough import SPANS, build_set, without_spans
from transformer import Translator
from transformer.cli import main
from transformer.passthrough import PassThrough, Protected, Span, clusters

FAMILY = SPANS[2]  # man ZWJ woman ZWJ girl


def test_clusters_keep_emoji_sequences_and_flags_whole():
    for span in SPANS:
        assert clusters(span) == [span]
        assert clusters(f"a{span}b") == ["a", span, "b"]
    assert clusters("e\u0301\u0323x") == ["e\u0301\u0323", "x"]  # a base letter keeps its combining marks
    assert clusters("\U0001F1E9\U0001F1EA\U0001F1EB\U0001F1F7") == ["\U0001F1E9\U0001F1EA", "\U0001F1EB\U0001F1F7"]


def test_restore_follows_the_alignment_the_glue_and_the_ends():
    protected = Protected("Ein Hund läuft", 3, (Span("A", 0, False, False), Span("B", 2, True, False),
                                               Span("C", 2, False, True), Span("D", 3, False, False)))
    # Ein-A, Hund-dog, läuft-runs; B is written onto "Hund", C onto "läuft"
    alignment = [(0, 0), (1, 1), (2, 2)]
    assert PassThrough.restore("A dog runs", protected, alignment) == "A A dogB Cruns D"
    assert PassThrough.restore("runs the dog", protected, [(1, 2), (2, 0)]) == "A Cruns the dogB D"
    # no alignment: relative positions (2 of 3 source words before B and C -> 2 of 3 target words)
    assert PassThrough.restore("x y z", protected) == "A x yB Cz D"
    prefixed = PassThrough.restore("x y z", protected, n_prefix_words=2)  # nothing inside a prefix
    assert prefixed.startswith("x y") and all(prefixed.count(c) == 1 for c in "ABCD")


def test_a_span_goes_back_before_the_punctuation_that_followed_it():
    """"in Łódź." is translated as "in." and restored as "in Łódź.", not "in. Łódź" (nor "in . Łódź.")."""
    protected = Protected("Er spielt in.", 3, (Span("Łódź", 3, False, True, before_punctuation=True),))
    assert PassThrough.restore("He plays in.", protected, [(0, 0), (1, 1), (2, 2)]) == "He plays in Łódź."
    assert PassThrough.restore("He plays in!?", protected) == "He plays in Łódź!?"
    assert PassThrough.restore("He plays in", protected) == "He plays in Łódź"
    middle = Protected("aus, der spielt", 3, (Span("Łódź", 1, False, True, before_punctuation=True),))
    assert PassThrough.restore("from, who plays", middle, [(0, 0), (1, 1), (2, 2)]) == "from Łódź, who plays"


@pytest.fixture(scope="module")
def translator(trained_run):
    return Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt", device="cpu")


@pytest.fixture(scope="module")
def cases(multi30k_subset):
    """The benchmark's set (scripts/benchmark_passthrough.py) on test lines: (sentence with spans, the sentence
    without them, spans), spans at the start, inside and at the end, alone or written onto a word."""
    lines = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt").read().split("\n")[:len(SPANS) * 3]
    return build_set(lines)


@pytest.mark.parametrize("options", [dict(beam_size=1), dict(beam_size=4), dict(sampling=True, seed=3)],
                         ids=["greedy", "beam", "sampling"])
def test_each_span_comes_back_once_and_the_rest_is_the_translation_without_it(translator, cases, options):
    result = translator.run(translator.request([s for s, _, _ in cases], translator.resolve_options(**options,
                                                                                                   n_best=1)))
    outputs = result.texts
    assert result.n_copied_unknown == len(cases)
    clean = translator.translate([c for _, c, _ in cases], **options)
    for (sentence, _, spans), output, expected in zip(cases, outputs, clean):
        for span in spans:
            assert output.count(span) == spans.count(span), (sentence, output)
        assert without_spans(output, spans) == " ".join(expected.split()), (sentence, output)
    dropped = translator.translate([s for s, _, _ in cases], copy_unknown=False, **options)
    assert not any(span in out for (_, _, spans), out in zip(cases, dropped) for span in spans)


def test_spans_follow_the_word_they_came_after(translator):
    start, end = translator.translate(["\U0001F606 Ein Mann fährt Fahrrad.", "Ein Mann fährt Fahrrad. \U0001F606"])
    assert start.startswith("\U0001F606 ") and end.endswith(" \U0001F606")
    glued = translator.translate(["Ein Mann\U0001F6B2 fährt."])[0]
    assert "\U0001F6B2" in glued and " \U0001F6B2" not in glued  # written onto a word, it stays on one


def test_a_word_with_an_unknown_letter_leaves_its_punctuation_to_the_translation(translator):
    sentence = "Ein Mann spielt Fußball in Łódź."
    tokenizer = translator.tokenizer
    protected = PassThrough(tokenizer).protect([sentence], tokenizer.src_ids([sentence]))[0]
    assert protected.text == "Ein Mann spielt Fußball in." and [s.text for s in protected.spans] == ["Łódź"]
    output = translator.translate([sentence])[0]
    assert output.count("Łódź") == 1 and ". Łódź" not in output, output  # "… in Łódź." or "… in Łódź"


def test_n_best_prefixes_and_a_sentence_of_spans_only(translator):
    hyps = translator.translate_n_best([f"Ein Hund {FAMILY} läuft."], beam_size=4, n_best=3)[0]
    assert len(hyps) == 3 and all(text.count(FAMILY) == 1 for text, _ in hyps)
    prefixed = translator.translate([f"{SPANS[0]} Ein Hund läuft."], prefixes=["A dog"])[0]
    assert prefixed.startswith("A dog") and prefixed.count(SPANS[0]) == 1
    assert translator.translate([f"{SPANS[0]} {SPANS[2]}", ""]) == [f"{SPANS[0]} {SPANS[2]}", ""]


def test_cli_copies_and_no_copy_unknown_drops(trained_run, capsys):
    checkpoint = str(trained_run / "checkpoints" / "best.pt")
    sentence = f"Ein Mann {SPANS[1]} fährt {SPANS[3]} Fahrrad."
    assert main(["translate", "--checkpoint", checkpoint, sentence]) == 0
    out = capsys.readouterr().out
    assert out.count(SPANS[1]) == 1 and out.count(SPANS[3]) == 1
    assert main(["translate", "--checkpoint", checkpoint, "--no-copy-unknown", sentence]) == 0
    out = capsys.readouterr().out
    assert SPANS[1] not in out and SPANS[3] not in out and out.strip()


def test_the_server_copies_too(translator, trained_run):
    TestClient = pytest.importorskip("fastapi.testclient").TestClient

    from transformer.serve.app import create_app

    with TestClient(create_app(translator, checkpoints=[str(trained_run / "checkpoints" / "best.pt")])) as client:
        response = client.post("/translate", json={"text": [f"Zwei Hunde {SPANS[0]} spielen im Schnee.", "Ein Hund."]})
    assert response.status_code == 200, response.text
    first, second = response.json()["translations"]
    assert first.count(SPANS[0]) == 1 and SPANS[0] not in second
    with TestClient(create_app(translator, checkpoints=[str(trained_run / "checkpoints" / "best.pt")])) as client:
        response = client.post("/translate", json={"text": f"Zwei Hunde {SPANS[0]} spielen.", "copy_unknown": False})
    assert response.status_code == 200 and SPANS[0] not in response.json()["translations"][0], response.text


def test_ctranslate2_copies_at_relative_positions(trained_run, cases, tmp_path):
    pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    assert main(["export", "--checkpoint", str(trained_run / "checkpoints" / "best.pt"), "--format", "ctranslate2",
                 "--output", str(out)]) == 0
    ct2 = Translator.from_checkpoint(out)
    assert ct2.engine.name == "ctranslate2" and ct2.engine.attention_model is None  # copies by relative position
    outputs = ct2.translate([s for s, _, _ in cases], beam_size=2)
    clean = ct2.translate([c for _, c, _ in cases], beam_size=2)
    for (sentence, _, spans), output, expected in zip(cases, outputs, clean):
        assert all(span in output for span in spans), (sentence, output)
        assert without_spans(output, spans) == " ".join(expected.split()), (sentence, output)
