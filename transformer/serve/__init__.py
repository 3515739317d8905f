"""`transformer serve`: an HTTP API (FastAPI, served by uvicorn) and an attention explorer page for one model.

    pip install 'transformer-nmt[serve]'
    transformer serve --checkpoint runs/multi30k_de_en/checkpoints/best.pt     # http://127.0.0.1:8000

`app.py` holds the endpoints and their validation, `batching.py` the request batching, `static/` the page.
"""

from .app import ServeLimits, create_app
from .batching import RequestBatcher
from .server import run_server

__all__ = ["RequestBatcher", "ServeLimits", "create_app", "run_server"]
