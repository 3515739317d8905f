"""The server as a plain service: `TranslationService` holds what `transformer serve` does for a request (validate it,
batch it with concurrent ones, translate, read attention, describe the model), with no web framework in sight.

    service = TranslationService(Translator.from_checkpoint("best.pt"))
    service.start()                                               # in the running event loop: the batcher
    await service.translate(["Ein Mann fährt Fahrrad."], {"beam_size": 4, "n_best": 2})
    await service.stop()

`app.py` adapts it to HTTP: each route passes the request's fields in and the answer out, and turns a
`RequestError` (an HTTP status, the field at fault and why) into the JSON of a 4xx or 5xx answer. The service needs
only asyncio (`batching.py`): it and its tests run without FastAPI or pydantic installed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..attention_plot import ATTENTION_SEARCH, AttentionPlotError, request_attention
from ..config import ConfigError, OptionError
from ..config.languages import language_pairs
from ..decoding.options import SERVER_BATCHING, option_fields
from ..request import (
    ResolvedOptions,
    TranslationRequest,
    WrittenLanguageError,
    WrittenSentence,
    read_sentences,
)
from ..translate import Translator
from .batching import RequestBatcher, Translated

log = logging.getLogger(__name__)

TRANSLATE_OPTIONS = option_fields(exclude=SERVER_BATCHING)
"""The decoding options a /translate request may set: every field of `DecodingConfig` but the batching, which is the
server's (`decoding/options.py`)."""
ATTENTION_OPTIONS = option_fields(exclude=(*SERVER_BATCHING, "n_best"))
"""Those of /attention: the same but n_best (it shows the best translation)."""


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for (`transformer serve --max-...` flags); beyond it: a 4xx naming the field."""

    max_sentences: int = 128
    """Sentences in one /translate request."""
    max_chars: int = 2000
    """Characters in one sentence."""
    max_beam_size: int = 16
    max_request_bytes: int = 1_000_000
    """Size of a request body (bytes); larger bodies get 413 before they are read whole."""
    request_timeout_s: float = 30.0
    """Seconds a request's body may take to arrive once its headers have (408 after it; 0: no limit). The server
    (`run_server`) bounds the headers' time by the same figure."""


@dataclass(frozen=True)
class ServeSettings:
    """How `transformer serve` runs (its flags): the model, where it listens, how it decodes and batches
    (`server.run_server`)."""

    checkpoints: tuple[str, ...]
    """What `Translator.from_checkpoint` opens: a .pt file, a MarianMT folder, a CTranslate2 folder; several: an
    ensemble."""
    host: str = "127.0.0.1"
    """Interface to bind; 127.0.0.1 is reachable from this machine only."""
    port: int = 8000
    device: str = "cpu"
    """Where to decode: cpu, cuda, cuda:N, mps, auto."""
    threads: int = 0
    """torch CPU threads (0: torch's default, one per core)."""
    quantization: Optional[str] = None
    """None or "int8" (`engines.open_engine`)."""
    compile: bool = False
    """Decode with the compiled step, compiled before the server starts answering (`Translator.warm_up`), so that no
    request waits for it."""
    limits: ServeLimits = field(default_factory=ServeLimits)
    max_batch_sentences: int = 0
    """Sentences collected into one decoding call (0: the checkpoint's decoding.batch_size)."""
    max_wait_ms: float = 5.0
    """How long to collect concurrent requests after the first (milliseconds)."""
    access_log: bool = True
    """Log one line per request (uvicorn's access log)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM or Ctrl-C, how long requests in flight may take to finish before they are cancelled and their
    connections closed (new connections are refused at once, connections with no request in flight closed at once)."""


class RequestError(Exception):
    """A request the service refuses: the HTTP status to answer, the field at fault (None: the request as a whole)
    and why."""

    def __init__(self, status: int, field: Optional[str], message: str) -> None:
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


class TranslationService:
    """Translation, attention and health for one loaded model, with the requests' validation and their batching.

    Args:
        translator: the model (any engine; /attention and alignments need one with an `attention_model`).
        checkpoints: what `health` reports as the model's origin (the paths opened; several: an ensemble).
        limits: per-request limits (default: `ServeLimits()`).
        max_batch_sentences: sentences collected into one decoding call (default: the checkpoint's
            decoding.batch_size).
        max_wait_ms: how long the batcher keeps collecting after the first waiting request (milliseconds).

    Attributes:
        translator, checkpoints, limits: as given. The service reports truncated inputs itself (the answers'
            `truncated` field and one log line per request naming the sentences): the translator's own warning,
            which would number the sentences of a whole decoding call, is off during the service's calls.
        batcher: the `RequestBatcher` that decodes every request's sentences; `start` and `stop` run it.

    Every method raises `RequestError` for a request it refuses (422 for bad input, 501 for what the engine cannot
    do), naming the field: "text", "text[3]", "prefix[0]", "beam_size", ... Options are a mapping from a field of
    `DecodingConfig` to its value (None: the checkpoint's default), of the field's type (`app.py` checks the types).
    """

    def __init__(
        self,
        translator: Translator,
        checkpoints: Sequence[str] = (),
        limits: Optional[ServeLimits] = None,
        max_batch_sentences: Optional[int] = None,
        max_wait_ms: float = 5.0,
    ) -> None:
        self.translator, self.checkpoints = translator, list(checkpoints)
        self.limits = limits or ServeLimits()
        self.batcher = RequestBatcher(
            self._translate_n_best,
            max_wait_ms=max_wait_ms,
            max_batch_sentences=max_batch_sentences or translator.config.decoding.batch_size,
        )
        self._started = time.time()

    def start(self) -> None:
        """Start the batcher (in the running event loop)."""
        self.batcher.start()

    async def stop(self) -> None:
        """Stop the batcher; requests still waiting get a `RuntimeError`."""
        await self.batcher.stop()

    async def translate(
        self,
        text: list[str],
        options: Mapping[str, Any],
        prefix: Optional[list[Optional[str]]] = None,
        alignment: bool = False,
    ) -> dict[str, Any]:
        """Translate sentences, batched with concurrent requests.

        Args:
            text: the sentences; an empty one among others gets an empty translation.
            options: decoding options (`TRANSLATE_OPTIONS`); with n_best, the answer has the n best with scores.
            prefix: per sentence, a target prefix its translation starts with (None or "": none).
            alignment: also answer each translation's word alignment (needs the engine's `attention_model`).

        Returns:
            {"translations": one per sentence, "truncated": one bool per sentence (True: longer than the engine's
            max_source_len tokens, only its start was translated; logged), "beam_size", "elapsed_ms"}; with n_best
            also "n_best" (per sentence, [{"text", "score", "end"}, ...], best first; "end" is "eos", or "cut" for a
            hypothesis stopped at the length cap); with alignment also "alignments"
            (per sentence, [source word, target word] pairs, of the part translated).

        A request whose caller is cancelled (its client went away) while it waits is not decoded; while its
        decoding call runs, the call stops before its next batch of sentences if no other request shares it.
        """
        start, given_n_best = time.perf_counter(), options.get("n_best")
        sentences = self._sentences(text)
        options = self._options(options, TRANSLATE_OPTIONS, sentences)
        if prefix is not None and len(prefix) != len(sentences):
            raise RequestError(
                422, "prefix", f"one prefix per sentence ({len(sentences)}), got {len(prefix)}"
            )
        for i, one in enumerate(prefix or []):
            _check_encodable(one or "", f"prefix[{i}]")
        request = self._request(
            sentences, options, prefix
        )  # before batching: a refusal fails this request only
        engine = self.translator.engine
        if alignment and engine.attention_model is None:
            raise RequestError(
                501,
                "alignment",
                f"alignments need our own model (a .pt checkpoint or a MarianMT "
                f"folder); this server runs a {engine.name} model, which has no attention to read",
            )
        results = await self.batcher.translate(request)
        truncated = [result.truncated for result in results]
        if any(truncated):
            self._log_truncated(
                "/translate", [i for i, cut in enumerate(truncated) if cut], len(sentences)
            )
        response: dict[str, Any] = {
            "translations": [result.n_best[0][0] for result in results],
            "truncated": truncated,
            "beam_size": options.decoding.beam_size,
        }
        if alignment:
            pairs = await self.batcher.run_on_worker(
                self.translator.align, request, response["translations"]
            )
            response["alignments"] = [[list(pair) for pair in sentence] for sentence in pairs]
        if given_n_best is not None:
            response["n_best"] = [
                [
                    {"text": text, "score": score, "end": "eos" if ended else "cut"}
                    for (text, score), ended in zip(result.n_best, result.finished)
                ]
                for result in results
            ]
        response["elapsed_ms"] = round((time.perf_counter() - start) * 1000, 2)
        return response

    async def attention(self, text: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """Translate one sentence (the best hypothesis) and return every attention weight: the data of
        `transformer attention --format json` (`attention_plot.attention_for`).

        Args:
            text: one sentence.
            options: decoding options (`ATTENTION_OPTIONS`); unset ones as `transformer attention` (greedy search,
                the checkpoint's other defaults).

        Returns:
            `attention_for`'s dict; its "truncated" is True (and logged) when the sentence was longer than the
            engine's max_source_len tokens: the translation and the weights are those of its start.
        """
        engine = self.translator.engine
        if engine.attention_model is None:
            raise RequestError(
                501,
                None,
                f"attention needs our own model (a .pt checkpoint or a MarianMT folder); "
                f"this server runs a {engine.name} model, which has no attention to read",
            )
        sentence = self._sentences([text], one=True)[0]
        given = {name: value for name, value in options.items() if value is not None}
        options = self._options(
            {**ATTENTION_SEARCH, **given}, ATTENTION_OPTIONS, [sentence], n_best=1
        )  # greedy by default
        request = self._request([sentence], options, None, one=True)
        try:
            data = await self.batcher.run_on_worker(request_attention, self.translator, request)
        except AttentionPlotError as err:
            raise RequestError(422, "text", str(err)) from None
        if data["truncated"]:
            self._log_truncated("/attention", [0], 1)
        return data

    def health(self) -> dict[str, Any]:
        """Model, vocabulary (src_lang and tgt_lang: None where the model's directions differ in it), languages
        (src_langs: those it translates from; tgt_langs: those a request's tgt_lang may name, a list of one for a
        bilingual model; directions: a multilingual model's), device, uptime (seconds), limits, decoding defaults
        and batching counts."""
        engine, config, tokenizer = (
            self.translator.engine,
            self.translator.config,
            self.translator.tokenizer,
        )
        sizes = (
            "d_model",
            "n_heads",
            "d_ff",
            "n_encoder_layers",
            "n_decoder_layers",
            "max_positions",
            "norm_first",
        )
        pairs = language_pairs(config.data)
        return {
            "status": "ok",
            "model": {
                "checkpoint": " ".join(Path(c).name for c in self.checkpoints),
                "engine": engine.name,
                **{k: getattr(config.model, k) for k in sizes},
                "parameters": engine.parameters,
                "quantization": engine.quantization,
                "compile": engine.compile,
            },
            "vocabulary": {
                "src_lang": _one(src for src, _ in pairs),
                "tgt_lang": _one(tgt for _, tgt in pairs),
                "src_size": tokenizer.src_vocab_size,
                "tgt_size": tokenizer.tgt_vocab_size,
                "joint": tokenizer.is_joint,
            },
            "languages": {
                "src_langs": list(dict.fromkeys(src for src, _ in pairs)),
                "tgt_langs": self.translator.languages,
                # the directions the model was scored on, one for a bilingual model (a synthetic corpus is none)
                "directions": [c.name for c in config.data.corpora if c.held_out],
            },
            "device": engine.device,
            "uptime_s": round(time.time() - self._started, 1),
            "limits": asdict(self.limits),
            "decoding": asdict(config.decoding),
            "batching": {
                "max_batch_sentences": self.batcher.max_batch_sentences,
                "max_wait_ms": self.batcher.max_wait_ms,
                **self.batcher.stats.to_dict(),
            },
        }

    def _translate_n_best(
        self, request: TranslationRequest, should_stop: Callable[[], bool]
    ) -> list[Translated]:
        """One decoding call of the batcher (on its worker thread, `batching.Decode`): each sentence marked truncated
        or not from this call's `Translation` (the service logs them per request, `translate`).

        Raises:
            DecodingStopped: `should_stop()` became True (every request of the call is gone).
        """
        result = self.translator.run(request, should_stop=should_stop)
        truncated = set(result.truncated)
        return [
            Translated(hyps, i in truncated, ends)
            for i, (hyps, ends) in enumerate(zip(result.n_best, result.finished))
        ]

    def _log_truncated(self, route: str, indices: list[int], n_sentences: int) -> None:
        """Log the sentences of one request whose start only was translated."""
        where = ", ".join(f"text[{i}]" for i in indices) if route == "/translate" else "text"
        limit = self.translator.engine.max_source_len
        log.warning(
            "%s: %d of %d sentences longer than the model's max_source_len=%d tokens, only their first %d "
            "translated (%s)",
            route,
            len(indices),
            n_sentences,
            limit,
            limit - 1,
            where,
        )

    def _options(
        self,
        given: Mapping[str, Any],
        allowed: list[dataclasses.Field],
        sentences: list[WrittenSentence],
        n_best: Optional[int] = None,
    ) -> ResolvedOptions:
        """The checkpoint's decoding section with the `given` options (those `allowed`), validated, within the limits,
        the target language resolved (the request's only resolution: without tgt_lang, a token written at the start
        of the `sentences` names it); `n_best`, if given, is the service's own choice (the request may not set it)."""
        unknown = [name for name in given if name not in {f.name for f in allowed}]
        if unknown:
            raise RequestError(422, unknown[0], "unknown option")
        beam_size, samples, limit = (
            given.get("beam_size"),
            given.get("n_best"),
            self.limits.max_beam_size,
        )
        if beam_size is not None and not 1 <= beam_size <= limit:
            raise RequestError(
                422,
                "beam_size",
                f"must be between 1 and {limit} (serve --max-beam-size), got {beam_size}",
            )
        if given.get("sampling") and samples is not None and not 1 <= samples <= limit:
            raise RequestError(
                422,
                "n_best",
                f"samples must be between 1 and {limit} (serve --max-beam-size), got {samples}",
            )
        values = dict(given) if n_best is None else {**given, "n_best": n_best}
        try:
            return self.translator.resolve_options(sentences, **values)
        except WrittenLanguageError as err:
            field = "text" if len(sentences) == 1 else f"text[{err.sentence}]"
            raise RequestError(422, field, err.detail) from None
        except ConfigError as err:
            raise RequestError(
                422, err.key and err.key.removeprefix("decoding."), err.detail
            ) from None

    def _request(
        self,
        sentences: list[WrittenSentence],
        options: ResolvedOptions,
        prefix: Optional[list[Optional[str]]],
        one: bool = False,
    ) -> TranslationRequest:
        """The resolved request (`Translator.request`) that goes into the batch; a prefix too long for the model or a
        sentence starting with another language's token (`>>deu<<`) than tgt_lang is refused here, before batching,
        so that it cannot fail the requests decoded with it."""
        try:
            return self.translator.request(sentences, options, prefix)
        except OptionError as err:
            raise RequestError(422, "prefix", str(err)) from None
        except WrittenLanguageError as err:  # tgt_lang itself was checked with the other options
            raise RequestError(
                422, "text" if one or len(sentences) == 1 else f"text[{err.sentence}]", err.detail
            ) from None

    def _sentences(self, sentences: list[str], one: bool = False) -> list[WrittenSentence]:
        """`sentences`, within the limits and valid text, each read once (`request.read_sentences`: a written
        `>>fra<<` and the text after it) for the options and the request; refused if there is nothing to
        translate."""
        limits = self.limits
        if not sentences:
            raise RequestError(
                422, "text", "no sentences: give a string or a non-empty list of strings"
            )
        if len(sentences) > limits.max_sentences:
            raise RequestError(
                422,
                "text",
                f"at most {limits.max_sentences} sentences per request "
                f"(serve --max-sentences), got {len(sentences)}",
            )
        if not any(
            sentence.strip() for sentence in sentences
        ):  # in a list, an empty one gets an empty translation
            raise RequestError(
                422,
                "text",
                "empty sentence"
                if one or len(sentences) == 1
                else "nothing to translate: every sentence is empty",
            )
        for i, sentence in enumerate(sentences):
            where = "text" if one else f"text[{i}]"
            if len(sentence) > limits.max_chars:
                raise RequestError(
                    422,
                    where,
                    f"{len(sentence)} characters; at most {limits.max_chars} (serve --max-chars)",
                )
            _check_encodable(sentence, where)
        return read_sentences(sentences)


def _one(languages: Any) -> Optional[str]:
    """The language of every corpus on one side, or None when they differ (a multilingual model)."""
    distinct = set(languages)
    return distinct.pop() if len(distinct) == 1 else None


def _check_encodable(text: str, where: str) -> None:
    """Refuse text that is not Unicode text (a lone surrogate such as "\\ud83d", which JSON can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(
            422,
            where,
            f"not valid text: a lone surrogate U+{ord(text[err.start]):04X} at character "
            f"{err.start} (send whole characters: a surrogate pair or the character itself)",
        ) from None
