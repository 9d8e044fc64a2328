"""The chat page at ``/`` (static files in ``kimi_mlx/server/ui/``, no build step, nothing loaded from the network)
and ``GET /v1/status``: what the page shows in its status panel and needs to know about the model.

The page itself holds no secrets and is served without the API key; it calls the ``/v1`` routes with the key the
user enters (``Authorization: Bearer KEY``). ``/v1/status`` answers 503 (OpenAI's error shape) while the model loads.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from .backend import THINKING_EFFORTS
from .errors import ApiError

UI_DIR = Path(__file__).parent / "ui"

router = APIRouter()


def add_page(app: FastAPI) -> None:
    """Serve the chat page: ``GET /`` is ``index.html``, ``/ui/*`` its script and style sheet."""
    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")
    app.get("/", include_in_schema=False)(_index)


async def _index() -> FileResponse:
    return FileResponse(UI_DIR / "index.html", headers={"Cache-Control": "no-cache"})


# GET /v1/status: the model (id, chat format, Kimi-K3 or not, images, context limit, weights), the server's defaults,
# memory, the scheduler's stats (running / prefilling / queued, prefix cache, images encoded, speculation) and the
# ranks.
@router.get("/v1/status")
async def status(request: Request):
    state = request.app.state.server
    backend = state.backend
    if backend is None:
        raise ApiError(503, f"the model is not ready: {state.load_error or 'loading'}", code="model_not_ready")
    d = backend.defaults
    images = backend.image_encoder is not None
    return {
        "status": "ok", "model": state.model_id, "chat_format": backend.chat_format,
        "k3": backend.chat_format == "kimi_k3", "images": images, "no_images": None if images else backend.no_images,
        "max_context": backend.max_context, "weights_bytes": backend.info.size, "ranks": backend.ranks,
        "thinking_efforts": list(THINKING_EFFORTS),
        "defaults": {"max_tokens": d.max_tokens, "temperature": d.sampling.temp, "top_p": d.sampling.top_p,
                     "thinking": d.thinking, "thinking_effort": d.thinking_effort, "system": d.system},
        "memory": {"active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory(),
                   "cache_bytes": mx.get_cache_memory()},
        "stats": backend.scheduler.stats,
    }
