"""The HTTP API and the page: `create_app(translator)` builds a FastAPI application around one loaded model.

    POST /translate   {"text": ["Ein Mann fährt Fahrrad.", ...], "beam_size": 4, "n_best": 2, ...}
                      -> {"translations": [...], "n_best": [[{"text": ..., "score": ...}, ...], ...]}
    POST /attention   {"text": "Ein Mann fährt Fahrrad."}
                      -> the `transformer attention --format json` data (see `attention_plot`)
    GET  /health      model, vocabulary, device, uptime, limits and batching counts
    GET  /            the attention explorer (static HTML, CSS and JavaScript from `static/`, no CDN)

Bad input gets a 4xx response whose JSON names the field: `{"error": message, "field": "beam_size", "errors":
[{"field": ..., "message": ...}, ...]}`. Requests never name files: the page's three files are read once at start-up
and served from memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import logging
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..attention_plot import AttentionPlotError, attention_for
from ..config import ConfigError, DecodingConfig
from .batching import RequestBatcher

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
PAGE_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
              "/static/explorer.js": ("explorer.js", "text/javascript; charset=utf-8"),
              "/static/style.css": ("style.css", "text/css; charset=utf-8")}


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


class RequestError(Exception):
    """A request the server refuses: HTTP status, the field at fault and why."""

    def __init__(self, status: int, field: Optional[str], message: str) -> None:
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


SEARCH_OPTIONS = ("n_best", "beam_size", "length_penalty", "min_len", "max_len_a", "max_len_b", "no_repeat_ngram_size",
                  "max_repeat", "sampling", "top_k", "top_p", "temperature", "seed", "copy_unknown")
"""The decoding options a request may set (the others are the server's: batch sizes)."""


class DecodingRequest(BaseModel):
    """Decoding options of `transformer translate`; unset ones take the checkpoint's decoding section."""

    model_config = ConfigDict(extra="forbid", strict=True)
    beam_size: Optional[int] = Field(None, description="1 is greedy decoding")
    length_penalty: Optional[float] = Field(None, description="α of the length penalty ((5+|Y|)/6)^α")
    min_len: Optional[int] = Field(None, description="tokens that must come before eos may be produced")
    max_len_a: Optional[float] = Field(None, description="output cap: max_len_a * src_len + max_len_b tokens")
    max_len_b: Optional[int] = None


class TranslateRequest(DecodingRequest):
    text: list[str] = Field(description="a list of sentences (or one sentence as a string)")
    n_best: Optional[int] = Field(None, description="also return this many hypotheses per sentence, with scores "
                                  "(with sampling: this many samples)")
    no_repeat_ngram_size: Optional[int] = Field(None, description="no output repeats an n-gram of this many pieces")
    max_repeat: Optional[int] = Field(None, description="no output has one piece more than this many times in a row "
                                      "(0: no limit)")
    sampling: Optional[bool] = Field(None, description="draw each token at random (beam size 1)")
    top_k: Optional[int] = Field(None, description="with sampling: among the k most probable tokens (0: all)")
    top_p: Optional[float] = Field(None, description="with sampling: from the nucleus of this probability")
    temperature: Optional[float] = Field(None, description="with sampling: divide the logits by this")
    seed: Optional[int] = Field(None, description="with sampling: same seed and sentence, same samples")
    copy_unknown: Optional[bool] = Field(None, description="copy text the vocabulary lacks (emoji, other scripts) "
                                         "through untranslated (default true); false: the model sees it as unk")
    prefix: Optional[list[str]] = Field(None, description="per sentence, a target prefix the translation starts "
                                        "with (\"\": none); one string for one sentence")

    alignment: Optional[bool] = Field(None, description="also return each translation's word alignment")

    @field_validator("prefix", mode="before")
    @classmethod
    def one_prefix_is_a_list_of_one(cls, prefix: Any) -> Any:
        return [prefix] if isinstance(prefix, str) else prefix

    @field_validator("text", mode="before")
    @classmethod
    def one_sentence_is_a_list_of_one(cls, text: Any) -> Any:
        return [text] if isinstance(text, str) else text


class AttentionRequest(DecodingRequest):
    text: str = Field(description="one sentence")


class Hypothesis(BaseModel):
    text: str
    score: float = Field(description="log-probability with the length penalty of the beam search")


class TranslateResponse(BaseModel):
    translations: list[str] = Field(description="one per input sentence, in input order")
    n_best: Optional[list[list[Hypothesis]]] = Field(None, description="when n_best was asked for: per sentence, "
                                                     "distinct texts first, best first")
    alignments: Optional[list[list[list[int]]]] = Field(None, description="when alignment was asked for: per "
                                                        "sentence, [source word, target word] pairs")
    beam_size: int
    elapsed_ms: float


def create_app(translator: Any, checkpoint: str = "", limits: Optional[ServeLimits] = None,
               max_batch_sentences: Optional[int] = None, max_wait_ms: float = 5.0) -> FastAPI:
    """The application around one loaded translator.

    Args:
        translator: a `Translator` (every endpoint) or a `CTranslate2Translator` (no /attention: 501).
        checkpoint: what /health reports as the model's origin.
        limits: per-request limits (default: `ServeLimits()`).
        max_batch_sentences: sentences collected into one decoding call (default: the checkpoint's
            decoding.batch_size).
        max_wait_ms: how long the batcher keeps collecting after the first waiting request (milliseconds).
    """
    limits = limits or ServeLimits()
    batcher = RequestBatcher(
        lambda sentences, options: translator.translate_n_best(
            sentences, **{key: getattr(options, key) for key in SEARCH_OPTIONS}),
        max_batch_sentences=max_batch_sentences or translator.config.decoding.batch_size, max_wait_ms=max_wait_ms)
    page = {route: ((STATIC / name).read_bytes(), media) for route, (name, media) in PAGE_FILES.items()}
    started = time.time()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="transformer-nmt", version="0.1.0", lifespan=lifespan,
                  description="Translate with a Transformer trained by transformer-nmt, and see its attention.")
    app.state.batcher = batcher
    _add_error_handlers(app)
    app.add_middleware(_BodyLimits, limits=limits)

    def options_for(body: DecodingRequest, n_best: Optional[int] = None) -> DecodingConfig:
        if body.beam_size is not None and not 1 <= body.beam_size <= limits.max_beam_size:
            raise RequestError(422, "beam_size", f"must be between 1 and {limits.max_beam_size} "
                               f"(serve --max-beam-size), got {body.beam_size}")
        if getattr(body, "sampling", None) and n_best is not None and not 1 <= n_best <= limits.max_beam_size:
            raise RequestError(422, "n_best", f"samples must be between 1 and {limits.max_beam_size} "
                               f"(serve --max-beam-size), got {n_best}")
        given = {key: getattr(body, key, None) for key in SEARCH_OPTIONS if key != "n_best"}
        try:
            return translator.decoding_options(n_best=n_best, **given)
        except ConfigError as err:  # "decoding.n_best: must be ..." -> field n_best
            key, _, message = str(err).partition(": ")
            raise RequestError(422, key.removeprefix("decoding."), message) from None

    def sentences_of(sentences: list[str], one: bool = False) -> list[str]:
        if not sentences:
            raise RequestError(422, "text", "no sentences: give a string or a non-empty list of strings")
        if len(sentences) > limits.max_sentences:
            raise RequestError(422, "text", f"at most {limits.max_sentences} sentences per request "
                               f"(serve --max-sentences), got {len(sentences)}")
        if not any(sentence.strip() for sentence in sentences):  # in a list, an empty one gets an empty translation
            raise RequestError(422, "text", "empty sentence" if one or len(sentences) == 1 else
                               "nothing to translate: every sentence is empty")
        for i, sentence in enumerate(sentences):
            where = "text" if one else f"text[{i}]"
            if len(sentence) > limits.max_chars:
                raise RequestError(422, where, f"{len(sentence)} characters; at most {limits.max_chars} "
                                   "(serve --max-chars)")
            _check_encodable(sentence, where)
        return sentences

    @app.post("/translate", response_model=TranslateResponse, response_model_exclude_none=True)
    async def translate(body: TranslateRequest, request: Request) -> dict:
        """Translate sentences (batched with concurrent requests); the n best with scores if n_best is given."""
        start = time.perf_counter()
        sentences = sentences_of(body.text)
        options = options_for(body, n_best=body.n_best)
        if body.prefix is None:
            results = await _unless_disconnected(request, batcher.translate(sentences, options))
        elif len(body.prefix) != len(sentences):
            raise RequestError(422, "prefix", f"one prefix per sentence ({len(sentences)}), got {len(body.prefix)}")
        else:  # prefixes are per sentence: this request is decoded on its own
            for i, prefix in enumerate(body.prefix):
                _check_encodable(prefix, f"prefix[{i}]")
            search = {key: getattr(options, key) for key in SEARCH_OPTIONS}
            results = await _unless_disconnected(request, batcher.run_on_worker(lambda: translator.translate_n_best(
                sentences, prefixes=body.prefix, **search)))
            batcher.count(1, len(sentences))
        response: dict[str, Any] = {"translations": [hyps[0][0] for hyps in results], "beam_size": options.beam_size}
        if body.alignment:
            if not _is_pytorch(translator):
                raise RequestError(501, "alignment", "alignments need a PyTorch checkpoint (.pt); this server runs "
                                   "an exported CTranslate2 model")
            pairs = await batcher.run_on_worker(translator.align, sentences, response["translations"])
            response["alignments"] = [[list(pair) for pair in sentence] for sentence in pairs]
        if body.n_best is not None:
            response["n_best"] = [[{"text": text, "score": score} for text, score in hyps] for hyps in results]
        response["elapsed_ms"] = round((time.perf_counter() - start) * 1000, 2)
        return response

    @app.post("/attention")
    async def attention(body: AttentionRequest) -> dict:
        """Translate one sentence and return every attention weight (`transformer attention --format json`)."""
        if not _is_pytorch(translator):
            raise RequestError(501, None, "attention needs a PyTorch checkpoint (.pt); this server runs an "
                               "exported CTranslate2 model")
        sentence = sentences_of([body.text], one=True)[0]
        options = options_for(body, n_best=1)
        try:
            return await batcher.run_on_worker(attention_for, translator, sentence, options)
        except AttentionPlotError as err:
            raise RequestError(422, "text", str(err)) from None

    @app.get("/health")
    async def health() -> dict:
        """Model, vocabulary, device, uptime (seconds), limits and batching counts."""
        return {"status": "ok", **_describe(translator, checkpoint), "uptime_s": round(time.time() - started, 1),
                "limits": asdict(limits), "decoding": asdict(translator.config.decoding),
                "batching": {"max_batch_sentences": batcher.max_batch_sentences, "max_wait_ms": batcher.max_wait_ms,
                             **batcher.stats.to_dict()}}

    for route, (content, media) in page.items():
        app.add_api_route(route, _static_page(content, media), methods=["GET"], include_in_schema=False,
                          response_class=HTMLResponse if route == "/" else Response)
    return app


class ClientGone(Exception):
    """The client of a request closed its connection before the answer was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """The result of `work`, or, if the client disconnects first, `work` cancelled (sentences still waiting in the
    batcher are then not decoded) and `ClientGone` raised."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server gave up on the request (shutdown): so does the batcher
        task.cancel()
        raise
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error(status: int, problems: list[tuple[Optional[str], str]]) -> JSONResponse:
    """The JSON form of every refusal: the first problem's message and field, and all of them."""
    return JSONResponse({"error": problems[0][1], "field": problems[0][0],
                         "errors": [{"field": f, "message": m} for f, m in problems]}, status_code=status)


class _BodyLimits:
    """ASGI middleware for a request's body: refused from its Content-Length before it is read (411 for a POST
    without one, 413 over `limits.max_request_bytes`); 408 if it has not arrived `limits.request_timeout_s` seconds
    after the app started reading it (0: no limit). After the body, reading goes on unbounded (the disconnect watch
    of `_unless_disconnected`)."""

    def __init__(self, app: Any, limits: ServeLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limits = self.limits
        length = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1") or None
        if scope["method"] == "POST" and length is None:
            return await _error(411, [("body", "a Content-Length header is required")])(scope, receive, send)
        if length is not None and (not length.isdigit() or int(length) > limits.max_request_bytes):
            return await _error(413, [("body", f"request body of {length} bytes; at most {limits.max_request_bytes} "
                                       "(serve --max-request-bytes)")])(scope, receive, send)
        if not limits.request_timeout_s:
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline, body_read = loop.time() + limits.request_timeout_s, False

        async def timed_receive() -> dict:
            nonlocal body_read
            if body_read:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the body did not arrive within {limits.request_timeout_s:g} s (serve "
                                         "--request-timeout)") from None
            body_read = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


def _static_page(content: bytes, media_type: str):
    async def serve_file() -> Response:
        return Response(content, media_type=media_type)
    return serve_file


def _is_pytorch(translator: Any) -> bool:
    """True for our own model (a `Translator`), False for an exported CTranslate2 one."""
    return hasattr(getattr(translator, "model", None), "forward_with_attention")


def _describe(translator: Any, checkpoint: str) -> dict:
    config = translator.config
    is_torch = _is_pytorch(translator)
    tokenizer = translator.tokenizer
    return {
        "model": {"checkpoint": " ".join(Path(c).name for c in checkpoint.split(" ")),
                  "engine": "pytorch" if is_torch else "ctranslate2",
                  **{k: getattr(config.model, k) for k in ("d_model", "n_heads", "d_ff", "n_encoder_layers",
                                                             "n_decoder_layers", "max_positions", "norm_first")},
                  "parameters": translator.num_parameters if is_torch else None,
                  "quantization": translator.quantization if is_torch else None,
                  "compile": bool(getattr(translator, "compile", False))},
        "vocabulary": {"src_lang": config.data.src_lang, "tgt_lang": config.data.tgt_lang,
                       "src_size": tokenizer.src_vocab_size, "tgt_size": tokenizer.tgt_vocab_size,
                       "joint": tokenizer.is_joint},
        "device": str(getattr(translator, "device", "cpu")),
    }


def _check_encodable(text: str, where: str) -> None:
    """Refuse text that is not Unicode text (a lone surrogate such as "\\ud83d", which JSON can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(422, where, f"not valid text: a lone surrogate U+{ord(text[err.start]):04X} at character "
                           f"{err.start} (send whole characters: a surrogate pair or the character itself)") from None


def _field(location: tuple) -> Optional[str]:
    """("body", "text", 3) -> "text[3]"; the body itself -> "body"."""
    parts = [p for p in location if p != "body"]
    if not parts or isinstance(parts[0], int):
        return "body"
    return str(parts[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts[1:])


def _add_error_handlers(app: FastAPI) -> None:

    @app.exception_handler(RequestError)
    async def refused(_: Request, err: RequestError) -> JSONResponse:
        return _error(err.status, [(err.field, err.message)])

    @app.exception_handler(ClientGone)
    async def gone(_: Request, err: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the access log's record that the client left

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        """The framework's own refusals, in the same form: a body it cannot parse or that did not arrive in time
        (408), an unknown path or method."""
        if err.status_code == 400:  # the body is not UTF-8, or nested too deep to parse
            return _error(400, [("body", "the body cannot be parsed: send a JSON object encoded as UTF-8")])
        field = {404: "path", 405: "method"}.get(err.status_code, "body")
        return _error(err.status_code, [(field, str(err.detail))])

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception) -> JSONResponse:
        """A fault of the server, never of the request: logged with its traceback, answered as JSON."""
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(500, [(None, f"internal error ({type(err).__name__}); the server log has the details")])

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        for e in err.errors():
            if e["type"] == "json_invalid":
                return _error(400, [("body", f"invalid JSON: {e.get('ctx', {}).get('error', e['msg'])}")])
            field = _field(tuple(e["loc"]))
            message = "unknown option" if e["type"] == "extra_forbidden" else e["msg"]
            if e["type"] == "extra_forbidden":
                model = AttentionRequest if request.url.path.rstrip("/").endswith("attention") else TranslateRequest
                close = difflib.get_close_matches(str(e["loc"][-1]), list(model.model_fields), n=1)
                message += f"; did you mean {close[0]}?" if close else ""
            if tuple(e["loc"]) == ("body",) and "json" not in request.headers.get("content-type", ""):
                message += " (send the JSON object with the header Content-Type: application/json)"
            elif field == "text" and e["type"] == "list_type":
                message = "expected a sentence (a string) or a list of sentences"
            problems.append((field, message))
        return _error(422, problems)
