"""Start the server: load the model once, build the app, run uvicorn."""

from __future__ import annotations

import sys
from typing import Optional

import torch
import uvicorn

from ..ct2 import open_translator
from .app import ServeLimits, create_app


def run_server(checkpoint: str, host: str = "127.0.0.1", port: int = 8000, device: str = "cpu", threads: int = 0,
               limits: Optional[ServeLimits] = None, max_batch_sentences: int = 0, max_wait_ms: float = 5.0,
               access_log: bool = True, quantization: Optional[str] = None) -> None:
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

    Raises:
        CheckpointError, DeviceError: the model cannot be loaded.
    """
    if threads > 0:
        torch.set_num_threads(threads)
    translator = open_translator(checkpoint, device=device, quantization=quantization)
    app = create_app(translator, checkpoint=checkpoint, limits=limits or ServeLimits(),
                     max_batch_sentences=max_batch_sentences or None, max_wait_ms=max_wait_ms)
    print(f"serving {checkpoint} on http://{host}:{port} (page at /, API: POST /translate, POST /attention, "
          "GET /health)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=access_log)
