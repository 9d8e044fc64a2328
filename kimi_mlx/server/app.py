"""The ASGI app: OpenAI (Chat Completions, Completions, Responses), Anthropic and Ollama routes (``openai_routes``,
``responses_routes``, ``anthropic_routes``, ``ollama_routes``), the chat page at ``/`` and ``GET /v1/status``
(``page``), ``GET``/``HEAD /health``, ``GET /openapi.json``
(the request bodies' schemas are the request models', ``kimi_mlx.server.schemas`` and ``ollama_schemas``), the API
key, and errors as JSON in the route's style — OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error",
...}`` on ``/v1/messages*``, Ollama's ``{"error": "..."}`` on ``/api/*``. Bad input never produces a traceback for
the client; an unexpected failure is a 500
that says only that (the server log has the exception); a client that leaves while sending its body is one log
line.

    app = create_app(load_backend, model_id="demo", api_key=None)   # a Backend, or a function that loads one
    uvicorn.run(app, host="127.0.0.1", port=8080)

Given a function, the app loads the model in a background thread once it starts (the socket is bound right
after), so ``/health`` answers 503 while it loads and 200 when it is ready.
"""

from __future__ import annotations

import functools
import hmac
import importlib.metadata
import logging
import threading
from contextlib import asynccontextmanager
from typing import Callable, Optional, Union

import mlx.core as mx
from fastapi import Depends, FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from . import anthropic_routes, ollama_routes, openai_routes, responses_routes
from . import page as chat_page
from .backend import Backend, ServerState
from .errors import INTERNAL_ERROR, ApiError
from .ollama_schemas import OLLAMA_REQUEST_MODELS
from .response_store import ResponseStore
from .schemas import REQUEST_MODELS

log = logging.getLogger("kimi_mlx.server")


def _anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def _error_response(request: Request, err: ApiError) -> JSONResponse:
    log.info(f"{request.method} {request.url.path} | {err.status} {err.message}")
    if request.url.path.startswith("/api/"):
        body = err.ollama_body()
    else:
        body = err.anthropic_body() if _anthropic(request) else err.openai_body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


async def _check_key(request: Request) -> None:
    """401 unless the request carries the server's key (``Authorization: Bearer KEY`` or ``x-api-key: KEY``)."""
    key = request.app.state.server.api_key
    if key is None:
        return
    bearer = request.headers.get("authorization", "")
    given = bearer[7:] if bearer[:7].lower() == "bearer " else request.headers.get("x-api-key")
    if given is None:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                       code="invalid_api_key")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise ApiError(401, "invalid API key", code="invalid_api_key")


def openapi_schema(app: FastAPI, model_id: str, api_key: bool) -> dict:
    """The OpenAPI document of ``app``: its routes, the request models as components (the routes' request bodies
    refer to them), ``model`` fields limited to the served ``model_id``, and the key schemes when one is needed."""
    doc = get_openapi(title="kimi-mlx", version=importlib.metadata.version("kimi-mlx"), routes=app.routes,
                      description="OpenAI-, Anthropic- and Ollama-compatible API of kimi-mlx serve")
    _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS + OLLAMA_REQUEST_MODELS],
                                 ref_template="#/components/schemas/{model}")
    components = doc.setdefault("components", {})
    components["schemas"] = defs["$defs"]
    for schema in components["schemas"].values():
        if "model" in schema.get("properties", {}):
            served = {"type": "string", "enum": [model_id], "description": "the served model (others: 404)"}
            schema["properties"]["model"] = served if "model" in schema.get("required", ()) else \
                {"anyOf": [served, {"type": "null"}]}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                         "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        for path, ops in doc["paths"].items():
            if path.startswith(("/v1/", "/api/")):
                for op in ops.values():
                    op["security"] = [{"bearer": []}, {"x-api-key": []}]
    return doc


def create_app(source: Union[Backend, Callable[[], Backend]], *, model_id: str, api_key: Optional[str] = None,
               max_body_mb: float = 16.0, keepalive_s: float = 10.0, responses_store_mb: float = 64.0,
               page: bool = True, on_load_error: Optional[Callable[[BaseException], None]] = None) -> FastAPI:
    """The app serving ``source`` (a ready ``Backend``, or a function loading one in the background) as
    ``model_id``. ``api_key``: required on every ``/v1`` and ``/api`` route when set. ``max_body_mb``: larger
    request bodies get 413. ``keepalive_s``: a stream waiting longer than this for its next event (a long prefill)
    sends a keep-alive (an SSE comment; Anthropic: a ``ping`` event; Ollama: an empty piece). ``responses_store_mb``:
    memory for stored Responses API responses (``previous_response_id``; the least recently used go first).
    ``page``: serve the chat page at ``/`` (module ``page``; its ``GET /v1/status`` is served either way).
    ``on_load_error(exc)``: called if loading fails (the app keeps answering ``/health`` with 503)."""
    state = ServerState(model_id, api_key, int(max_body_mb * 2**20), keepalive_s)
    app = FastAPI(lifespan=_lifespan(state, source, on_load_error), docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.responses = ResponseStore(int(responses_store_mb * 2**20))
    app.include_router(openai_routes.router, dependencies=[Depends(_check_key)])
    app.include_router(anthropic_routes.router, dependencies=[Depends(_check_key)])
    app.include_router(responses_routes.router, dependencies=[Depends(_check_key)])
    app.include_router(ollama_routes.router, dependencies=[Depends(_check_key)])
    app.include_router(chat_page.router, dependencies=[Depends(_check_key)])
    if page:
        chat_page.add_page(app)
    app.openapi = functools.partial(_cached_openapi_schema, app, model_id, api_key is not None)
    app.head("/health", operation_id="health_head")(app.get("/health")(health))
    _add_error_handlers(app)
    return app


def _load(state: ServerState, source: Callable[[], Backend],
          on_load_error: Optional[Callable[[BaseException], None]]) -> None:
    """Load the backend into ``state`` (the loading thread's body): a failure is kept for ``/health`` and passed to
    ``on_load_error``."""
    try:
        state.backend = source()
    except Exception as e:  # noqa: BLE001 - reported on /health and to on_load_error
        state.load_error = f"{type(e).__name__}: {e}"
        log.error(f"loading failed: {state.load_error}")
        if on_load_error is not None:
            on_load_error(e)
    finally:
        mx.synchronize()
        mx.clear_streams()  # this thread's MLX streams (the weights it loaded are evaluated: they stay)


def _lifespan(state: ServerState, source: Union[Backend, Callable[[], Backend]],
              on_load_error: Optional[Callable[[BaseException], None]]):
    """The app's lifespan: at start-up a ready backend goes into ``state``, a loading function starts in a
    background thread (``_load``); at shutdown the backend's scheduler stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if callable(source):
            threading.Thread(target=_load, args=(state, source, on_load_error), name="kimi-mlx-load",
                             daemon=True).start()
        else:
            state.backend = source
        yield
        if state.backend is not None:
            state.backend.scheduler.stop()

    return lifespan


def _cached_openapi_schema(app: FastAPI, model_id: str, api_key: bool) -> dict:
    """``app.openapi()``: ``openapi_schema``, made on the first call and kept in ``app.openapi_schema``."""
    if app.openapi_schema is None:
        app.openapi_schema = openapi_schema(app, model_id, api_key)
    return app.openapi_schema


# GET/HEAD /health: 200 with the model id and the scheduler's stats once the backend is ready; 503 with
# {"status": "loading"} while it loads, {"status": "error", "error": ...} if loading failed. (No docstring: it would
# become the route's description in the OpenAPI document.)
async def health(request: Request):
    state = request.app.state.server
    if state.backend is None:
        status = {"status": "error", "error": state.load_error} if state.load_error else {"status": "loading"}
        return JSONResponse(status, status_code=503)
    return {"status": "ok", "model": state.model_id, "stats": state.backend.scheduler.stats}


def _add_error_handlers(app: FastAPI) -> None:
    """Errors as JSON in the route's style (``_error_response``): API errors, HTTP errors (404 names the route), an
    unexpected exception as a bare 500 (its details only in the log); a client gone while sending its body is one
    log line."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return _error_response(request, err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        message = f"no route {request.method} {request.url.path}" if err.status_code == 404 else str(err.detail)
        return _error_response(request, ApiError(err.status_code, message, headers=err.headers))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, err: ClientDisconnect):
        log.info(f"{request.method} {request.url.path} | client disconnected while sending the request")
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.error(f"{request.method} {request.url.path} | internal error: {type(err).__name__}: {err}")
        return _error_response(request, ApiError(500, INTERNAL_ERROR))
