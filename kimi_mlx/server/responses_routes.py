"""OpenAI Responses API: ``POST /v1/responses`` (whole or streamed), ``GET`` and ``DELETE /v1/responses/{id}``.

``input`` (a string, or message / function_call / function_call_output / reasoning items) and ``instructions`` (a
system message first; not carried over by ``previous_response_id``, as OpenAI does) map onto the chat format's
messages: developer messages are system messages, a reasoning item, an assistant message and function calls that
follow each other form one assistant turn (reasoning, content, tool calls), a function_call_output is a tool
message answering its ``call_id``; ``input_image`` parts of user messages are images (``kimi_mlx.server.images``).
Rendering, the token budget (``max_output_tokens``), sampling (``temperature``, ``top_p``), Kimi-K3 thinking
(``reasoning.effort``, mapped as the chat route maps ``reasoning_effort``), tools and ``tool_choice`` are the Chat
Completions route's (``openai_routes``, ``backend``), and so is ``text.format`` (JSON / JSON schema replies, as
``response_format``; K3 only).

Output items: ``reasoning`` (K3's reasoning as ``reasoning_text`` content; no summary), ``message`` (one
``output_text`` part) and ``function_call`` (``call_id`` the model's call id, ``arguments`` JSON text). ``status``
is ``completed``, or ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens``. Usage:
``input_tokens`` (images' placeholders included), ``input_tokens_details.cached_tokens`` (supplied by the prefix
cache), ``output_tokens``, ``output_tokens_details.reasoning_tokens`` (tokens whose text went to the reasoning).
Speculative decoding applies as on Chat Completions (``"speculative": false``, a kimi-mlx field, turns it off); the
Responses usage has no field for drafts.

Streaming sends the documented events, each with a ``sequence_number`` from 0: ``response.created``,
``response.in_progress``; per item ``response.output_item.added``, for reasoning and messages
``response.content_part.added``, ``response.reasoning_text.delta``/``response.output_text.delta`` ...,
``.done``, ``response.content_part.done``, for function calls ``response.function_call_arguments.delta`` and
``.done``; ``response.output_item.done``; then ``response.completed`` (or ``response.incomplete``; a failure is
``response.failed``). SSE comments keep the connection alive while a long prompt prefills.

``store`` (default true) keeps the response and its conversation in memory (``ResponseStore``, the app's
``--responses-store-mb``); ``previous_response_id`` continues a kept one (an unknown or evicted id is a 404).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import time
import uuid
from typing import Optional

from fastapi import APIRouter, Request

from ..chat.reply_stream import ReplyStream
from .backend import (Backend, Prompt, choose_tools, collect, render_prompt, reply_budget, sampling_params, sse_data,
                      sse_response, stop_ids, submit, with_keepalive)
from .errors import GENERATION_FAILED, ApiError
from .generation import Generation, Piece
from .images import ImageRef, prepare_images
from .openai_routes import KEEPALIVE, check_finish, effort_thinking, renderer_format
from .response_store import ResponseStore
from .schemas import ResponsesRequest, parse, request_body

router = APIRouter()
log = logging.getLogger("kimi_mlx.server")


# ------------------------------------------------------------------------------------------------------- input


def _image_refs(items: list[dict], offset: int) -> list[ImageRef]:
    """The ``input_image`` parts of the conversation's items, in order; ``offset``: how many items came from
    ``previous_response_id`` (their images are named by it)."""
    return [ImageRef(f"input[{i - offset}].content[{j}]" if i >= offset else "previous_response_id",
                     url=part["image_url"])
            for i, item in enumerate(items) if item["type"] == "message" and isinstance(item["content"], list)
            for j, part in enumerate(item["content"]) if part["type"] == "input_image"]


def _content(content: str | list, images) -> str | list:
    """A message item's content as the renderer's: its text, or with images a list of text and image parts (each
    image the next of ``images``, an iterator over the request's prepared images)."""
    if isinstance(content, str):
        return content
    if not any(p["type"] == "input_image" for p in content):
        return "".join(p["text"] for p in content)
    return [{"type": "image", "image": next(images)} if p["type"] == "input_image"
            else {"type": "text", "text": p["text"]} for p in content]


def _joins(turn: Optional[dict], kind: str) -> bool:
    """Whether an assistant-side item of ``kind`` continues ``turn`` (the last message so far): reasoning before
    anything else, content before the calls, calls at any point of an assistant turn."""
    if turn is None or turn["role"] != "assistant":
        return False
    if kind == "function_call":
        return True
    if kind == "message":
        return turn["content"] is None and "tool_calls" not in turn
    return turn["content"] is None and "tool_calls" not in turn and "reasoning_content" not in turn


def _messages(items: list[dict], images, instructions: Optional[str]) -> list[dict]:
    """The conversation's items as the chat renderer's message dicts (``instructions`` first, as a system one;
    reasoning items without text are left out)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _content(item["content"], images)})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind != "reasoning" or item["text"]:
            if not _joins(out[-1] if out else None, kind):
                out.append({"role": "assistant", "content": None})
            turn = out[-1]
            if kind == "reasoning":
                turn["reasoning_content"] = item["text"]
            elif kind == "message":
                turn["content"] = _content(item["content"], images)
            else:
                turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
    return out


async def _prompt(backend: Backend, req: ResponsesRequest, items: list[dict], offset: int) -> Prompt:
    """The rendered prompt of the conversation ``items`` (``offset`` of them from ``previous_response_id``)."""
    thinking, effort = effort_thinking(backend, req.reasoning.effort if req.reasoning else None, None,
                                       "reasoning.effort")
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
             for t in req.tools or []] or None
    choice = req.tool_choice
    name = choice["name"] if isinstance(choice, dict) else None
    tools, choice = choose_tools(backend, tools, "function" if name else choice, name, "tool_choice")
    response_format = renderer_format(backend, req.text.format if req.text else None, "text.format")
    images = await prepare_images(_image_refs(items, offset), backend.image_encoder, backend.image_limits,
                                  backend.no_images)
    try:
        return render_prompt(backend, _messages(items, iter(images), req.instructions), tools=tools,
                             thinking=thinking, thinking_effort=effort, tool_choice=choice,
                             response_format=response_format, images=images)
    except ApiError as e:
        if e.param != "messages":
            raise
        raise ApiError(e.status, "input" + e.message.removeprefix("messages"), "input") from None


def _history(store: ResponseStore, response_id: Optional[str]) -> list[dict]:
    """The conversation a ``previous_response_id`` ends (none: empty); 404 if it is not kept."""
    if response_id is None:
        return []
    entry = store.get(response_id)
    if entry is None:
        raise ApiError(404, f"previous_response_id: no stored response {response_id!r} (never stored, stored with "
                            f"store=false, deleted, or evicted from this server's memory)", "previous_response_id",
                       "previous_response_not_found")
    return list(entry.items)


# ------------------------------------------------------------------------------------------------------- output


class _Output:
    """The output items of a response as the reply's events arrive, and the stream events (without their
    ``sequence_number``) each step makes: ``open`` is the reasoning or message item being written (None between
    items), ``text`` its text so far."""

    def __init__(self, response_id: str):
        self.stem = response_id.removeprefix("resp_")
        self.items: list[dict] = []
        self.open: Optional[dict] = None
        self.text = ""

    def add(self, ev) -> list[dict]:
        """The events of one reply event: reasoning and content continue the open item of their kind or start
        one; a tool call is a whole function_call item."""
        if ev.kind in ("reasoning", "content"):
            kind = "reasoning" if ev.kind == "reasoning" else "message"
            out = [] if self.open is not None and self.open["type"] == kind else self.close() + self._start(kind)
            self.text += ev.text
            return out + [{**self._at(), "type": _TEXT_EVENTS[kind] + ".delta", "delta": ev.text,
                           **({"logprobs": []} if kind == "message" else {})}]
        if ev.kind == "tool_call":
            return self.close() + self._call(ev.tool_call)
        return []

    def _at(self, content: bool = True) -> dict:
        where = {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}
        return {**where, "content_index": 0} if content else where

    def _start(self, kind: str) -> list[dict]:
        prefix = "rs" if kind == "reasoning" else "msg"
        item = {"id": f"{prefix}_{self.stem}{len(self.items)}", "type": kind, "status": "in_progress",
                "content": []}
        item.update({"summary": []} if kind == "reasoning" else {"role": "assistant"})
        self.items.append(item)
        self.open, self.text = item, ""
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)},
                {**self._at(), "type": "response.content_part.added", "part": _part(kind, "")}]

    def close(self, status: str = "completed") -> list[dict]:
        """End the open item (with ``status``): its text's ``.done``, the part's and the item's done events."""
        item = self.open
        if item is None:
            return []
        self.open = None
        part = _part(item["type"], self.text)
        item.update(content=[part], status=status)
        done = {**self._at(), "type": _TEXT_EVENTS[item["type"]] + ".done", "text": self.text,
                **({"logprobs": []} if item["type"] == "message" else {})}
        return [done, {**self._at(), "type": "response.content_part.done", "part": part},
                {"type": "response.output_item.done", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _call(self, call) -> list[dict]:
        args = call.raw_arguments if call.raw_arguments is not None else json.dumps(call.arguments,
                                                                                     ensure_ascii=False)
        item = {"id": f"fc_{self.stem}{len(self.items)}", "type": "function_call", "status": "in_progress",
                "call_id": call.id or f"call_{self.stem}{len(self.items)}", "name": call.name, "arguments": ""}
        self.items.append(item)
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}
        item.update(arguments=args, status="completed")
        return [added, {**self._at(False), "type": "response.function_call_arguments.delta", "delta": args},
                {**self._at(False), "type": "response.function_call_arguments.done", "arguments": args,
                 "name": call.name},
                {"type": "response.output_item.done", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def as_input(self) -> list[dict]:
        """The output items as input items (``schemas.response_items``' normalized form), for the store."""
        out = []
        for item in self.items:
            if item["type"] == "function_call":
                out.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
            elif item["type"] == "reasoning":
                out.append({"type": "reasoning", "text": item["content"][0]["text"]})
            else:
                out.append({"type": "message", "role": "assistant", "content": item["content"][0]["text"]})
        return out


_TEXT_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _text_format(req: ResponsesRequest) -> dict:
    given = req.text.format if req.text else None
    return given.model_dump(by_alias=True, exclude_none=True) if given is not None else {"type": "text"}


class _Turn:
    """One response being made: its id, the conversation it continues (``items``), its ``_Output``, the count of
    reasoning tokens, and the response object in each state."""

    def __init__(self, req: ResponsesRequest, items: list[dict], model: str, store: ResponseStore):
        self.req, self.items, self.model, self.store = req, items, model, store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.output = _Output(self.id)
        self.reasoning_tokens = 0

    def add(self, piece: Piece) -> list[dict]:
        if piece.token is not None and any(ev.kind == "reasoning" for ev in piece.events):
            self.reasoning_tokens += 1
        return [out for ev in piece.events for out in self.output.add(ev)]

    def response(self, status: str = "in_progress", gen: Optional[Generation] = None) -> dict:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "error": {"code": "server_error", "message": GENERATION_FAILED} if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "output": copy.deepcopy(self.output.items) if status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": _text_format(req)}, "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "truncation": "disabled",
            "metadata": req.metadata or {}, "usage": self._usage(gen) if gen is not None else None,
        }

    def _usage(self, gen: Generation) -> dict:
        return {"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                "output_tokens": gen.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": gen.prompt_tokens + gen.completion_tokens}

    def finish(self, gen: Generation) -> tuple[list[dict], dict]:
        """The closing events and the final response (``completed``, ``incomplete`` at the token limit, or
        ``cancelled`` when the client left), kept in the store unless ``store`` is false or it was cancelled."""
        status = {"length": "incomplete", "cancelled": "cancelled"}.get(gen.reason, "completed")
        events = self.output.close(status if status != "cancelled" else "incomplete")
        response = self.response(status, gen)
        if self.req.store is False or status == "cancelled":
            return events, response
        if not self.store.put(response, self.items + self.output.as_input()) and self.store.budget:
            log.info(f"POST /v1/responses | {self.id} not stored: larger than --responses-store-mb")
        return events, response


# ------------------------------------------------------------------------------------------------------- routes


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


@router.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
async def create_response(request: Request):
    state = request.app.state.server
    body = await state.body(request)
    backend = state.ready()
    req = parse(ResponsesRequest, body)
    state.check_model(req.model)
    history = _history(_store(request), req.previous_response_id)
    items = history + req.input
    prompt = await _prompt(backend, req, items, len(history))
    max_tokens = reply_budget(backend, len(prompt.tokens), req.max_output_tokens, "max_output_tokens", "input")
    sampling = sampling_params(backend, {"temp": req.temperature, "top_p": req.top_p})
    text = ReplyStream(backend.tokenizer, backend.chat_format, prompt.thinking, [], stop_ids(backend))
    gen = Generation(submit(backend, prompt, max_tokens, sampling, None, speculative=req.speculative), text,
                     "POST /v1/responses", len(prompt.tokens))
    turn = _Turn(req, items, state.model_id, _store(request))
    if req.stream:
        return sse_response(_events(turn, gen, state.keepalive_s), gen.stream)
    for piece in await collect(request, gen):
        turn.add(piece)
    check_finish(gen)
    return turn.finish(gen)[1]


async def _events(turn: _Turn, gen: Generation, keepalive_s: float):
    """The SSE events of a streamed response (see the module's docstring), numbered from 0."""
    numbers = itertools.count()

    def emit(event: dict) -> str:
        return sse_data({**event, "sequence_number": next(numbers)}, event["type"])

    yield emit({"type": "response.created", "response": turn.response()})
    yield emit({"type": "response.in_progress", "response": turn.response()})
    async for piece in with_keepalive(gen, keepalive_s):
        if piece is None:
            yield KEEPALIVE
            continue
        for event in turn.add(piece):
            yield emit(event)
    if gen.reason == "error":
        yield emit({"type": "response.failed", "response": turn.response("failed", gen)})
        return
    events, response = turn.finish(gen)
    for event in events:
        yield emit(event)
    yield emit({"type": f"response.{response['status']}", "response": response})


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str):
    entry = _store(request).get(response_id)
    if entry is None:
        raise ApiError(404, f"no stored response {response_id!r}", "response_id", "not_found")
    return entry.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    if not _store(request).delete(response_id):
        raise ApiError(404, f"no stored response {response_id!r}", "response_id", "not_found")
    return {"id": response_id, "object": "response.deleted", "deleted": True}
