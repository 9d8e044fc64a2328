"""Anthropic Messages API: ``POST /v1/messages`` (whole or streamed) and ``POST /v1/messages/count_tokens``.

A conversation's content blocks map onto the chat format's messages: ``system`` -> a system message, ``text``
blocks -> content, ``thinking`` blocks -> the assistant's reasoning (K3 keeps it in the history), ``tool_use``
blocks -> the assistant's tool calls (``input`` as the arguments), ``tool_result`` blocks -> tool messages
answering ``tool_use_id``, ``image`` blocks (user messages; ``base64`` sources, ``url`` ones with
``--allow-image-urls``) -> image parts (``kimi_mlx.server.images``; ``input_tokens`` counts their placeholders).
Replies come back as ``thinking`` (K3 reasoning), ``text`` and ``tool_use`` blocks; ``stop_reason`` is
``end_turn``, ``max_tokens``, ``stop_sequence`` or ``tool_use``; ``usage.input_tokens`` counts the prompt tokens not
read from the prefix cache, ``cache_read_input_tokens`` those that were. Speculative decoding applies as on the
other routes (``"speculative": false``, a kimi-mlx field, turns it off); Anthropic's usage has no field for drafts.

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

from ..chat.parser import ReplyEvent
from ..chat.reply_stream import ReplyStream
from .backend import (Backend, Prompt, choose_tools, reasoning_budget, reply_budget, render_prompt, resolve_thinking,
                      sampling_params, sse_data, sse_response, stop_ids, submit, watch_disconnect, with_keepalive)
from .errors import GENERATION_FAILED, ApiError
from .generation import Generation
from .images import ImageRef, prepare_images
from .schemas import CountTokensRequest, MessagesRequest, parse, request_body

router = APIRouter()


def _tool_result_text(block: dict) -> str:
    content = block.get("content", "")
    return content if isinstance(content, str) else "".join(b["text"] for b in content)


def _image_refs(req) -> list[ImageRef]:
    """The request's image blocks, in order."""
    refs = []
    for i, m in enumerate(req.messages):
        for j, b in enumerate(m.content):
            if b["type"] == "image":
                src = b["source"]
                refs.append(ImageRef(f"messages[{i}].content[{j}]", url=src.get("url"), data=src.get("data"),
                                     media_type=src.get("media_type")))
    return refs


def _user_content(blocks: list[dict], images) -> str | list[dict]:
    """A user message's text and image blocks as the renderer's content: the text (blocks joined), or with images
    a list of parts, each run of text blocks joined and each image block the next of ``images`` (an iterator over
    the request's prepared images)."""
    if not any(b["type"] == "image" for b in blocks):
        return "".join(b["text"] for b in blocks if b["type"] == "text")
    parts: list[dict] = []
    for b in blocks:
        if b["type"] == "image":
            parts.append({"type": "image", "image": next(images)})
        elif b["type"] == "text" and parts and parts[-1]["type"] == "text":
            parts[-1] = {"type": "text", "text": parts[-1]["text"] + b["text"]}
        elif b["type"] == "text":
            parts.append({"type": "text", "text": b["text"]})
    return parts


def _messages(req, images: list) -> list[dict]:
    """The request's system prompt and messages as the chat renderer's message dicts (``images``: the request's
    prepared images, in order)."""
    out: list[dict] = [{"role": "system", "content": req.system}] if req.system else []
    placed = iter(images)
    for m in req.messages:
        if m.role == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(b["text"] for b in m.content if b["type"] == "text")}
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
        content = _user_content(m.content, placed)
        if content or not results:
            out.append({"role": "user", "content": content})
    return out


async def _prompt(backend: Backend, req) -> Prompt:
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
    images = await prepare_images(_image_refs(req), backend.image_encoder, backend.image_limits, backend.no_images)
    return render_prompt(backend, _messages(req, images), tools=tools, thinking=thinking, thinking_effort=effort,
                         tool_choice=kind, images=images)


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
    prompt = await _prompt(backend, req)
    max_tokens = reply_budget(backend, len(prompt.tokens), req.max_tokens, "max_tokens", "messages")
    sampling = sampling_params(backend, {"temp": req.temperature, "top_p": req.top_p, "top_k": req.top_k})
    budget = reasoning_budget(backend, prompt, req.thinking.budget_tokens if req.thinking else None)
    text = ReplyStream(backend.tokenizer, backend.chat_format, prompt.thinking, req.stop_sequences,
                       stop_ids(backend))
    gen = Generation(submit(backend, prompt, max_tokens, sampling, None, budget, speculative=req.speculative), text,
                     "POST /v1/messages", len(prompt.tokens))
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


class _StreamedBlocks:
    """The content blocks of a streamed message as SSE events (``content_block_start`` / ``_delta`` / ``_stop``):
    ``open`` is the open block's type (None between blocks), ``index`` its index (-1 before the first), ``calls``
    the ``tool_use`` blocks so far (they number the ids)."""

    def __init__(self, msg_id: str):
        self.msg_id = msg_id
        self.open: Optional[str] = None
        self.index = -1
        self.calls = 0

    def add(self, ev: ReplyEvent) -> list[str]:
        """The events of one reply event: reasoning and content continue the open block of their type or open
        one; a tool call is a whole ``tool_use`` block (its arguments in one ``input_json_delta``)."""
        out: list[str] = []
        if ev.kind == "reasoning":
            if self.open != "thinking":
                out += self.start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self.delta({"type": "thinking_delta", "thinking": ev.text}))
        elif ev.kind == "content":
            if self.open != "text":
                out += self.start({"type": "text", "text": ""})
            out.append(self.delta({"type": "text_delta", "text": ev.text}))
        elif ev.kind == "tool_call":
            call = ev.tool_call
            out += self.start({"type": "tool_use", "id": tool_use_id(self.msg_id, self.calls), "name": call.name,
                               "input": {}})
            self.calls += 1
            out.append(self.delta({"type": "input_json_delta",
                                   "partial_json": json.dumps(call.arguments, ensure_ascii=False)}))
            out += self.stop()
        return out

    def finish(self) -> list[str]:
        """Close the open block; an empty text block first if the message has none."""
        out = self.start({"type": "text", "text": ""}) if self.index < 0 else []
        return out + self.stop()

    def start(self, content_block: dict) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open = content_block["type"]
        return out + [sse_data({"type": "content_block_start", "index": self.index, "content_block": content_block},
                               "content_block_start")]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse_data({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def delta(self, d: dict) -> str:
        return sse_data({"type": "content_block_delta", "index": self.index, "delta": d}, "content_block_delta")


def _message_start(gen: Generation, model: str, msg_id: str) -> str:
    usage = {**_usage(gen), "output_tokens": 0}
    return sse_data({"type": "message_start", "message": _message(model, msg_id, [], usage, None, None)},
                    "message_start")


async def _events(gen: Generation, model: str, msg_id: str, keepalive_s: float):
    """The SSE events of a streamed message: ``message_start`` with the first piece, ``ping`` while waiting longer
    than ``keepalive_s``, the content blocks' events (``_StreamedBlocks``), then ``message_delta`` and
    ``message_stop`` (or an ``error`` event if generation failed)."""
    blocks = _StreamedBlocks(msg_id)
    started = False
    async for piece in with_keepalive(gen, keepalive_s):
        if piece is None:
            yield sse_data({"type": "ping"}, "ping")
            continue
        if not started:
            started = True
            yield _message_start(gen, model, msg_id)
        for ev in piece.events:
            for text in blocks.add(ev):
                yield text
    if not started:
        yield _message_start(gen, model, msg_id)
    if gen.reason == "error":
        yield sse_data(ApiError(500, GENERATION_FAILED).anthropic_body(), "error")
        return
    for text in blocks.finish():
        yield text
    yield sse_data({"type": "message_delta", "delta": {"stop_reason": _stop_reason(gen, blocks.calls),
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
    return {"input_tokens": len((await _prompt(backend, req)).tokens)}
