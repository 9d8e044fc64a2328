"""Anthropic Messages API: ``POST /v1/messages`` (whole or streamed) and ``POST /v1/messages/count_tokens``.

A conversation's content blocks map onto the chat format's messages: ``system`` -> a system message, ``text``
blocks -> content, ``thinking`` blocks -> the assistant's reasoning (K3 keeps it in the history), ``tool_use``
blocks -> the assistant's tool calls (``input`` as the arguments), ``tool_result`` blocks -> tool messages
answering ``tool_use_id``. Replies come back as ``thinking`` (K3 reasoning), ``text`` and ``tool_use`` blocks;
``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence`` or ``tool_use``; ``usage.input_tokens`` counts
the prompt tokens not read from the prefix cache, ``cache_read_input_tokens`` those that were.

Streaming sends the documented events: ``message_start``, then per block ``content_block_start``,
``content_block_delta`` (``thinking_delta`` / ``text_delta`` / ``input_json_delta``), ``content_block_stop``,
then ``message_delta`` (stop reason, output tokens) and ``message_stop``; ``ping`` events while a long prompt
prefills; a failure mid-stream is an ``error`` event. Thinking: ``thinking.type`` ``enabled``/``adaptive`` turns
K3 thinking on, ``disabled`` off (default: the server's); with thinking on, ``budget_tokens`` N ends the reasoning
section after N tokens (the scheduler writes K3's closer and the answer follows; ``backend.reasoning_budget``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Optional

from fastapi import APIRouter, Request

from ..text_stream import ReplyStream
from .backend import (Backend, Prompt, choose_tools, reasoning_budget, reply_budget, render_prompt, resolve_thinking,
                      sampling_params, sse_data, sse_response, stop_ids, submit, watch_disconnect, with_keepalive)
from .errors import GENERATION_FAILED, ApiError
from .generation import Generation
from .schemas import CountTokensRequest, MessagesRequest, parse, request_body

router = APIRouter()


def _tool_result_text(block: dict) -> str:
    content = block.get("content", "")
    return content if isinstance(content, str) else "".join(b["text"] for b in content)


def _messages(req) -> list[dict]:
    """The request's system prompt and messages as the chat renderer's message dicts."""
    out: list[dict] = [{"role": "system", "content": req.system}] if req.system else []
    for m in req.messages:
        text = "".join(b["text"] for b in m.content if b["type"] == "text")
        if m.role == "assistant":
            msg: dict = {"role": "assistant", "content": text}
            reasoning = "".join(b["thinking"] for b in m.content if b["type"] == "thinking")
            if reasoning:
                msg["reasoning_content"] = reasoning
            calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}}
                     for b in m.content if b["type"] == "tool_use"]
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        results = [b for b in m.content if b["type"] == "tool_result"]
        out += [{"role": "tool", "tool_call_id": b["tool_use_id"], "content": _tool_result_text(b)} for b in results]
        if text or not results:
            out.append({"role": "user", "content": text})
    return out


def _prompt(backend: Backend, req) -> Prompt:
    on = None if req.thinking is None else req.thinking.type != "disabled"
    thinking, effort = resolve_thinking(backend, on, None, "thinking")
    tools = [{"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                                 ("parameters", t.input_schema)) if v is not None}}
             for t in req.tools or []] or None
    choice = req.tool_choice
    kind = {"auto": None, "any": "required", "tool": "function", "none": "none"}[choice.type] if choice else None
    if kind == "function" and not choice.name:
        raise ApiError(400, "tool_choice.name: required for type 'tool'", "tool_choice.name")
    tools, kind = choose_tools(backend, tools, kind, choice.name if choice else None, "tool_choice")
    return render_prompt(backend, _messages(req), tools=tools, thinking=thinking, thinking_effort=effort,
                         tool_choice=kind)


def _usage(gen: Generation) -> dict:
    return {"input_tokens": gen.prompt_tokens - gen.cached_tokens, "output_tokens": gen.completion_tokens,
            "cache_read_input_tokens": gen.cached_tokens, "cache_creation_input_tokens": 0}


def _stop_reason(gen: Generation, tool_calls: int) -> str:
    if gen.stop_string is not None:
        return "stop_sequence"
    if gen.reason == "length":
        return "max_tokens"
    return "tool_use" if tool_calls else "end_turn"


def _message(model: str, msg_id: str, content: list, usage: dict, stop_reason: Optional[str],
             stop_sequence: Optional[str]) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


@router.post("/v1/messages", openapi_extra=request_body(MessagesRequest))
async def messages(request: Request):
    state = request.app.state.server
    body = await state.body(request)
    backend = state.ready()
    req = parse(MessagesRequest, body)
    state.check_model(req.model)
    prompt = _prompt(backend, req)
    max_tokens = reply_budget(backend, len(prompt.tokens), req.max_tokens, "max_tokens", "messages")
    sampling = sampling_params(backend, {"temp": req.temperature, "top_p": req.top_p, "top_k": req.top_k})
    budget = reasoning_budget(backend, prompt, req.thinking.budget_tokens if req.thinking else None)
    text = ReplyStream(backend.tokenizer, backend.chat_format, prompt.thinking, req.stop_sequences,
                       stop_ids(backend))
    gen = Generation(submit(backend, prompt, max_tokens, sampling, None, budget), text, "POST /v1/messages",
                     len(prompt.tokens))
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    if req.stream:
        return sse_response(_events(gen, state.model_id, msg_id, state.keepalive_s), gen.stream)
    watcher = asyncio.ensure_future(watch_disconnect(request, gen.stream))
    try:
        events = [ev async for piece in gen for ev in piece.events]
    finally:
        watcher.cancel()
    if gen.reason == "error":
        raise ApiError(500, GENERATION_FAILED)
    blocks: list[dict] = []
    for ev in events:
        kind = {"reasoning": "thinking", "content": "text"}.get(ev.kind)
        if kind is not None and blocks and blocks[-1]["type"] == kind:
            blocks[-1][kind] += ev.text
        elif kind == "thinking":
            blocks.append({"type": "thinking", "thinking": ev.text, "signature": ""})
        elif kind == "text":
            blocks.append({"type": "text", "text": ev.text})
        elif ev.kind == "tool_call":
            call = ev.tool_call
            n = sum(b["type"] == "tool_use" for b in blocks)
            blocks.append({"type": "tool_use", "id": tool_use_id(msg_id, n), "name": call.name,
                           "input": call.arguments})
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    calls = sum(b["type"] == "tool_use" for b in blocks)
    return _message(state.model_id, msg_id, blocks, _usage(gen), _stop_reason(gen, calls), gen.stop_string)


def tool_use_id(msg_id: str, n: int) -> str:
    """The id of the ``n``-th ``tool_use`` block of message ``msg_id``: ``toolu_{msg hex}_{n}``, unique in the
    conversation and within Anthropic's id pattern ``[a-zA-Z0-9_-]+`` (the model's own ``functions.{name}:{n}`` is
    not). Clients send it back as given; the renderer pairs results with calls by position (``chat.tool_ids``)."""
    return f"toolu_{msg_id.removeprefix('msg_')}_{n}"


async def _events(gen: Generation, model: str, msg_id: str, keepalive_s: float):
    started = False
    block: Optional[str] = None  # the open block's type
    index = -1
    calls = 0

    def start() -> str:
        usage = {**_usage(gen), "output_tokens": 0}
        return sse_data({"type": "message_start", "message": _message(model, msg_id, [], usage, None, None)},
                        "message_start")

    def open_block(content_block: dict) -> list[str]:
        nonlocal block, index
        out = close_block()
        index += 1
        block = content_block["type"]
        return out + [sse_data({"type": "content_block_start", "index": index, "content_block": content_block},
                               "content_block_start")]

    def close_block() -> list[str]:
        nonlocal block
        if block is None:
            return []
        block = None
        return [sse_data({"type": "content_block_stop", "index": index}, "content_block_stop")]

    def delta(d: dict) -> str:
        return sse_data({"type": "content_block_delta", "index": index, "delta": d}, "content_block_delta")

    async for piece in with_keepalive(gen, keepalive_s):
        if piece is None:
            yield sse_data({"type": "ping"}, "ping")
            continue
        if not started:
            started = True
            yield start()
        for ev in piece.events:
            out: list[str] = []
            if ev.kind == "reasoning":
                if block != "thinking":
                    out += open_block({"type": "thinking", "thinking": "", "signature": ""})
                out.append(delta({"type": "thinking_delta", "thinking": ev.text}))
            elif ev.kind == "content":
                if block != "text":
                    out += open_block({"type": "text", "text": ""})
                out.append(delta({"type": "text_delta", "text": ev.text}))
            elif ev.kind == "tool_call":
                call = ev.tool_call
                out += open_block({"type": "tool_use", "id": tool_use_id(msg_id, calls), "name": call.name,
                                   "input": {}})
                calls += 1
                out.append(delta({"type": "input_json_delta",
                                  "partial_json": json.dumps(call.arguments, ensure_ascii=False)}))
                out += close_block()
            for text in out:
                yield text
    if not started:
        yield start()
    if gen.reason == "error":
        yield sse_data(ApiError(500, GENERATION_FAILED).anthropic_body(), "error")
        return
    if index < 0:
        for text in open_block({"type": "text", "text": ""}):
            yield text
    for text in close_block():
        yield text
    yield sse_data({"type": "message_delta", "delta": {"stop_reason": _stop_reason(gen, calls),
                                                        "stop_sequence": gen.stop_string},
                    "usage": {"output_tokens": gen.completion_tokens}}, "message_delta")
    yield sse_data({"type": "message_stop"}, "message_stop")


@router.post("/v1/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
async def count_tokens(request: Request):
    state = request.app.state.server
    body = await state.body(request)
    backend = state.ready()
    req = parse(CountTokensRequest, body)
    state.check_model(req.model)
    return {"input_tokens": len(_prompt(backend, req).tokens)}
