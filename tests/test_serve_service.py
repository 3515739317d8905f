"""`transformer serve` without the web: `TranslationService` (validation, n-best, health, what an engine without
attention refuses, attention's options, inputs longer than the model reads, departed clients) and `RequestBatcher`
(requests with prefixes share calls), over a fake engine that echoes its input and a tiny untrained model, with no
FastAPI. The HTTP routes over a trained model: `test_serve.py`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import subprocess
import sys
import threading

import pytest
import torch

from transformer.config import Config, DataConfig, DecodingConfig, OptionError, TransformerConfig
from transformer.decoding import Hypothesis
from transformer.engines import PyTorchEngine, SourceBatch
from transformer.model import Transformer
from transformer.serve.batching import RequestBatcher, Translated
from transformer.serve.service import RequestError, ServeLimits, TranslationService
from transformer.tokenizer import Tokenizer, train_tokenizer
from transformer.translate import DecodingStopped, Translator

SRC = ["Ein Hund läuft.", "Zwei Katzen schlafen im Gras.", "Ein Mann fährt Fahrrad auf der Straße.", "Kinder spielen."]
TGT = ["A dog runs.", "Two cats sleep in the grass.", "A man rides a bike on the street.", "Children play."]


class EchoEngine:
    """An engine (`engines.Engine`) without attention, named as CTranslate2 is: hypothesis k of a sentence is its
    prefix, its source pieces, then its first k source pieces again, scored -k. Records every call."""

    name = "ctranslate2"
    attention_model = None
    parameters = None
    quantization = None
    compile = False
    workers = 1
    device = "cpu"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.config = Config(model=TransformerConfig(src_vocab_size=tokenizer.src_vocab_size,
                                                     tgt_vocab_size=tokenizer.tgt_vocab_size, d_model=32, n_heads=4,
                                                     d_ff=64, n_encoder_layers=1, n_decoder_layers=1,
                                                     max_positions=64),
                             data=DataConfig(path="corpus", vocab_size=120), decoding=DecodingConfig(beam_size=4))
        self.max_source_len = self.config.model.max_positions
        self.calls: list[list[SourceBatch]] = []

    def search(self, batches: list[SourceBatch], options: DecodingConfig, scores: bool) -> list[list[list[Hypothesis]]]:
        self.calls.append(batches)
        return [[[Hypothesis((batch.prefixes[i] or [] if batch.prefixes else []) + ids[:-1] + ids[:k],
                             -float(k) if scores else float("nan"), True) for k in range(options.n_best)]
                 for i, ids in enumerate(batch.src_ids)] for batch in batches]

    def warm_up(self) -> float:
        return 0.0


class GatedEngine(EchoEngine):
    """An EchoEngine whose decoding calls wait, once `entered` is set by the first, until the test opens `gate`;
    the checkpoint decodes one sentence per batch."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.config = dataclasses.replace(self.config, decoding=DecodingConfig(beam_size=4, batch_size=1))
        self.entered, self.gate = threading.Event(), threading.Event()

    def search(self, batches, options, scores):
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().search(batches, options, scores)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(SRC * 30, TGT * 30, DataConfig(path="corpus", vocab_size=120))


@pytest.fixture
def engine(tokenizer) -> EchoEngine:
    return EchoEngine(tokenizer)


@pytest.fixture
def service(engine) -> TranslationService:
    return TranslationService(Translator(engine), checkpoints=["/models/echo.pt"], limits=ServeLimits(max_beam_size=8))


def _run(service: TranslationService, *calls):
    """Await the service's calls (coroutine functions of nothing) concurrently, the batcher running; their results."""
    async def run():
        service.start()
        try:
            return await asyncio.gather(*(call() for call in calls))
        finally:
            await service.stop()
    return asyncio.run(run())


def test_the_service_imports_without_a_web_framework():
    code = ("import sys\n"
            "for name in ('fastapi', 'pydantic', 'starlette', 'uvicorn'): sys.modules[name] = None  # not installed\n"
            "from transformer.serve import RequestBatcher, ServeLimits, TranslationService\n"
            "from transformer.serve.service import RequestError\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


REFUSALS = [  # (text, options, prefix), status, field, words of the message
    ("empty list", ([], {}, None), "text", "no sentences"),
    ("only blank sentences", (["  ", ""], {}, None), "text", "every sentence is empty"),
    ("too many sentences", (["Ein Hund."] * 129, {}, None), "text", "--max-sentences"),
    ("a long sentence", (["Ein Hund.", "Hund " * 500], {}, None), "text[1]", "--max-chars"),
    ("a lone surrogate", (["Ein Hund.", "Ein \ud83d Hund."], {}, None), "text[1]", "U+D83D at character 4"),
    ("prefixes not one per sentence", (SRC[:2], {}, ["A"]), "prefix", "one prefix per sentence (2), got 1"),
    ("a lone surrogate in a prefix", (SRC[:1], {}, ["A \udfff"]), "prefix[0]", "U+DFFF"),
    ("an unknown option", (SRC[:1], {"beam": 4}, None), "beam", "unknown option"),
    ("a batching option", (SRC[:1], {"batch_size": 4}, None), "batch_size", "unknown option"),
    ("beam size 0", (SRC[:1], {"beam_size": 0}, None), "beam_size", "between 1 and 8"),
    ("beam size over the limit", (SRC[:1], {"beam_size": 9}, None), "beam_size", "--max-beam-size"),
    ("samples over the limit", (SRC[:1], {"sampling": True, "n_best": 9}, None), "n_best", "--max-beam-size"),
    ("n_best above the beam", (SRC[:1], {"beam_size": 2, "n_best": 3}, None), "n_best", "beam_size=2, got 3"),
    ("top_k without sampling", (SRC[:1], {"top_k": 5}, None), "top_k", "used only when sampling"),
    ("a negative length penalty", (SRC[:1], {"length_penalty": -1.0}, None), "length_penalty", "must be >= 0"),
]


@pytest.mark.parametrize("request_,field,words", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_carry_their_field_and_decode_nothing(service, engine, request_, field, words):
    text, options, prefix = request_
    with pytest.raises(RequestError) as refused:
        _run(service, lambda: service.translate(text, options, prefix))
    assert (refused.value.status, refused.value.field) == (422, field)
    assert words in refused.value.message and not refused.value.message.startswith("decoding.")
    assert engine.calls == []


def test_n_best_lists_come_with_scores_best_first(service):
    body, = _run(service, lambda: service.translate(SRC[:2], {"beam_size": 3, "n_best": 2}))
    translator = service.translator
    result = translator.run(translator.request(SRC[:2], translator.resolve_options(n_best=2, beam_size=3)))
    alone = result.n_best
    assert body["n_best"] == [[{"text": text, "score": score, "end": "eos" if end else "cut"}
                               for (text, score), end in zip(hyps, ends)]
                              for hyps, ends in zip(alone, result.finished)]  # translate --n-best's columns
    assert body["translations"] == [hyps[0][0] for hyps in alone] and body["beam_size"] == 3
    plain, = _run(service, lambda: service.translate(SRC[:2], {"beam_size": None}))
    assert "n_best" not in plain and plain["beam_size"] == 4  # the checkpoint's decoding section
    assert plain["translations"] == body["translations"]


def test_an_engine_without_attention_refuses_alignments_and_attention_before_decoding(service, engine):
    with pytest.raises(RequestError) as refused:
        _run(service, lambda: service.translate(SRC[:1], {}, alignment=True))
    assert (refused.value.status, refused.value.field) == (501, "alignment") and "ctranslate2" in refused.value.message
    with pytest.raises(RequestError) as refused:
        _run(service, lambda: service.attention(SRC[0], {}))
    assert (refused.value.status, refused.value.field) == (501, None) and "ctranslate2" in refused.value.message
    assert engine.calls == []


def test_attention_takes_every_option_but_n_best_and_shows_the_best_translation(tokenizer):
    """/attention decodes one hypothesis whatever the checkpoint's n_best: here the checkpoint samples 3, and a
    request that turns sampling off (beam size 1) is not refused for n_best 3 > beam size 1."""
    config = EchoEngine(tokenizer).config
    config = dataclasses.replace(config, decoding=DecodingConfig(sampling=True, beam_size=1, n_best=3))
    torch.manual_seed(0)
    translator = Translator(PyTorchEngine(Transformer(config.model).eval(), tokenizer, config))
    service = TranslationService(translator)
    body, = _run(service, lambda: service.attention(SRC[0], {"sampling": False, "no_repeat_ngram_size": 2}))
    assert body["translation"] == translator.translate([SRC[0]], sampling=False, no_repeat_ngram_size=2)[0]
    assert len(body["cross"]) == config.model.n_decoder_layers
    with pytest.raises(RequestError) as refused:
        _run(service, lambda: service.attention(SRC[0], {"n_best": 2}))
    assert (refused.value.status, refused.value.field, refused.value.message) == (422, "n_best", "unknown option")


def test_health_describes_the_engine_by_its_attributes(service, tokenizer):
    _run(service, lambda: service.translate(SRC[:3], {}), lambda: service.translate(SRC[3:], {}))
    health = service.health()
    assert health["status"] == "ok" and health["device"] == "cpu" and health["uptime_s"] >= 0
    assert health["model"] == {
        "checkpoint": "echo.pt", "engine": "ctranslate2", "d_model": 32, "n_heads": 4, "d_ff": 64,
        "n_encoder_layers": 1, "n_decoder_layers": 1, "max_positions": 64, "norm_first": False, "parameters": None,
        "quantization": None, "compile": False}
    assert health["vocabulary"] == {"src_lang": "de", "tgt_lang": "en", "src_size": tokenizer.src_vocab_size,
                                    "tgt_size": tokenizer.tgt_vocab_size, "joint": True}
    assert health["limits"]["max_beam_size"] == 8 and health["decoding"]["beam_size"] == 4
    batching = health["batching"]
    assert (batching["requests"], batching["sentences"], batching["batches"]) == (2, 4, 1), batching
    assert batching["max_batch_sentences"] == service.translator.config.decoding.batch_size


def test_a_request_with_prefixes_shares_a_decoding_call_and_gets_what_it_would_alone(engine):
    translator = Translator(engine)
    prefixes = ["Ein Kind", ""]
    service = TranslationService(translator, max_batch_sentences=3, max_wait_ms=60_000)  # decodes once 3 wait
    with_prefixes, without = _run(service, lambda: service.translate(SRC[:2], {}, prefixes),
                                  lambda: service.translate(SRC[2:3], {}))
    assert len(engine.calls) == 1  # one decoding call for both requests
    decoded = engine.calls[0][0]  # one batch: 3 sentences, one with a prefix
    assert sorted(p is not None for p in decoded.prefixes) == [False, False, True]
    assert with_prefixes["translations"] == translator.translate(SRC[:2], prefixes=prefixes)
    assert with_prefixes["translations"][0].startswith("Ein Kind")
    assert without["translations"] == translator.translate(SRC[2:3])
    stats = service.batcher.stats
    assert (stats.requests, stats.sentences, stats.batches, stats.largest_batch_requests) == (2, 3, 1, 2)


def test_the_batcher_passes_prefixes_only_when_a_sentence_of_the_call_has_one(tokenizer):
    calls = []

    def translate_n_best(request, should_stop):
        calls.append((list(request.sentences), request.prefixes))
        return [Translated([(f"{prefix or ''}|{sentence}", 0.0)])
                for sentence, prefix in zip(request.sentences, request.prefixes or [None] * len(request))]

    async def run():
        batcher = RequestBatcher(translate_n_best, max_batch_sentences=3, max_wait_ms=60_000)
        batcher.start()
        translator = Translator(EchoEngine(tokenizer))
        options = translator.resolve_options()

        def request(sentences, prefixes=None):
            return translator.request(sentences, options, prefixes)
        try:
            plain = await asyncio.gather(batcher.translate(request(["a", "b"])), batcher.translate(request(["c"])))
            mixed = await asyncio.gather(batcher.translate(request(["d"])),
                                         batcher.translate(request(["e", "f"], ["E", None])))
            with pytest.raises(OptionError, match="one per sentence"):
                await batcher.translate(request(["g"], ["G", "H"]))
        finally:
            await batcher.stop()
        return plain, mixed, batcher.stats

    plain, mixed, stats = asyncio.run(run())
    assert calls == [(["a", "b", "c"], None), (["d", "e", "f"], [None, "E", None])]
    assert [[t.n_best for t in request] for request in plain] == [[[("|a", 0.0)], [("|b", 0.0)]], [[("|c", 0.0)]]]
    assert [[t.n_best for t in request] for request in mixed] == [[[("|d", 0.0)]], [[("E|e", 0.0)], [("|f", 0.0)]]]
    assert (stats.requests, stats.sentences, stats.batches) == (4, 6, 2)


LONG = "Ein Hund läuft. " * 60  # 960 characters, within --max-chars; hundreds of pieces, more than max_positions 64


def test_sentences_longer_than_the_model_reads_are_marked_per_request_and_logged(engine, tokenizer, caplog):
    """Two requests share one decoding call; each answer marks its own sentences cut to the model's
    max_source_len, and the server logs them by their index in their request (the translator's own warning, which
    counts sentences of the whole call, is off)."""
    assert len(tokenizer.src_ids([LONG.strip()])[0]) + 1 > engine.max_source_len
    translator = Translator(engine)
    service = TranslationService(translator, max_batch_sentences=5, max_wait_ms=60_000)  # decodes once 5 wait
    with caplog.at_level(logging.WARNING):
        first, second = _run(service, lambda: service.translate([SRC[0], LONG], {"n_best": 2}),
                             lambda: service.translate([LONG, SRC[1], SRC[2]], {"n_best": 2}))
    records = list(caplog.records)
    assert len(engine.calls) == 1  # one decoding call for both
    assert first["truncated"] == [False, True] and second["truncated"] == [True, False, False]
    served = sorted(r.getMessage() for r in records if r.name == "transformer.serve.service")
    assert served == ["/translate: 1 of 2 sentences longer than the model's max_source_len=64 tokens, only their "
                      "first 63 translated (text[1])",
                      "/translate: 1 of 3 sentences longer than the model's max_source_len=64 tokens, only their "
                      "first 63 translated (text[0])"], served
    assert not [r for r in records if r.name == "transformer.translate"]
    alone = Translator(EchoEngine(tokenizer))
    result = alone.run(alone.request([SRC[0], LONG], alone.resolve_options()))
    assert first["translations"] == result.texts and result.truncated == [1]
    assert [h["text"] for h in second["n_best"][0]] == [t for t, _ in alone.translate_n_best([LONG], n_best=2)[0]]
    quick = TranslationService(translator, max_wait_ms=1)  # the service above waits for 5 sentences
    plain, = _run(quick, lambda: quick.translate(SRC[:2], {}))
    assert plain["truncated"] == [False, False]


def test_the_translator_stops_between_batches_when_asked(tokenizer):
    engine = EchoEngine(tokenizer)
    engine.workers = 2  # the check comes before each group of `workers` batches
    translator = Translator(engine)
    asked = []

    def after_two_groups() -> bool:
        asked.append(len(engine.calls))
        return len(engine.calls) == 2

    with pytest.raises(DecodingStopped):
        translator.translate_n_best(SRC * 2, batch_size=1, should_stop=after_two_groups)
    assert [len(batches) for batches in engine.calls] == [2, 2] and asked == [0, 1, 2]
    engine.calls.clear()
    assert translator.translate_n_best(SRC, batch_size=1, should_stop=lambda: False) == \
        translator.translate_n_best(SRC, batch_size=1)
    assert [len(batches) for batches in engine.calls] == [2, 2, 4]  # without a check: one call


def _cancel_during_decoding(engine: GatedEngine, requests: list[list[str]], leaving: int) -> tuple[list, object]:
    """Send `requests` together (one decoding call), cancel request `leaving` (its client goes away) while the
    call's first batch decodes, then let decoding go on. Returns (each request's answer or None, batcher stats)."""
    service = TranslationService(Translator(engine), max_batch_sentences=sum(map(len, requests)), max_wait_ms=60_000)

    async def run():
        service.start()
        try:
            tasks = [asyncio.ensure_future(service.translate(text, {})) for text in requests]
            while not engine.entered.is_set():
                await asyncio.sleep(0.01)
            tasks[leaving].cancel()
            await asyncio.sleep(0.05)  # the cancellation reaches the batcher
            engine.gate.set()
            answers = await asyncio.gather(*tasks, return_exceptions=True)
            await service.batcher.run_on_worker(lambda: None)  # after the decoding call, on its thread
            await asyncio.sleep(0.05)  # the batcher takes its outcome
        finally:
            engine.gate.set()
            await service.stop()
        return [None if isinstance(a, BaseException) else a for a in answers], service.health()["batching"]

    return asyncio.run(run())


def test_a_departed_client_s_decoding_call_stops_at_its_next_batch(tokenizer, caplog):
    """One sentence per batch: the call of a request whose client leaves during its first batch decodes nothing
    more; it is counted in /health's cancelled_requests and said in the log."""
    engine = GatedEngine(tokenizer)
    with caplog.at_level(logging.INFO, logger="transformer.serve.batching"):
        answers, batching = _cancel_during_decoding(engine, [SRC], leaving=0)
    assert "stopped: every client went away" in caplog.text
    assert answers == [None]
    assert sum(len(batches) for batches in engine.calls) == 1, engine.calls  # of 4 batches
    assert batching["cancelled_requests"] == 1 and batching["abandoned_requests"] == 0
    assert (batching["requests"], batching["sentences"], batching["batches"]) == (0, 0, 0)


def test_a_call_shared_with_a_client_still_there_is_decoded_to_the_end(tokenizer):
    engine = GatedEngine(tokenizer)
    answers, batching = _cancel_during_decoding(engine, [SRC[:2], SRC[2:]], leaving=0)
    assert answers[0] is None and answers[1]["translations"] == Translator(EchoEngine(tokenizer)).translate(SRC[2:])
    assert sum(len(batches) for batches in engine.calls) == 4
    assert batching["cancelled_requests"] == 0 and (batching["requests"], batching["sentences"]) == (2, 4)


class CutEngine(EchoEngine):
    """EchoEngine whose hypotheses after the first are cut at the length cap (no eos)."""

    def search(self, batches, options, scores):
        return [[[dataclasses.replace(h, finished=k == 0) for k, h in enumerate(hyps)] for hyps in batch]
                for batch in super().search(batches, options, scores)]


def test_n_best_entries_say_whether_each_hypothesis_ended_or_was_cut(tokenizer):
    service = TranslationService(Translator(CutEngine(tokenizer)))
    body, = _run(service, lambda: service.translate(SRC[:2], {"beam_size": 3, "n_best": 3}))
    assert [[h["end"] for h in hyps] for hyps in body["n_best"]] == [["eos", "cut", "cut"]] * 2
    assert "index<TAB>score<TAB>text<TAB>end" in DecodingConfig.__dataclass_fields__["n_best"].metadata["help"]


class SilentEngine(EchoEngine):
    """EchoEngine that writes nothing for a sentence starting with "Kinder" (eos first)."""

    def search(self, batches, options, scores):
        kinder = self.tokenizer.src_ids(["Kinder"])[0][0]
        return [[[dataclasses.replace(h, tokens=[]) if ids[0] == kinder else h for h in hyps]
                 for ids, hyps in zip(batch.src_ids, out)]
                for batch, out in zip(batches, super().search(batches, options, scores))]


def test_an_empty_translation_of_a_sentence_with_text_is_noted_and_warned(tokenizer, caplog):
    translator = Translator(SilentEngine(tokenizer))
    result = translator.run(translator.request(["", SRC[3], SRC[0]], translator.resolve_options()))
    assert result.texts[1] == "" and result.texts[2] and result.empty == [1]  # an empty input is not one
    with caplog.at_level(logging.WARNING, logger="transformer.translate"):
        translator.translate(["", SRC[3], SRC[0]])
    assert "1 of 3 inputs have an empty translation (inputs 2)" in caplog.text
