"""`transformer serve`: the JSON API through an in-process client, its refusals, and request batching over a trained
model. The service without FastAPI: `test_serve_service.py`."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'transformer-nmt[serve]'")
from fastapi.testclient import TestClient  # noqa: E402

from transformer import Transformer  # noqa: E402
from transformer.attention_plot import attention_for  # noqa: E402
from transformer.cli import main  # noqa: E402
from transformer.config import DecodingConfig  # noqa: E402
from transformer.serve import ServeLimits, create_app  # noqa: E402
from transformer.translate import Translator  # noqa: E402

SENTENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau spielt Gitarre auf der Straße."]


@pytest.fixture(scope="module")
def checkpoint(trained_run):
    return trained_run / "checkpoints" / "best.pt"


@pytest.fixture(scope="module")
def translator(checkpoint) -> Translator:
    return Translator.from_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def client(translator, checkpoint):
    with TestClient(create_app(translator, checkpoints=[str(checkpoint)])) as c:
        yield c


def test_translate_gives_what_the_python_api_gives_in_input_order(client, translator):
    response = client.post("/translate", json={"text": SENTENCES})
    assert response.status_code == 200, response.text
    assert response.json()["translations"] == translator.translate(SENTENCES)
    assert "n_best" not in response.json()
    one = client.post("/translate", json={"text": SENTENCES[1], "beam_size": 1}).json()
    assert one["translations"] == translator.translate([SENTENCES[1]], beam_size=1)
    assert one["beam_size"] == 1


def test_an_empty_sentence_in_a_list_gets_an_empty_translation(client, translator):
    """One rule for the CLI, the Python API and the server: line in, line out; only nothing at all is refused."""
    text = [SENTENCES[0], "", "   ", SENTENCES[1]]
    body = client.post("/translate", json={"text": text}).json()
    assert body["translations"] == translator.translate(text)
    assert body["translations"][1:3] == ["", ""] and body["translations"][0] and body["translations"][3]
    refused = client.post("/attention", json={"text": "  "})
    assert refused.status_code == 422 and refused.json()["field"] == "text"


def test_n_best_lists_come_with_scores_best_first(client, translator):
    body = client.post("/translate", json={"text": SENTENCES[:2], "beam_size": 4, "n_best": 3}).json()
    expected = translator.translate_n_best(SENTENCES[:2], n_best=3, beam_size=4)
    assert [[(h["text"], pytest.approx(h["score"], abs=1e-5)) for h in hyps] for hyps in body["n_best"]] == expected
    for hyps, best in zip(body["n_best"], body["translations"]):
        assert len(hyps) == 3 and hyps[0]["text"] == best
        assert [h["score"] for h in hyps] == sorted((h["score"] for h in hyps), reverse=True)


def test_attention_returns_every_weight_of_the_translation(client, translator):
    body = client.post("/attention", json={"text": SENTENCES[0]}).json()  # greedy unless asked otherwise
    assert body == json.loads(json.dumps(attention_for(translator, SENTENCES[0])))
    assert body["translation"] == client.post("/translate", json={"text": [SENTENCES[0]], "beam_size": 1}).json()[
        "translations"][0]
    config = translator.engine.attention_model.config
    S, T = len(body["src_pieces"]), len(body["tgt_out_pieces"])
    assert len(body["cross"]) == config.n_decoder_layers and len(body["encoder_self"]) == config.n_encoder_layers
    for kind, shape in (("cross", (T, S)), ("encoder_self", (S, S)), ("decoder_self", (T, T))):
        for layer in body[kind]:
            assert len(layer) == config.n_heads
            for head in layer:
                assert (len(head), len(head[0])) == shape
                assert all(abs(sum(row) - 1) < 1e-4 for row in head)


LONG = ("Ein Mann mit einem roten Hut fährt mit dem Fahrrad durch die Stadt, und zwei Hunde laufen neben ihm her. "
        * 20)[:1900].strip()  # within --max-chars (2000), and over 256 pieces: longer than max_positions 128


def test_a_sentence_longer_than_the_model_reads_is_translated_from_its_start_and_marked(client, translator):
    """Not refused: its start (max_positions tokens, eos included) is translated, as by the Python API, and the
    answer marks it per sentence; /attention shows the part translated."""
    limit = translator.config.model.max_positions
    assert len(LONG) <= ServeLimits().max_chars and len(translator.tokenizer.src_ids([LONG])[0]) > 2 * limit
    text = [SENTENCES[0], LONG, SENTENCES[1]]
    body = client.post("/translate", json={"text": text, "n_best": 2, "alignment": True})
    assert body.status_code == 200, body.text
    body = body.json()
    assert body["truncated"] == [False, True, False]
    result = translator.run(translator.request(text, translator.resolve_options()))
    assert body["translations"] == result.texts and result.truncated == [1]
    assert [h["text"] for h in body["n_best"][1]] == [t for t, _ in translator.translate_n_best([LONG], n_best=2)[0]]
    n_words = sum(piece.startswith("\u2581") for piece in translator.tokenizer.src_pieces(LONG)[:limit - 1])
    assert body["alignments"][1] and max(s for s, _ in body["alignments"][1]) < n_words  # the part translated
    assert client.post("/translate", json={"text": SENTENCES[:2]}).json()["truncated"] == [False, False]
    attention = client.post("/attention", json={"text": LONG})
    assert attention.status_code == 200, attention.text
    assert attention.json()["truncated"] is True and len(attention.json()["src_pieces"]) == limit
    assert client.post("/attention", json={"text": SENTENCES[0]}).json()["truncated"] is False


def test_health_describes_model_vocabulary_device_and_uptime(client, translator, checkpoint):
    body = client.get("/health").json()
    assert body["status"] == "ok" and body["device"] == "cpu" and body["uptime_s"] >= 0
    assert body["model"]["checkpoint"] == checkpoint.name and body["model"]["engine"] == "pytorch"
    assert body["model"]["parameters"] == Transformer(translator.config.model).num_parameters()  # as trained
    assert body["model"]["quantization"] is None and body["model"]["compile"] is False
    assert body["vocabulary"] == {"src_lang": "de", "tgt_lang": "en", "src_size": translator.tokenizer.src_vocab_size,
                                  "tgt_size": translator.tokenizer.tgt_vocab_size, "joint": True}
    assert body["decoding"]["beam_size"] == translator.config.decoding.beam_size
    assert body["limits"]["max_sentences"] == ServeLimits().max_sentences


def test_the_page_and_its_files_are_served_from_memory(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="translate"' in page.text and "/static/explorer.js" in page.text
    assert "http" not in page.text.replace("http-equiv", "")  # no CDN: everything comes from this server
    assert client.get("/static/explorer.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/static/style.css").status_code == 200
    for path in ("/static/app.py", "/static/../app.py", "/static/%2e%2e/app.py", "/static/index.html/"):
        assert client.get(path).status_code == 404


LIMITS = ServeLimits()
BAD_REQUESTS = [
    ("empty list", {"text": []}, 422, "text"),
    ("empty sentence", {"text": [""]}, 422, "text"),
    ("only blank sentences", {"text": ["   ", ""]}, 422, "text"),
    ("10,000 sentences", {"text": ["Ein Hund."] * 10_000}, 422, "text"),
    ("100,000 characters", {"text": "Hund " * 20_000}, 422, "text[0]"),
    ("text not a string", {"text": 5}, 422, "text"),
    ("text items not strings", {"text": ["Ein Hund.", 7]}, 422, "text[1]"),
    ("missing text", {"beam_size": 2}, 422, "text"),
    ("beam size a string", {"text": ["Ein Hund."], "beam_size": "four"}, 422, "beam_size"),
    ("beam size a float", {"text": ["Ein Hund."], "beam_size": 2.5}, 422, "beam_size"),
    ("beam size 0", {"text": ["Ein Hund."], "beam_size": 0}, 422, "beam_size"),
    ("beam size too large", {"text": ["Ein Hund."], "beam_size": LIMITS.max_beam_size + 1}, 422, "beam_size"),
    ("n_best above beam", {"text": ["Ein Hund."], "beam_size": 2, "n_best": 3}, 422, "n_best"),
    ("negative length penalty", {"text": ["Ein Hund."], "length_penalty": -1}, 422, "length_penalty"),
    ("negative min_len", {"text": ["Ein Hund."], "min_len": -2}, 422, "min_len"),
    ("unknown option", {"text": ["Ein Hund."], "beam": 4}, 422, "beam"),
    ("a file path option", {"text": ["Ein Hund."], "checkpoint": "/etc/passwd"}, 422, "checkpoint"),
    ("not an object", ["Ein Hund."], 422, "body"),
]


@pytest.mark.parametrize("body,status,field", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_translate_requests_get_a_4xx_naming_the_field(client, body, status, field):
    response = client.post("/translate", json=body)
    assert response.status_code == status, response.text
    assert response.json()["field"] == field and response.json()["error"]


def test_bad_bodies_and_attention_requests_are_refused_and_the_server_keeps_serving(client, translator):
    invalid = client.post("/translate", content=b'{"text": ["Ein Hund."', headers={"content-type": "application/json"})
    assert invalid.status_code == 400 and invalid.json()["field"] == "body" and "JSON" in invalid.json()["error"]
    huge = client.post("/translate", content=b"x" * (LIMITS.max_request_bytes + 1),
                       headers={"content-type": "application/json"})
    assert huge.status_code == 413 and "max-request-bytes" in huge.json()["error"]
    assert client.post("/attention", json={"text": SENTENCES}).json()["field"] == "text"
    assert client.post("/attention", json={"text": "Ein Hund.", "beam_size": 99}).json()["field"] == "beam_size"
    no_type = client.post("/translate", content=b'{"text": ["Ein Hund."]}', headers={"content-type": "text/plain"})
    assert no_type.status_code == 422 and "Content-Type: application/json" in no_type.json()["error"]
    typo = client.post("/translate", json={"text": "Ein Hund.", "beam_sze": 2}).json()
    assert typo["field"] == "beam_sze" and typo["error"] == "unknown option; did you mean beam_size?"
    not_text = client.post("/translate", json={"text": 5}).json()
    assert not_text["field"] == "text" and "a sentence (a string) or a list of sentences" in not_text["error"]
    assert client.post("/translate", json={"text": SENTENCES}).status_code == 200


RAW_BODIES = [  # valid JSON that is not text, and bodies the framework cannot parse
    ("lone surrogate", "/translate", b'{"text": ["Ein Hund l\\u00e4uft.", "Ein Hund \\ud83d l\\u00e4uft."]}', 422,
     "text[1]", "U+D83D at character 9"),
    ("lone surrogate, attention", "/attention", b'{"text": "\\udfff Ein Hund"}', 422, "text", "U+DFFF at character 0"),
    ("lone surrogate in a prefix", "/translate", b'{"text": ["Ein Hund."], "prefix": ["A \\ud83d"]}', 422,
     "prefix[0]", "U+D83D"),
    ("Latin-1 body", "/translate", '{"text": ["Ein Hund läuft."]}'.encode("latin-1"), 400, "body", "UTF-8"),
    ("nested 300,000 deep", "/translate", b"[" * 300_000 + b"]" * 300_000, 400, "body", "cannot be parsed"),
]


@pytest.mark.parametrize("path,content,status,field,words", [b[1:] for b in RAW_BODIES], ids=[b[0] for b in RAW_BODIES])
def test_bodies_that_are_not_text_get_a_json_4xx_naming_the_field(client, path, content, status, field, words):
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert response.json()["field"] == field and words in response.json()["error"]
    assert client.post("/translate", json={"text": SENTENCES[:1]}).status_code == 200


def test_unknown_paths_and_methods_and_server_faults_answer_json(translator, checkpoint, monkeypatch):
    with TestClient(create_app(translator, checkpoints=[str(checkpoint)]), raise_server_exceptions=False) as c:
        assert c.get("/nowhere").json()["field"] == "path"
        assert c.get("/translate").status_code == 405 and c.get("/translate").json()["field"] == "method"
        monkeypatch.setattr(translator, "run", lambda *a, **k: 1 / 0)
        fault = c.post("/translate", json={"text": ["Ein Hund."], "prefix": ["A"]})
        assert fault.status_code == 500 and "ZeroDivisionError" in fault.json()["error"]


def test_a_compiled_translator_warmed_up_serves_the_eager_outputs_without_compiling_again(translator, checkpoint):
    """`serve --compile` compiles before serving (`Translator.warm_up`): requests of several sizes, greedy and beam
    search, then need no compile, and answer what the eager translator gives."""
    from transformer.fast.compiled import compiled_graphs, forget_compiled

    forget_compiled()  # a serving process compiles one model: earlier tests compiled others of other sizes
    compiled = Translator.from_checkpoint(checkpoint, compile=True)
    before = compiled_graphs()  # counted over the process: earlier tests compile too
    compiled.warm_up()
    graphs = compiled_graphs()
    assert graphs - before >= 2  # greedy's step and beam search's
    with TestClient(create_app(compiled, checkpoints=[str(checkpoint)])) as c:
        assert c.get("/health").json()["model"]["compile"] is True
        for text, beam_size in ((SENTENCES, 1), (SENTENCES, 4), ([SENTENCES[2]], 1), ([SENTENCES[1]], 5)):
            body = c.post("/translate", json={"text": text, "beam_size": beam_size}).json()
            assert body["translations"] == translator.translate(text, beam_size=beam_size), (text, beam_size)
    assert compiled_graphs() == graphs


class GatedTranslator(Translator):
    """A translator over the same engine, behind a gate: the first decoding call waits until the test opens it."""

    def __init__(self, translator: Translator) -> None:
        super().__init__(translator.engine)
        self.calls, self.prefixes, self.gate = [], [], threading.Event()

    def run(self, request, *args, **options):
        self.calls.append(list(request.sentences))
        self.prefixes.append(request.prefixes)
        assert self.gate.wait(60), "the test never opened the gate"
        return super().run(request, *args, **options)


def _wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_requests_that_arrive_during_a_decode_share_the_next_one_and_health_answers_meanwhile(translator):
    gated = GatedTranslator(translator)
    app = create_app(gated, max_batch_sentences=64)
    batcher = app.state.service.batcher
    requests = [[SENTENCES[0]], [SENTENCES[1]], [SENTENCES[2], SENTENCES[0]], ["Ein Kind lacht."], [SENTENCES[2]]]
    answers: dict[int, list[str]] = {}
    with TestClient(app) as client:
        def send(i: int) -> None:
            answers[i] = client.post("/translate", json={"text": requests[i]}).json()["translations"]

        first = threading.Thread(target=send, args=(0,))
        first.start()
        others = [threading.Thread(target=send, args=(i,)) for i in range(1, len(requests))]
        try:
            _wait_until(lambda: len(gated.calls) == 1, "the first decoding call")
            for t in others:
                t.start()
            _wait_until(lambda: batcher.n_waiting == len(others), "the other requests to queue")
            health = client.get("/health")  # the event loop answers while the worker thread decodes
            assert health.status_code == 200 and health.json()["batching"]["batches"] == 0, health.text
        finally:
            gated.gate.set()  # a failed check must not leave the decoding thread waiting
        for t in [first, *others]:
            t.join(60)
        stats = client.get("/health").json()["batching"]
    assert len(gated.calls) == 2, gated.calls
    assert sorted(gated.calls[1]) == sorted(s for r in requests[1:] for s in r)
    for i, sentences in enumerate(requests):
        assert answers[i] == translator.translate(sentences), i
    assert (stats["batches"], stats["requests"], stats["largest_batch_requests"]) == (2, 5, 4)


def test_requests_with_prefixes_share_decoding_calls_with_the_others(translator):
    """A request with prefixes waits in the queue like any other and joins the next call of its options: its
    sentences carry their prefixes, the others' none, and each answer is what that request gets alone."""
    gated = GatedTranslator(translator)
    app = create_app(gated, max_batch_sentences=64)
    requests = [{"text": [SENTENCES[0]]}, {"text": SENTENCES[1:], "prefix": ["Two dogs", ""]},
                {"text": [SENTENCES[0], "Ein Kind lacht."]}]
    answers: dict[int, list[str]] = {}
    with TestClient(app) as client:
        def send(i: int) -> None:
            answers[i] = client.post("/translate", json=requests[i]).json()["translations"]

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
        threads[0].start()
        try:
            _wait_until(lambda: len(gated.calls) == 1, "the first decoding call")
            for t in threads[1:]:
                t.start()
            _wait_until(lambda: app.state.service.batcher.n_waiting == 2, "the other requests to queue")
        finally:
            gated.gate.set()
        for t in threads:
            t.join(60)
        stats = client.get("/health").json()["batching"]
    assert len(gated.calls) == 2 and gated.prefixes[0] is None  # the second call: both waiting requests
    assert sorted(zip(gated.calls[1], map(str, gated.prefixes[1]))) == sorted(
        [(SENTENCES[1], "Two dogs"), (SENTENCES[2], ""), (SENTENCES[0], "None"), ("Ein Kind lacht.", "None")])
    assert answers[1] == translator.translate(SENTENCES[1:], prefixes=["Two dogs", ""])
    assert answers[1][0].startswith("Two dogs")
    for i in (0, 2):
        assert answers[i] == translator.translate(requests[i]["text"]), i
    assert (stats["batches"], stats["requests"], stats["sentences"], stats["largest_batch_requests"]) == (2, 3, 5, 2)


def test_request_fields_are_the_decoding_options_typed_strictly_and_described(client):
    """The decoding fields come from `DecodingConfig` (`decoding/options.py`): a JSON int is a float, not a bool or
    an int's string; /attention takes them all but n_best; each is described in the OpenAPI schema."""
    assert client.post("/translate", json={"text": "Ein Hund.", "length_penalty": 1, "max_len_a": 2}).status_code == 200
    for bad, field in (({"sampling": 1}, "sampling"), ({"copy_unknown": "no"}, "copy_unknown"),
                       ({"max_len_b": 2.0}, "max_len_b"), ({"top_p": True}, "top_p")):
        response = client.post("/translate", json={"text": "Ein Hund.", **bad})
        assert response.status_code == 422 and response.json()["field"] == field, response.text
    attention = client.post("/attention", json={"text": "Ein Hund.", "no_repeat_ngram_size": 2, "max_repeat": 1})
    assert attention.status_code == 200, attention.text
    refused = client.post("/attention", json={"text": "Ein Hund.", "n_best": 2}).json()
    assert refused["field"] == "n_best" and refused["error"].startswith("unknown option")
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for name, exceptions in (("TranslateRequest", {"batch_size", "max_tokens_per_batch"}),
                             ("AttentionRequest", {"batch_size", "max_tokens_per_batch", "n_best"})):
        properties = schemas[name]["properties"]
        assert set(DecodingConfig.__dataclass_fields__) - exceptions <= set(properties)
        assert not exceptions & set(properties) and all(p.get("description") for p in properties.values()), name


def test_serve_refuses_a_missing_checkpoint_and_bad_limits(tmp_path, capsys):
    assert main(["serve", "--checkpoint", str(tmp_path / "missing.pt")]) == 2
    assert "missing.pt" in capsys.readouterr().err
    assert main(["serve", "--checkpoint", str(tmp_path / "missing.pt"), "--max-sentences", "0"]) == 2
    assert "--max-sentences" in capsys.readouterr().err
    assert main(["serve", "--checkpoint", str(tmp_path / "missing.pt"), "--port", "0"]) == 2
    assert "--port must be between 1 and 65535" in capsys.readouterr().err
