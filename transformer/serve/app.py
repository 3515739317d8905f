"""The HTTP API and the page: `create_app(translator)` builds a FastAPI application around one loaded model.

    POST /translate   {"text": ["Ein Mann fährt Fahrrad.", ...], "beam_size": 4, "n_best": 2, ...}
                      -> {"translations": [...], "truncated": [false, ...],
                          "n_best": [[{"text": ..., "score": ...}, ...], ...]}
    POST /attention   {"text": "Ein Mann fährt Fahrrad."}
                      -> the `transformer attention --format json` data (see `attention_plot`), "truncated" included
    GET  /health      model, vocabulary, device, uptime, limits and batching counts
    GET  /            the attention explorer (static HTML, CSS and JavaScript from `static/`, no CDN)

Each route adapts `service.TranslationService`, which holds the validation and the work: the request models
here check the JSON's types (their decoding fields are made from `DecodingConfig`'s fields), the service the rest.
Bad input gets a 4xx response whose JSON names the field: `{"error": message, "field": "beam_size", "errors":
[{"field": ..., "message": ...}, ...]}`; the server's HTTP layer answers malformed requests in the same form
(`server.py`). A sentence longer than the model reads (its max_source_len tokens) is not refused: its start is
translated and its entry of "truncated" is true. Requests never name files: the page's three files are read once
at start-up and served from memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import logging
import typing
from collections.abc import AsyncIterator, Awaitable, Sequence
from pathlib import Path
from typing import Any, Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import DecodingConfig
from ..translate import Translator
from .service import (
    ATTENTION_OPTIONS,
    TRANSLATE_OPTIONS,
    RequestError,
    ServeLimits,
    TranslationService,
)

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/explorer.js": ("explorer.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}


class _TranslateText(BaseModel):
    """The fields of a /translate request but its decoding options. Strict, as every request model: a wrong type is
    refused, not converted (a JSON integer is taken for a float, nothing else)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: list[str] = Field(description="a list of sentences (or one sentence as a string)")
    prefix: Optional[list[str]] = Field(
        None,
        description="per sentence, a target prefix the translation starts "
        'with ("": none); one string for one sentence',
    )
    alignment: Optional[bool] = Field(
        None, description="also return each translation's word alignment"
    )

    @field_validator("text", "prefix", mode="before")
    @classmethod
    def one_is_a_list_of_one(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class _AttentionText(BaseModel):
    """The fields of an /attention request but its decoding options."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: str = Field(description="one sentence")


def _with_options(
    name: str, doc: str, base: type[BaseModel], options: list[dataclasses.Field]
) -> type[BaseModel]:
    """The model `name`: `base` and a field per decoding option (a `DecodingConfig` field), of the option's type or
    null (unset: the checkpoint's default), described by the option's help."""
    types = typing.get_type_hints(DecodingConfig)
    fields: dict[str, Any] = {
        f.name: (Optional[types[f.name]], Field(None, description=f.metadata["help"]))
        for f in options
    }
    return create_model(name, __base__=base, __module__=__name__, __doc__=doc, **fields)


TranslateRequest = _with_options(
    "TranslateRequest",
    "Sentences to translate, and decoding options of `transformer "
    "translate` (but the batch sizes); unset ones take the checkpoint's decoding section.",
    _TranslateText,
    TRANSLATE_OPTIONS,
)
AttentionRequest = _with_options(
    "AttentionRequest",
    "One sentence whose best translation's attention to return, "
    "and decoding options (those of /translate but n_best).",
    _AttentionText,
    ATTENTION_OPTIONS,
)


class Hypothesis(BaseModel):
    text: str
    score: float = Field(description="log-probability with the length penalty of the beam search")
    end: str = Field(
        description="eos: the hypothesis ended; cut: it was cut at the length cap (as translate's "
        "--n-best end column)"
    )


class TranslateResponse(BaseModel):
    translations: list[str] = Field(description="one per input sentence, in input order")
    truncated: list[bool] = Field(
        description="one per input sentence: true when the sentence was longer than the "
        "model reads (its max_positions tokens) and only its start was translated"
    )
    n_best: Optional[list[list[Hypothesis]]] = Field(
        None,
        description="when n_best was asked for: per sentence, distinct texts first, best first",
    )
    alignments: Optional[list[list[list[int]]]] = Field(
        None,
        description="when alignment was asked for: per sentence, [source word, target word] pairs",
    )
    beam_size: int
    elapsed_ms: float


def create_app(
    translator: Translator,
    checkpoints: Sequence[str] = (),
    limits: Optional[ServeLimits] = None,
    max_batch_sentences: Optional[int] = None,
    max_wait_ms: float = 5.0,
) -> FastAPI:
    """The application around one loaded translator: each route adapts a `TranslationService` (`app.state.service`).

    Args:
        translator, checkpoints, limits, max_batch_sentences, max_wait_ms: as `TranslationService`'s.
    """
    service = TranslationService(translator, checkpoints, limits, max_batch_sentences, max_wait_ms)
    app = FastAPI(
        title="transformer-nmt",
        version="0.1.0",
        lifespan=_running,
        description="Translate with a Transformer trained by transformer-nmt, and see its attention.",
    )
    app.state.service = service
    _add_error_handlers(app)
    app.add_middleware(_BodyLimits, limits=service.limits)

    @app.post("/translate", response_model=TranslateResponse, response_model_exclude_none=True)
    async def translate(body: TranslateRequest, request: Request) -> dict:
        """Translate sentences (batched with concurrent requests); the n best with scores if n_best is given."""
        work = service.translate(
            body.text, _options(body, TRANSLATE_OPTIONS), body.prefix, bool(body.alignment)
        )
        return await _unless_disconnected(request, work)

    @app.post("/attention")
    async def attention(body: AttentionRequest) -> dict:
        """Translate one sentence and return every attention weight (`transformer attention --format json`)."""
        return await service.attention(body.text, _options(body, ATTENTION_OPTIONS))

    @app.get("/health")
    async def health() -> dict:
        """Model, vocabulary, device, uptime (seconds), limits and batching counts."""
        return service.health()

    _add_page(app)
    return app


@contextlib.asynccontextmanager
async def _running(app: FastAPI) -> AsyncIterator[None]:
    """While the application serves, its service's batcher runs."""
    app.state.service.start()
    yield
    await app.state.service.stop()


def _options(body: BaseModel, options: list[dataclasses.Field]) -> dict[str, Any]:
    """The decoding options of a request body, by name (None: not given)."""
    return {f.name: getattr(body, f.name) for f in options}


def _add_page(app: FastAPI) -> None:
    """The attention explorer's files, read now and served from memory."""
    for route, (name, media) in PAGE_FILES.items():
        app.add_api_route(
            route,
            _static_page((STATIC / name).read_bytes(), media),
            methods=["GET"],
            include_in_schema=False,
            response_class=HTMLResponse if route == "/" else Response,
        )


class ClientGone(Exception):
    """The client of a request closed its connection before the answer was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """The result of `work`, or, if the client disconnects first, `work` cancelled and `ClientGone` raised: the
    batcher then does not decode sentences still waiting, and stops a running decoding call before its next batch
    when no other request shares it (`batching.py`). uvicorn reports the disconnect as soon as the connection
    closes, also while the decoding thread works (the event loop stays free)."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    # the server gave up on the request (shutdown): so does the batcher
    except asyncio.CancelledError:
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


def error_body(problems: list[tuple[Optional[str], str]]) -> dict[str, Any]:
    """The JSON form of every refusal, from (field, message) pairs: the first problem's message and field, and all
    of them."""
    return {
        "error": problems[0][1],
        "field": problems[0][0],
        "errors": [{"field": f, "message": m} for f, m in problems],
    }


def _error(status: int, problems: list[tuple[Optional[str], str]]) -> JSONResponse:
    """A refusal's answer: `error_body(problems)` with the HTTP status."""
    return JSONResponse(error_body(problems), status_code=status)


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
            return await _error(411, [("body", "a Content-Length header is required")])(
                scope, receive, send
            )
        if length is not None and (not length.isdigit() or int(length) > limits.max_request_bytes):
            return await _error(
                413,
                [
                    (
                        "body",
                        f"request body of {length} bytes; at most {limits.max_request_bytes} "
                        "(serve --max-request-bytes)",
                    )
                ],
            )(scope, receive, send)
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
                raise HTTPException(
                    408,
                    f"the body did not arrive within {limits.request_timeout_s:g} s (serve "
                    "--request-timeout)",
                ) from None
            body_read = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


def _static_page(content: bytes, media_type: str):
    async def serve_file() -> Response:
        return Response(content, media_type=media_type)

    return serve_file


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
        return Response(
            status_code=499
        )  # nobody reads it: the access log's record that the client left

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        """The framework's own refusals, in the same form: a body it cannot parse or that did not arrive in time
        (408), an unknown path or method."""
        if err.status_code == 400:  # the body is not UTF-8, or nested too deep to parse
            return _error(
                400, [("body", "the body cannot be parsed: send a JSON object encoded as UTF-8")]
            )
        field = {404: "path", 405: "method"}.get(err.status_code, "body")
        return _error(err.status_code, [(field, str(err.detail))])

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception) -> JSONResponse:
        """A fault of the server, never of the request: logged with its traceback, answered as JSON."""
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(
            500, [(None, f"internal error ({type(err).__name__}); the server log has the details")]
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        for e in err.errors():
            if e["type"] == "json_invalid":
                return _error(
                    400, [("body", f"invalid JSON: {e.get('ctx', {}).get('error', e['msg'])}")]
                )
            field = _field(tuple(e["loc"]))
            message = "unknown option" if e["type"] == "extra_forbidden" else e["msg"]
            if e["type"] == "extra_forbidden":
                model = (
                    AttentionRequest
                    if request.url.path.rstrip("/").endswith("attention")
                    else TranslateRequest
                )
                close = difflib.get_close_matches(str(e["loc"][-1]), list(model.model_fields), n=1)
                message += f"; did you mean {close[0]}?" if close else ""
            if tuple(e["loc"]) == ("body",) and "json" not in request.headers.get(
                "content-type", ""
            ):
                message += " (send the JSON object with the header Content-Type: application/json)"
            elif field == "text" and e["type"] == "list_type":
                message = "expected a sentence (a string) or a list of sentences"
            problems.append((field, message))
        return _error(422, problems)
