"""Start the server: load the model once, build the app, run uvicorn."""

from __future__ import annotations

import socket
import sys
from typing import Optional

import torch
import uvicorn

from ..config import ConfigError
from ..ct2 import open_translator
from .app import ServeLimits, create_app


def run_server(checkpoint: str | list[str], host: str = "127.0.0.1", port: int = 8000, device: str = "cpu",
               threads: int = 0,
               limits: Optional[ServeLimits] = None, max_batch_sentences: int = 0, max_wait_ms: float = 5.0,
               access_log: bool = True, quantization: Optional[str] = None,
               compile: bool = False) -> None:
    """Load `checkpoint` (a .pt file or an exported CTranslate2 folder) and serve it until interrupted.

    Args:
        host: interface to bind; 127.0.0.1 (the default) is reachable from this machine only.
        port: TCP port.
        device: where to decode (cpu, cuda, cuda:N, mps, auto).
        threads: torch CPU threads (0: torch's default, one per core).
        limits: per-request limits (default: `ServeLimits()`).
        max_batch_sentences: sentences collected into one decoding call (0: the checkpoint's decoding.batch_size).
        max_wait_ms: how long to collect concurrent requests after the first (milliseconds).
        access_log: log one line per request (uvicorn's access log).
        quantization: None or "int8" (see `Translator`).
        compile: decode with the compiled step (`Translator(..., compile=True)`), compiled before the server starts
            answering (`Translator.warm_up`, 20-60 s), so that no request waits for it.

    Raises:
        CheckpointError, DeviceError: the model cannot be loaded.
        ConfigError: the address cannot be listened on (port in use, host not an address of this machine), checked
            before the model is loaded.
    """
    listening = _listen(host, port)
    try:
        if threads > 0:
            torch.set_num_threads(threads)
        translator = open_translator(checkpoint, device=device, quantization=quantization, compile=compile)
        if compile:
            print("compiling the decoding step for greedy and beam search (about 20-60 s each) ...", file=sys.stderr,
                  flush=True)
            print(f"compiled in {translator.warm_up():.1f} s", file=sys.stderr, flush=True)
        checkpoint = " ".join(checkpoint) if isinstance(checkpoint, list) else checkpoint
        app = create_app(translator, checkpoint=checkpoint, limits=limits or ServeLimits(),
                         max_batch_sentences=max_batch_sentences or None, max_wait_ms=max_wait_ms)
        print(f"serving {checkpoint} on http://{host}:{port} (page at /, API: POST /translate, POST /attention, "
              "GET /health)", file=sys.stderr, flush=True)
        config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=access_log)
        uvicorn.Server(config).run(sockets=[listening])
    finally:
        listening.close()


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), for uvicorn to serve on; ConfigError, saying why, if that fails."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        listening = socket.socket(family, kind, proto)
    except OSError as err:
        raise ConfigError(f"--host {host}: not an address to listen on ({err.strerror or err})") from None
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart without waiting
        listening.bind(address)
    except OSError as err:
        listening.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror or err} (another server on that port? "
                          "choose another --port)") from None
    return listening
