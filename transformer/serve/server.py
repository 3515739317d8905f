"""Start the server: load the model once, build the app, run uvicorn with its h11 protocol adapted (`_Protocol`):
a deadline for a request's headers, malformed requests answered in the JSON form of every refusal, and a shutdown
that closes at once the connections with no request in flight."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from typing import Any, Optional

import h11
import torch
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from ..config import ConfigError
from ..translate import Translator
from .app import create_app, error_body
from .service import ServeSettings


def run_server(settings: ServeSettings) -> None:
    """Load `settings.checkpoints` (`Translator.from_checkpoint`: a .pt file, a MarianMT folder, an exported
    CTranslate2 folder, or several paths: an ensemble) and serve it until interrupted, as `settings` says.

    A connection whose request headers are not complete `limits.request_timeout_s` seconds after it opened (or after
    its previous answer) is closed. A request that is not valid HTTP/1.1 (a malformed request line or header, such
    as `Content-Length: abc`) gets 400 in the JSON form of every refusal, `"field": "headers"`, and its connection
    is closed. On SIGTERM the server shuts down (`ServeSettings.shutdown_timeout_s`) and returns (exit status 0); a
    second Ctrl-C or SIGTERM during that drain ends the process at once (exit status 130), as uvicorn's own servers
    end on a second Ctrl-C, without waiting for the decoding call in flight.

    Raises:
        CheckpointError, DeviceError, OptionError: the model cannot be loaded as asked.
        ConfigError: the address cannot be listened on (port in use, host not an address of this machine), checked
            before the model is loaded.
    """
    listening = _listen(settings.host, settings.port)
    try:
        if settings.threads > 0:
            torch.set_num_threads(settings.threads)
        translator = Translator.from_checkpoint(
            list(settings.checkpoints),
            device=settings.device,
            quantization=settings.quantization,
            compile=settings.compile,
        )
        if settings.compile:
            print(
                "compiling the decoding step for greedy and beam search (about 20-60 s each) ...",
                file=sys.stderr,
                flush=True,
            )
            print(f"compiled in {translator.warm_up():.1f} s", file=sys.stderr, flush=True)
        app = create_app(
            translator,
            checkpoints=settings.checkpoints,
            limits=settings.limits,
            max_batch_sentences=settings.max_batch_sentences or None,
            max_wait_ms=settings.max_wait_ms,
        )
        print(
            f"serving {' '.join(settings.checkpoints)} on http://{settings.host}:{settings.port} (page at /, API: "
            "POST /translate, POST /attention, GET /health)",
            file=sys.stderr,
            flush=True,
        )
        protocol = type(
            "H11Serve", (_Protocol,), {"header_timeout_s": settings.limits.request_timeout_s}
        )
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level="info",
            access_log=settings.access_log,
            http=protocol,
            timeout_graceful_shutdown=settings.shutdown_timeout_s,
        )
        # uvicorn re-raises the signal that stopped it once it has shut down: a SIGTERM handled by a handler that
        # does nothing lets the command end normally (exit status 0), as a service manager expects
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        server = _Server(config)
        try:
            server.run(sockets=[listening])
        except KeyboardInterrupt:  # uvicorn raises a Ctrl-C again once it has stopped
            if not server.force_exit:
                raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        if server.force_exit:  # a second signal: the decoding thread is not waited for either
            print(
                "serve: stopped at once (a second Ctrl-C or SIGTERM)", file=sys.stderr, flush=True
            )
            sys.stdout.flush()
            os._exit(130)
    finally:
        listening.close()


class _Server(uvicorn.Server):
    """uvicorn's server, where a second SIGTERM, like a second Ctrl-C, forces the exit: the first starts the drain
    (`ServeSettings.shutdown_timeout_s`), the second ends the process at once, the decoding call in flight too."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self.force_exit = True
        super().handle_exit(sig, frame)


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol (one instance per connection) with three changes:

    - a connection whose request line and headers are not complete `header_timeout_s` seconds after it opened or
      after its previous answer (a client that stalls or trickles its headers) is closed (0: no deadline);
    - a request h11 cannot parse gets its 400 (or h11's status hint) as JSON, in the form of every other refusal
      (`app.error_body`, `"field": "headers"`), where uvicorn answers plain text;
    - at shutdown, a connection with no request in flight is closed at once, also one whose request's body is still
      arriving (nothing is decoded before the whole body is there); uvicorn waits for such a one until the
      drain deadline. A request whose body has arrived is answered, then its connection is closed.
    """

    header_timeout_s: float = 30.0
    _deadline: Optional[asyncio.TimerHandle] = (
        None  # the pending close, while a request's headers are awaited
    )
    _waiting_after: Any = (
        None  # the request cycle current when it was armed (a new request makes a new one)
    )

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown of this connection (called once, when the server starts shutting down)."""
        cycle = self.cycle
        if (
            cycle is not None
            and cycle.more_body
            and not cycle.response_started
            and not self.transport.is_closing()
        ):
            self.transport.close()  # its body has not all arrived: not in flight (the app reads a disconnect)
            return
        super().shutdown()  # idle: closed; a request in flight: answered, then closed

    def send_400_response(self, msg: str) -> None:
        """The answer to a request h11 cannot parse (uvicorn has logged "Invalid HTTP request received."). uvicorn
        calls it while it handles h11's RemoteProtocolError, which says what is wrong ("bad Content-Length", ...)
        and which status fits (400, or 431 for headers too large)."""
        err = sys.exc_info()[1]
        detail = str(err) if isinstance(err, h11.RemoteProtocolError) and str(err) else msg
        status = err.error_status_hint if isinstance(err, h11.RemoteProtocolError) else 400
        body = json.dumps(
            error_body([("headers", f"not a valid HTTP/1.1 request: {detail}")])
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        if not self.header_timeout_s:
            return
        self._waiting_after = self.cycle
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.cycle is self._waiting_after and not self.transport.is_closing():
            self.transport.close()


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), for uvicorn to serve on; ConfigError, saying why, if that fails."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listening = socket.socket(family, kind, proto)
    except OSError as err:
        raise ConfigError(
            f"--host {host}: not an address to listen on ({err.strerror or err})"
        ) from None
    try:
        listening.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as uvicorn does: restart without waiting
        listening.bind(address)
    except OSError as err:
        listening.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {err.strerror or err} (another server on that port? "
            "choose another --port)"
        ) from None
    return listening
