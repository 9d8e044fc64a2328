"""Ollama API: ``POST /api/chat``, ``POST /api/generate``, ``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``
and ``GET /api/version``, on the same engine, prefix cache, limits and chat rendering as the OpenAI routes.

Replies stream by default as newline-delimited JSON (``application/x-ndjson``): one object per line with the new
text (``message.content`` / ``message.thinking`` for chat, ``response`` / ``thinking`` for generate), an empty one
whenever ``keepalive_s`` passes without a token (a long prefill), and a last one with ``done: true``,
``done_reason`` (``stop`` or ``length``) and the counts and durations (nanoseconds): ``total_duration`` (from the
request's arrival), ``load_duration`` (0: the model is loaded at start), ``prompt_eval_count`` (every prompt
token, the ones the prefix cache supplied included), ``prompt_eval_duration`` (to the first token),
``eval_count`` and ``eval_duration``. ``stream: false`` returns one object. A failure mid-stream is an
``{"error": ...}`` line.

The model is the served name, also as ``name:latest``; another is a 404. ``think`` turns Kimi-K3 thinking on or
off (``low``/``medium``/``high`` choose its effort as ``reasoning_effort`` does); ``format`` is ``"json"`` or a
JSON schema (the chat format's structured output, as ``response_format``); tool calls come back in
``message.tool_calls`` with ``arguments`` as an object, and tool results (``role: tool``) pair with the calls by
``tool_call_id``, else by ``tool_name``, else by position. ``/api/generate`` renders ``prompt`` (with ``system``
and ``images``) as one user turn in the model's chat format, or with ``raw: true`` sends the prompt's tokens as
they are. ``keep_alive`` is accepted and ignored. Errors are Ollama's ``{"error": "..."}`` (the app's handler).

``POST /api/pull`` of the served model answers success (it is here); pushing, creating, copying and deleting
models and embeddings are a 501 saying so (``UNSUPPORTED``).
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..chat.reply_stream import ReplyStream
from ..text_stream import TextStream
from .backend import (EFFORTS, Backend, ModelInfo, Prompt, check_response_format, check_tokens, choose_tools, collect,
                      ndjson_response, render_prompt, reply_budget, resolve_thinking, sampling_params, stop_ids,
                      submit, with_keepalive)
from .errors import GENERATION_FAILED, ApiError
from .generation import Generation
from .images import ImageRef, prepare_images
from .ollama_schemas import (OllamaChatRequest, OllamaGenerateRequest, OllamaMessage, OllamaOptions,
                             OllamaShowRequest)
from .schemas import parse, request_body

router = APIRouter()

# the Ollama release whose API these routes follow (clients compare it to decide what a server can do)
OLLAMA_VERSION = "0.12.6"
NEVER = "2318-01-01T00:00:00Z"  # /api/ps expires_at: the model is never unloaded (Ollama's far-future time)
NS = 1_000_000_000  # durations are nanoseconds


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _check_model(state, name: Optional[str]) -> str:
    """The served model's name for ``name`` (the served name, or it with the ``:latest`` tag); 404 otherwise."""
    if not name:
        raise ApiError(400, "model is required", "model")
    if name not in (state.model_id, f"{state.model_id}:latest"):
        raise ApiError(404, f"model '{name}' not found", "model")
    return name


# ------------------------------------------------------------------------------------------------------- listing


def _digest(info: ModelInfo, model_id: str) -> str:
    """An id of the served weights (Ollama's manifest digest has no equivalent here): sha256 of what they are."""
    what = f"{model_id}|{info.source}|{info.family}|{info.parameter_count}|{info.size}|{info.quantization}"
    return hashlib.sha256(what.encode()).hexdigest()


def _details(info: ModelInfo) -> dict:
    count = info.parameter_count
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count}"
    return {"parent_model": "", "format": info.format, "family": info.family, "families": [info.family],
            "parameter_size": size, "quantization_level": info.quantization}


def _modified_at(info: ModelInfo) -> str:
    return datetime.fromtimestamp(info.modified_at, timezone.utc).isoformat().replace("+00:00", "Z")


def _listing(request: Request) -> dict:
    state = request.app.state.server
    info = state.ready().info
    name = f"{state.model_id}:latest" if ":" not in state.model_id else state.model_id
    return {"name": name, "model": name, "modified_at": _modified_at(info), "size": info.size,
            "digest": _digest(info, state.model_id), "details": _details(info)}


@router.get("/api/tags")
async def tags(request: Request):
    return {"models": [_listing(request)]}


@router.get("/api/ps")
async def ps(request: Request):
    entry = _listing(request)
    del entry["modified_at"]
    backend = request.app.state.server.ready()
    return {"models": [{**entry, "expires_at": NEVER, "size_vram": entry["size"],
                        "context_length": backend.max_context}]}


@router.get("/api/version")
async def version():
    return {"version": OLLAMA_VERSION}


def _capabilities(backend: Backend) -> list[str]:
    out = ["completion", "tools"]
    if backend.image_encoder is not None:
        out.append("vision")
    if backend.chat_format == "kimi_k3":
        out.append("thinking")
    return out


def _parameters(backend: Backend) -> str:
    """The server's defaults as Ollama's ``parameters`` text (``name value`` lines)."""
    p = backend.defaults.sampling
    rows = [("num_ctx", backend.max_context), ("num_predict", backend.defaults.max_tokens), ("temperature", p.temp),
            ("top_p", p.top_p), ("top_k", p.top_k), ("min_p", p.min_p)]
    if p.repetition_penalty is not None:
        rows.append(("repeat_penalty", p.repetition_penalty))
    return "".join(f"{k:<16}{v}\n" for k, v in rows)


@router.post("/api/show", openapi_extra=request_body(OllamaShowRequest))
async def show(request: Request):
    state = request.app.state.server
    body = await state.body(request)
    backend = state.ready()
    req = parse(OllamaShowRequest, body)
    _check_model(state, req.model or req.name)
    info, parameters = backend.info, _parameters(backend)
    modelfile = f"# kimi-mlx serve {state.model_id}\nFROM {info.source}\n" + "".join(
        f"PARAMETER {line}\n" for line in parameters.splitlines())
    model_info = {"general.architecture": info.family, "general.parameter_count": info.parameter_count,
                  f"{info.family}.context_length": backend.max_context,
                  f"{info.family}.vocab_size": backend.vocab_size}
    return {"modelfile": modelfile, "parameters": parameters,
            "template": getattr(backend.tokenizer, "chat_template", None) or "", "details": _details(info),
            "model_info": model_info, "capabilities": _capabilities(backend), "modified_at": _modified_at(info)}


@router.post("/api/pull", include_in_schema=False)
async def pull(request: Request):
    state = request.app.state.server
    req = parse(OllamaShowRequest, await state.body(request))
    name = req.model or req.name
    if name not in (state.model_id, f"{state.model_id}:latest"):
        raise ApiError(404, f"model '{name}' not found: this server serves '{state.model_id}' and pulls nothing",
                       "model")
    return {"status": "success"}  # the served model is here (one object, streamed or not)


# what this server does not do: one model, loaded at start, and no embeddings
UNSUPPORTED = {("POST", "/api/push"): "pushing models", ("POST", "/api/create"): "creating models",
               ("POST", "/api/copy"): "copying models", ("DELETE", "/api/delete"): "deleting models",
               ("POST", "/api/embed"): "embeddings", ("POST", "/api/embeddings"): "embeddings"}


async def unsupported(request: Request):
    what = UNSUPPORTED[(request.method, request.url.path)]
    raise ApiError(501, f"{request.url.path}: {what} is not supported by kimi-mlx serve (it serves one model, "
                        f"'{request.app.state.server.model_id}', loaded at start)")


for (_method, _path) in UNSUPPORTED:
    router.add_api_route(_path, unsupported, methods=[_method], include_in_schema=False)


# ------------------------------------------------------------------------------------------------------- prompts


def _thinking(backend: Backend, think) -> tuple[Optional[bool], Optional[str]]:
    if isinstance(think, str):
        return resolve_thinking(backend, True, EFFORTS[think], "think")
    return resolve_thinking(backend, think, None, "think")


def _response_format(backend: Backend, fmt) -> Optional[dict]:
    """``format`` as the renderer's ``response_format``: ``"json"`` -> a JSON object, a schema -> that schema."""
    if not fmt:
        return None
    out = {"type": "json_object"} if fmt == "json" else {"type": "json_schema", "json_schema": {"schema": fmt}}
    check_response_format(backend, out, "format")
    return out


def _user_content(text: str, images) -> str | list[dict]:
    """A user turn's text, or with images the images first (as Ollama's templates place them) and then the text."""
    if not images:
        return text
    parts = [{"type": "image", "image": image} for image in images]
    return parts + [{"type": "text", "text": text}] if text else parts


def _calls(m: OllamaMessage, i: int) -> list[dict]:
    """An assistant message's tool calls as the renderer's, each with the client's id or ``call_{i}_{n}``."""
    return [{"id": c.id or f"call_{i}_{n}", "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for n, c in enumerate(m.tool_calls or [])]


def _messages(req: OllamaChatRequest, images: list) -> list[dict]:
    """The request's messages as the renderer's dicts. A tool result names the call it answers by ``tool_call_id``,
    else by ``tool_name`` (the first call of the assistant message before it with that name not yet answered),
    else by position (``kimi_mlx.chat.tool_ids``)."""
    out: list[dict] = []
    placed = iter(images)
    awaiting: list[dict] = []
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            msg = {"role": "tool", "content": m.content or ""}
            match = next((c for c in awaiting if c["id"] == m.tool_call_id), None) if m.tool_call_id else \
                next((c for c in awaiting if c["function"]["name"] == m.tool_name), None)
            if m.tool_call_id or match is not None:
                msg["tool_call_id"] = m.tool_call_id or match["id"]
            if match is not None:
                awaiting.remove(match)
            if m.tool_name:
                msg["name"] = m.tool_name
            out.append(msg)
            continue
        if m.role == "assistant":
            msg = {"role": "assistant", "content": m.content or ""}
            if m.thinking:
                msg["reasoning_content"] = m.thinking
            awaiting = _calls(m, i)
            if awaiting:
                msg["tool_calls"] = list(awaiting)
            out.append(msg)
            continue
        text = m.content or ""
        content = _user_content(text, [next(placed) for _ in m.images or ()]) if m.role == "user" else text
        out.append({"role": m.role, "content": content})
    return out


async def _chat_prompt(backend: Backend, req: OllamaChatRequest) -> Prompt:
    thinking, effort = _thinking(backend, req.think)
    response_format = _response_format(backend, req.format)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    tools, _ = choose_tools(backend, tools, None, None, "tools")
    refs = [ImageRef(f"messages[{i}].images[{j}]", data=data)
            for i, m in enumerate(req.messages) for j, data in enumerate(m.images or ())]
    images = await prepare_images(refs, backend.image_encoder, backend.image_limits, backend.no_images)
    return render_prompt(backend, _messages(req, images), tools=tools, thinking=thinking, thinking_effort=effort,
                         response_format=response_format, images=images)


async def _generate_prompt(backend: Backend, req: OllamaGenerateRequest) -> Prompt:
    """``prompt`` as one user turn (after ``system``), or its tokens as they are with ``raw``."""
    for field in ("template", "suffix"):
        if getattr(req, field):
            what = "the model's own chat format renders prompts" if field == "template" else "no fill-in-the-middle"
            raise ApiError(400, f"{field}: not supported by this server ({what})", field)
    if req.context:
        raise ApiError(400, "context: not supported by this server; send the conversation to /api/chat", "context")
    if req.raw:
        if req.images:
            raise ApiError(400, "images: not taken with raw: true (the chat format places images)", "images")
        for field in ("think", "format"):
            if getattr(req, field):
                raise ApiError(400, f"{field}: not taken with raw: true (the prompt is sent as it is)", field)
        tokens = backend.tokenizer.encode(req.prompt)
        check_tokens(backend, tokens, "prompt")
        return Prompt(tokens)
    thinking, effort = _thinking(backend, req.think)
    response_format = _response_format(backend, req.format)
    refs = [ImageRef(f"images[{j}]", data=data) for j, data in enumerate(req.images or ())]
    images = await prepare_images(refs, backend.image_encoder, backend.image_limits, backend.no_images)
    messages = [{"role": "system", "content": req.system}] if req.system else []
    messages.append({"role": "user", "content": _user_content(req.prompt, images)})
    return render_prompt(backend, messages, thinking=thinking, thinking_effort=effort,
                         response_format=response_format, images=images)


def _max_tokens(backend: Backend, prompt_tokens: int, options: OllamaOptions) -> int:
    """The reply's token limit: ``num_predict`` (-1, -2: the server's default), within what ``num_ctx`` and the
    server's context leave after the prompt (a prompt that does not fit either is a 400)."""
    default = reply_budget(backend, prompt_tokens, None, "options.num_predict", "prompt")
    room = backend.max_context - prompt_tokens
    if options.num_ctx is not None:
        if prompt_tokens >= options.num_ctx:
            raise ApiError(400, f"options.num_ctx: the prompt is {prompt_tokens} tokens; num_ctx {options.num_ctx} "
                                "leaves no room for a reply", "options.num_ctx")
        room = min(room, options.num_ctx - prompt_tokens)
    n = options.num_predict
    return min(default, room) if n is None or n < 0 else min(n, room)


def _start(backend: Backend, prompt: Prompt, options: Optional[OllamaOptions], chat: bool, route: str
           ) -> Generation:
    options = options or OllamaOptions()
    max_tokens = _max_tokens(backend, len(prompt.tokens), options)
    sampling = sampling_params(backend, options.sampling_fields())
    if chat:
        text = ReplyStream(backend.tokenizer, backend.chat_format, prompt.thinking, options.stop, stop_ids(backend))
    else:
        text = TextStream(backend.tokenizer, options.stop, stop_ids(backend))
    return Generation(submit(backend, prompt, max_tokens, sampling, None), text, route, len(prompt.tokens))


# ------------------------------------------------------------------------------------------------------- replies


class _Reply:
    """One reply's objects: ``chat`` (``message``) or generate (``response``) pieces, and the final one."""

    def __init__(self, model: str, chat: bool, arrived: float):
        self.model, self.chat, self.arrived = model, chat, arrived
        self.calls = 0

    def piece(self, content: str = "", thinking: str = "", tool_calls: Optional[list] = None) -> dict:
        out: dict = {"model": self.model, "created_at": _now()}
        if self.chat:
            message: dict = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def tool_call(self, call) -> dict:
        out = {"id": call.id or f"call_{self.calls}",
               "function": {"index": self.calls, "name": call.name, "arguments": call.arguments}}
        self.calls += 1
        return out

    def add(self, piece) -> tuple[str, str, list]:
        """(content, thinking, tool calls) a piece adds: parser events (chat format), or plain text (raw)."""
        if not piece.events:
            return piece.text, "", []
        content = "".join(ev.text for ev in piece.events if ev.kind == "content")
        thinking = "".join(ev.text for ev in piece.events if ev.kind == "reasoning")
        calls = [self.tool_call(ev.tool_call) for ev in piece.events if ev.kind == "tool_call"]
        return content, thinking, calls if self.chat else []

    def done(self, gen: Generation, whole: Optional[dict] = None) -> dict:
        out = whole or self.piece()
        prefill_s, decode_s = gen.timings
        out.update(done=True, done_reason="length" if gen.reason == "length" else "stop",
                   total_duration=int((time.perf_counter() - self.arrived) * NS), load_duration=0,
                   prompt_eval_count=gen.prompt_tokens, prompt_eval_duration=int(prefill_s * NS),
                   eval_count=gen.completion_tokens, eval_duration=int(decode_s * NS))
        return out


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


async def _lines(gen: Generation, reply: _Reply, keepalive_s: float):
    """The NDJSON lines of a streamed reply: a piece per token that adds something, an empty piece as a
    keep-alive, the final object (or an error line)."""
    async for piece in with_keepalive(gen, keepalive_s):
        if piece is None:
            yield _line(reply.piece())
            continue
        content, thinking, calls = reply.add(piece)
        if content or thinking or calls:
            yield _line(reply.piece(content, thinking, calls))
    if gen.reason == "error":
        yield _line(ApiError(500, GENERATION_FAILED).ollama_body())
    else:
        yield _line(reply.done(gen))


async def _whole(request: Request, gen: Generation, reply: _Reply) -> dict:
    content, thinking, calls = [], [], []
    for piece in await collect(request, gen):
        c, t, k = reply.add(piece)
        content.append(c)
        thinking.append(t)
        calls += k
    if gen.reason == "error":
        raise ApiError(500, GENERATION_FAILED)
    return reply.done(gen, reply.piece("".join(content), "".join(thinking), calls))


def _loaded(model: str, chat: bool, stream: bool):
    """Ollama's answer to a request with nothing to generate (no messages, an empty prompt): the model is loaded."""
    out = _Reply(model, chat, time.perf_counter()).piece()
    out.update(done=True, done_reason="load")
    return Response(_line(out), media_type="application/x-ndjson") if stream else out


async def _respond(request: Request, kind: type, prompt_of, chat: bool, route: str):
    """A chat (``kind`` OllamaChatRequest, ``chat``) or generate request: parsed, its prompt made by
    ``prompt_of(backend, req)``, submitted, and answered streamed or whole."""
    arrived = time.perf_counter()
    state = request.app.state.server
    body = await state.body(request)
    backend = state.ready()
    req = parse(kind, body)
    model = _check_model(state, req.model)
    stream = req.stream is not False
    if (not req.messages) if chat else (not req.prompt and not req.images):
        return _loaded(model, chat, stream)
    prompt = await prompt_of(backend, req)
    gen = _start(backend, prompt, req.options, chat or not req.raw, route)
    reply = _Reply(model, chat, arrived)
    if stream:
        return ndjson_response(_lines(gen, reply, state.keepalive_s), gen.stream)
    return await _whole(request, gen, reply)


@router.post("/api/chat", openapi_extra=request_body(OllamaChatRequest))
async def chat(request: Request):
    return await _respond(request, OllamaChatRequest, _chat_prompt, True, "POST /api/chat")


@router.post("/api/generate", openapi_extra=request_body(OllamaGenerateRequest))
async def generate(request: Request):
    return await _respond(request, OllamaGenerateRequest, _generate_prompt, False, "POST /api/generate")
