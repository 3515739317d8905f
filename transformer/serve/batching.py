"""Dynamic batching for the server: concurrent requests share one decoding call.

A request's sentences wait in a queue; one asyncio task takes the first waiting request, keeps collecting for up to
`max_wait_ms` milliseconds (or until `max_batch_sentences` sentences are waiting), and decodes everything it holds
with one decoding call per set of options. Each request comes resolved (`request.TranslationRequest`: its texts,
source ids, target prefixes and options checked where it entered); a call decodes the requests that share options
joined into one (`TranslationRequest.join`): a request with target prefixes carries them into the shared call, the
others none. Decoding runs on one worker thread,
so the event loop keeps answering (health checks, new requests) while the model works, and requests that arrive
during a decode are all taken together by the next one: the busier the server, the larger its batches (the batching
of serving systems such as TensorFlow Serving and CTranslate2's asynchronous translate).

A request whose future is done before its turn (its client went away: the web layer cancels it) is not decoded; a
decoding call whose every request is done while it runs stops before its next batch of sentences (the decode
function is given a `should_stop` check).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from ..request import ResolvedOptions, TranslationRequest
from ..translate import DecodingStopped

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Translated:
    """One sentence's result of a decoding call."""

    n_best: list[tuple[str, float]]
    """The n best (text, score) pairs, best first."""
    truncated: bool = False
    """The sentence was longer than the engine's max_source_len: only its start was translated."""
    finished: list[bool] = field(default_factory=list)
    """Per hypothesis of `n_best`, whether it ended with eos (False: cut at the length cap)."""


Decode = Callable[[TranslationRequest, Callable[[], bool]], list[Translated]]
"""`(request, should_stop) -> one Translated per sentence`: a decoding call, on the worker thread. `should_stop()`
becomes True once every request of the call is gone; the function may then raise `translate.DecodingStopped`
(`Translator.run(..., should_stop=...)` does, before its next batch)."""

T = TypeVar("T")


@dataclass
class _Request:
    request: TranslationRequest
    future: asyncio.Future


@dataclass
class BatchingStats:
    """Counts since start: requests and sentences translated, and decoding calls that served them."""

    requests: int = 0
    sentences: int = 0
    batches: int = 0
    largest_batch_sentences: int = 0
    largest_batch_requests: int = 0
    abandoned_requests: int = 0
    """Requests whose client disconnected before their turn: not decoded."""
    cancelled_requests: int = 0
    """Requests whose client disconnected during their decoding call, when every request of that call had gone: the
    call stopped before its next batch of sentences (not counted in requests, sentences or batches)."""

    def to_dict(self) -> dict[str, float]:
        d: dict[str, float] = dataclasses.asdict(self)
        d["mean_batch_sentences"] = round(self.sentences / self.batches, 2) if self.batches else 0.0
        d["mean_batch_requests"] = round(self.requests / self.batches, 2) if self.batches else 0.0
        return d


@dataclass
class RequestBatcher:
    """Collects the sentences of concurrent requests into shared decoding calls.

    Args:
        translate_n_best: the decoding call (`Decode`), called on the worker thread only (so the model is never
            used by two threads at once).
        max_batch_sentences: stop collecting once this many sentences wait (a request is never split).
        max_wait_ms: how long (milliseconds) to keep collecting after the first waiting request.
    """

    translate_n_best: Decode
    max_batch_sentences: int = 64
    max_wait_ms: float = 5.0
    stats: BatchingStats = field(default_factory=BatchingStats)
    _queue: Optional[asyncio.Queue] = field(default=None, init=False, repr=False)
    _task: Optional[asyncio.Task] = field(default=None, init=False, repr=False)
    _worker: Optional[ThreadPoolExecutor] = field(default=None, init=False, repr=False)

    def start(self) -> None:
        """Start collecting (in the running event loop) with a fresh worker thread."""
        self._queue = asyncio.Queue()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop collecting; requests still waiting get a `RuntimeError`."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while self._queue is not None and not self._queue.empty():
            request = self._queue.get_nowait()
            if not request.future.done():
                request.future.set_exception(RuntimeError("the server is shutting down"))
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self._task = self._worker = None

    @property
    def n_waiting(self) -> int:
        """Requests queued and not yet taken by a decoding call."""
        return self._queue.qsize() if self._queue is not None else 0

    async def translate(self, request: TranslationRequest) -> list[Translated]:
        """Queue a resolved request for the next decoding call and wait for its results (in input order); requests
        with equal options share a call. Cancelling the waiting caller (a client that went away) takes the request
        out: not decoded if its turn has not come, and its decoding call stopped before its next batch if every
        request of that call is gone.

        Raises:
            RuntimeError: the batcher is not started, or stops before the request is served.
            Whatever `translate_n_best` raises for this request's batch.
        """
        if self._queue is None or self._task is None:
            raise RuntimeError("RequestBatcher.start() was not called")
        waiting = _Request(request, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(waiting)
        return await waiting.future

    async def run_on_worker(self, function: Callable[..., T], *args: Any) -> T:
        """Run `function(*args)` on the decoding thread, after the decoding calls already given to it (work that uses
        the model outside the batches: alignments, attention weights)."""
        if self._worker is None:
            raise RuntimeError("RequestBatcher.start() was not called")
        return await asyncio.get_running_loop().run_in_executor(self._worker, function, *args)

    def _count(self, n_requests: int, n_sentences: int) -> None:
        """Count one decoding call of `n_requests` requests and `n_sentences` sentences in `stats`."""
        self.stats.requests += n_requests
        self.stats.sentences += n_sentences
        self.stats.batches += 1
        self.stats.largest_batch_sentences = max(self.stats.largest_batch_sentences, n_sentences)
        self.stats.largest_batch_requests = max(self.stats.largest_batch_requests, n_requests)

    async def _collect(self) -> list[_Request]:
        """The first waiting request and those that arrive within max_wait_ms, up to max_batch_sentences."""
        assert self._queue is not None
        requests = [await self._queue.get()]
        n_sentences = len(requests[0].request)
        deadline = asyncio.get_running_loop().time() + self.max_wait_ms / 1000
        while n_sentences < self.max_batch_sentences:
            if self._queue.empty():
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    request = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            else:
                request = self._queue.get_nowait()
            requests.append(request)
            n_sentences += len(request.request)
        return requests

    async def _run(self) -> None:
        while True:
            requests = await self._collect()
            by_options: dict[ResolvedOptions, list[_Request]] = defaultdict(list)
            for request in requests:
                by_options[request.request.options].append(request)
            for group in by_options.values():
                await self._decode(group)

    async def _decode(self, group: list[_Request]) -> None:
        waiting = [request for request in group if not request.future.done()]  # done: client gone
        if len(waiting) < len(group):
            log.info(
                "%d request(s) not decoded: their clients went away before their turn",
                len(group) - len(waiting),
            )
        self.stats.abandoned_requests += len(group) - len(waiting)
        group = waiting
        if not group:
            return
        joined = TranslationRequest.join([request.request for request in group])
        all_gone = _all_done(request.future for request in group)
        try:
            results = await self.run_on_worker(self.translate_n_best, joined, all_gone.is_set)
        except DecodingStopped:
            # every client of the call went away: their futures are cancelled already
            log.info(
                "a decoding call of %d request(s) stopped: every client went away while it decoded",
                len(group),
            )
            self.stats.cancelled_requests += len(group)
            return
        except Exception as err:  # noqa: BLE001 - handed to the requests that asked, the loop keeps serving
            for request in group:
                if not request.future.done():
                    request.future.set_exception(err)
            return
        self._count(len(group), len(joined))
        start = 0
        for request in group:
            n = len(request.request)
            # a client that went away during the decode leaves a cancelled future
            if not request.future.done():
                request.future.set_result(results[start : start + n])
            start += n


def _all_done(futures: Any) -> threading.Event:
    """An event set (in the event loop) once every one of `futures` is done; `is_set` may be read from any
    thread."""
    event, pending = threading.Event(), list(futures)
    left = len(pending)

    def one_done(_: asyncio.Future) -> None:
        nonlocal left
        left -= 1
        if left == 0:
            event.set()

    for future in pending:
        future.add_done_callback(one_done)
    return event
