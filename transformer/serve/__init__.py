"""`transformer serve`: an HTTP API (FastAPI, served by uvicorn) and an attention explorer page for one model.

    pip install 'transformer-nmt[serve]'
    transformer serve --checkpoint runs/multi30k_de_en/checkpoints/best.pt     # http://127.0.0.1:8000

`service.py` holds what the server does (`TranslationService`: validation, translation, attention, health; no web
framework), `batching.py` the request batching, `app.py` the FastAPI routes that adapt the service, `server.py` the
uvicorn process, `static/` the page. The names below are imported on first use, so that the service imports
without FastAPI installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_imports import lazy_exports

__all__ = [
    "RequestBatcher",
    "RequestError",
    "ServeLimits",
    "ServeSettings",
    "TranslationService",
    "create_app",
    "run_server",
]

_HOMES = {
    "RequestBatcher": ".batching",
    "RequestError": ".service",
    "ServeLimits": ".service",
    "ServeSettings": ".service",
    "TranslationService": ".service",
    "create_app": ".app",
    "run_server": ".server",
}

if TYPE_CHECKING:
    from .app import create_app
    from .batching import RequestBatcher
    from .server import run_server
    from .service import RequestError, ServeLimits, ServeSettings, TranslationService

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
