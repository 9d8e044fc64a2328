"""OpenAI API: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and
``GET /v1/models/{id}``.

Chat replies are parsed in the model's own format: reasoning comes back as ``reasoning_content`` and ``reasoning``
(clients read one or the other), tool calls as ``tool_calls`` with JSON-string ``arguments``; ``finish_reason`` is
``stop``, ``length`` or ``tool_calls``; ``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens the
prefix cache supplied. Kimi-K3 thinking: ``chat_template_kwargs`` ``thinking``/``enable_thinking`` (bool) and
``thinking_effort`` (low/high/max), or ``reasoning_effort`` (``none`` turns thinking off; ``minimal``/``low`` ->
low, ``medium``/``high`` -> high, ``xhigh``/``max`` -> max: K3 knows low, high and max). Log-probabilities are
reported within [``LOGPROB_FLOOR``, 0] (JSON has no -Infinity or NaN). Images: ``image_url`` parts of user messages
(``data:`` URLs; ``http(s)`` with ``--allow-image-urls``; ``detail`` is accepted and ignored), read and prepared by
``kimi_mlx.server.images``; ``usage.prompt_tokens`` counts their placeholder tokens (``cached_tokens`` those the
prefix cache supplied; ``prompt_tokens_details.image_tokens`` all of them). Speculative decoding: Predicted
Outputs (``prediction``: drafts are looked up in its text too; ``usage.completion_tokens_details`` counts accepted
and rejected draft tokens) and the extension field ``speculative`` (false: off for this request). The Responses API
(``responses_routes``) shares ``effort_thinking``, ``renderer_format``, ``collect`` and ``check_finish``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Optional

from fastapi import APIRouter, Request

from ..chat.reply_stream import ReplyStream
from ..text_stream import TextStream
from .backend import (EFFORTS, Backend, Prompt, check_response_format, check_tokens, choose_tools, collect,
                      reply_budget, render_prompt, resolve_thinking, sampling_params, sse_data, sse_response, stop_ids,
                      submit, with_keepalive)
from .errors import GENERATION_FAILED, ApiError
from .generation import Generation
from .images import ImageRef, prepare_images
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, parse, request_body

router = APIRouter()

KEEPALIVE = ": keepalive\n\n"  # an SSE comment: clients skip it
LOGPROB_FLOOR = -9999.0  # a token of (numerically) zero probability, as OpenAI reports it


class _Reply:
    """Ids and envelopes of one response (``chat.completion[.chunk]`` or ``text_completion``)."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list, usage: Optional[dict] = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


def _usage(gen: Generation) -> dict:
    """Token counts; ``prompt_tokens`` includes the images' placeholders, ``prompt_tokens_details.image_tokens``
    (requests with images) counts them. A request that had a prediction or speculated gets
    ``completion_tokens_details`` with OpenAI's ``accepted_prediction_tokens`` (draft tokens in the reply) and
    ``rejected_prediction_tokens`` (draft tokens verified and rejected): drafts from the prediction, the prompt, the
    reply or a draft model alike."""
    details = {"cached_tokens": gen.cached_tokens}
    images = gen.stream.request.images
    if images:
        details["image_tokens"] = sum(im.num_tokens for im in images)
    usage = {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
             "total_tokens": gen.prompt_tokens + gen.completion_tokens, "prompt_tokens_details": details}
    drafted, accepted = gen.drafts
    if drafted or gen.stream.request.prediction:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": drafted - accepted}
    return usage


def check_finish(gen: Generation) -> None:
    if gen.reason == "error":
        raise ApiError(500, GENERATION_FAILED)


def _logprob(value: float) -> float:
    """A log-probability as JSON can carry it: clipped to [LOGPROB_FLOOR, 0]; NaN (penalties or biases that left
    no finite distribution) as the floor."""
    return LOGPROB_FLOOR if math.isnan(value) else min(0.0, max(LOGPROB_FLOOR, value))


def _token_logprob(tokenizer, token: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", "replace"), "logprob": _logprob(logprob), "bytes": list(raw)}


def _chat_logprobs(tokenizer, gen: Generation, piece) -> Optional[list]:
    """The chat ``logprobs.content`` entry of a piece's token (None: not asked for, or the stop token)."""
    ev = piece.token
    if ev is None or ev.logprob is None or ev.token in gen.stream.request.stop_token_ids:
        return None
    entry = _token_logprob(tokenizer, ev.token, ev.logprob)
    entry["top_logprobs"] = [_token_logprob(tokenizer, t, lp) for t, lp in ev.top_logprobs or []]
    return [entry]


# ------------------------------------------------------------------------------------------------------- models


def _model_card(request: Request) -> dict:
    state = request.app.state.server
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "kimi-mlx"}


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str):
    request.app.state.server.check_model(model_id)
    return _model_card(request)


# ------------------------------------------------------------------------------------------------------- chat


def _image_refs(messages: list[ChatMessage]) -> list[ImageRef]:
    """The ``image_url`` parts of the request's messages, in order."""
    return [ImageRef(f"messages[{i}].content[{j}]", url=part["image_url"]["url"])
            for i, m in enumerate(messages) if isinstance(m.content, list)
            for j, part in enumerate(m.content) if part.get("type") == "image_url"]


def _message(m: ChatMessage, images) -> dict:
    """A request message as the chat renderer's dict (``developer`` is a system message); its ``image_url`` parts
    become image parts holding the next of ``images`` (an iterator over the request's prepared images)."""
    content = m.content
    if isinstance(content, list):
        content = [{"type": "image", "image": next(images)} if p.get("type") == "image_url" else p for p in content]
    out: dict = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name:
        out["name"] = m.name
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    if m.role == "assistant":
        reasoning = m.reasoning_content or m.reasoning
        if reasoning:
            out["reasoning_content"] = reasoning
        if m.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls
            ]
    return out


def effort_thinking(backend: Backend, reasoning_effort: Optional[str], template_kwargs: Optional[dict],
                    effort_param: str) -> tuple[Optional[bool], Optional[str]]:
    """``(thinking, effort)`` for the renderer from OpenAI's ``reasoning_effort`` (``none`` turns thinking off,
    the others on at K3's effort in ``EFFORTS``) and ``chat_template_kwargs`` (which win where both say); an error
    names ``effort_param`` when the effort was given."""
    kwargs = template_kwargs or {}
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    effort = kwargs.get("thinking_effort")
    if reasoning_effort == "none":
        thinking = False if thinking is None else thinking
    elif reasoning_effort is not None:
        thinking = True if thinking is None else thinking
        effort = effort or EFFORTS[reasoning_effort]
    param = effort_param if reasoning_effort is not None else "chat_template_kwargs"
    return resolve_thinking(backend, thinking, effort, param)


def renderer_format(backend: Backend, response_format, param: str) -> Optional[dict]:
    """A request's reply format (a ``ResponseFormat`` or ``ResponsesTextFormat``; None: text) as the renderer's;
    the Kimi Linear chat format has no JSON mode (ApiError naming ``param``)."""
    out = response_format.for_renderer() if response_format is not None else None
    check_response_format(backend, out, param)
    return out


async def _chat_prompt(backend: Backend, req: ChatCompletionRequest) -> Prompt:
    thinking, effort = effort_thinking(backend, req.reasoning_effort, req.chat_template_kwargs, "reasoning_effort")
    response_format = renderer_format(backend, req.response_format, "response_format")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    tools, choice = choose_tools(backend, tools, "function" if name else choice, name, "tool_choice")
    images = await prepare_images(_image_refs(req.messages), backend.image_encoder, backend.image_limits,
                                  backend.no_images)
    placed = iter(images)
    messages = [_message(m, placed) for m in req.messages]
    return render_prompt(backend, messages, tools=tools, thinking=thinking, thinking_effort=effort,
                         tool_choice=choice, response_format=response_format, images=images)


def _tool_call_json(call, index: int) -> dict:
    args = call.raw_arguments if call.raw_arguments is not None else json.dumps(call.arguments, ensure_ascii=False)
    return {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": args}}


def _chat_finish(gen: Generation, tool_calls: int) -> str:
    if gen.reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def chat_completions(request: Request):
    state = request.app.state.server
    body = await state.body(request)
    backend = state.ready()
    req = parse(ChatCompletionRequest, body)
    state.check_model(req.model)
    prompt = await _chat_prompt(backend, req)
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = reply_budget(backend, len(prompt.tokens), req.max_completion_tokens or req.max_tokens,
                              limit_param, "messages")
    top = (req.top_logprobs or 0) if req.logprobs else None
    sampling = sampling_params(backend, req.sampling_fields())
    text = ReplyStream(backend.tokenizer, backend.chat_format, prompt.thinking, req.stop, stop_ids(backend))
    prediction = req.prediction.content if req.prediction is not None else None
    gen = Generation(submit(backend, prompt, max_tokens, sampling, top, prediction=prediction,
                            speculative=req.speculative), text, "POST /v1/chat/completions", len(prompt.tokens))
    reply = _Reply("chat", state.model_id)
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return sse_response(_chat_chunks(backend, gen, reply, usage, state.keepalive_s), gen.stream)
    content, reasoning, calls, logprobs = [], [], [], []
    for piece in await collect(request, gen):
        for ev in piece.events:
            if ev.kind == "content":
                content.append(ev.text)
            elif ev.kind == "reasoning":
                reasoning.append(ev.text)
            elif ev.kind == "tool_call":
                calls.append(_tool_call_json(ev.tool_call, len(calls)))
        logprobs += _chat_logprobs(backend.tokenizer, gen, piece) or []
    check_finish(gen)
    message: dict = {"role": "assistant", "content": "".join(content) if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    choice = {"index": 0, "message": message, "logprobs": {"content": logprobs} if top is not None else None,
              "finish_reason": _chat_finish(gen, len(calls))}
    return reply.envelope("chat.completion", [choice], _usage(gen))


async def _chat_chunks(backend: Backend, gen: Generation, reply: _Reply, include_usage: bool, keepalive_s: float):
    def chunk(delta: dict, finish: Optional[str] = None, logprobs: Optional[list] = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
                  "finish_reason": finish}
        return sse_data(reply.envelope("chat.completion.chunk", [choice]))

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    async for piece in with_keepalive(gen, keepalive_s):
        if piece is None:
            yield KEEPALIVE
            continue
        deltas = []
        for ev in piece.events:
            if ev.kind == "content":
                deltas.append({"content": ev.text})
            elif ev.kind == "reasoning":
                deltas.append({"reasoning_content": ev.text, "reasoning": ev.text})
            elif ev.kind == "tool_call":
                deltas.append({"tool_calls": [_tool_call_json(ev.tool_call, calls)]})
                calls += 1
        logprobs = _chat_logprobs(backend.tokenizer, gen, piece)
        if logprobs and not deltas:
            deltas = [{}]
        for i, delta in enumerate(deltas):
            yield chunk(delta, logprobs=logprobs if i == 0 else None)
    if gen.reason == "error":
        yield sse_data(ApiError(500, GENERATION_FAILED).openai_body())
    else:
        yield chunk({}, finish=_chat_finish(gen, calls))
        if include_usage:
            yield sse_data(reply.envelope("chat.completion.chunk", [], _usage(gen)))
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------------------------- completions


def _completion_logprobs(tokenizer, gen: Generation, piece, offset: int, out: dict) -> None:
    """Append a piece's token to the legacy ``logprobs`` object ``out`` (tokens, token_logprobs, top_logprobs,
    text_offset); the stop token is left out."""
    ev = piece.token
    if ev is None or ev.logprob is None or ev.token in gen.stream.request.stop_token_ids:
        return
    out["tokens"].append(_token_logprob(tokenizer, ev.token, ev.logprob)["token"])
    out["token_logprobs"].append(_logprob(ev.logprob))
    out["top_logprobs"].append({_token_logprob(tokenizer, t, lp)["token"]: _logprob(lp)
                                for t, lp in ev.top_logprobs or []})
    out["text_offset"].append(offset)


def _new_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
async def completions(request: Request):
    state = request.app.state.server
    body = await state.body(request)
    backend = state.ready()
    req = parse(CompletionRequest, body)
    state.check_model(req.model)
    tokens = backend.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
    check_tokens(backend, tokens, "prompt")
    max_tokens = reply_budget(backend, len(tokens), req.max_tokens, "max_tokens", "prompt")
    sampling = sampling_params(backend, req.sampling_fields())
    text = TextStream(backend.tokenizer, req.stop, stop_ids(backend))
    gen = Generation(submit(backend, Prompt(tokens), max_tokens, sampling, req.logprobs, speculative=req.speculative),
                     text, "POST /v1/completions", len(tokens))
    reply = _Reply("completion", state.model_id)
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        chunks = _completion_chunks(backend, gen, reply, req.logprobs is not None, usage, state.keepalive_s)
        return sse_response(chunks, gen.stream)
    text, logprobs = "", _new_logprobs()
    for piece in await collect(request, gen):
        _completion_logprobs(backend.tokenizer, gen, piece, len(text), logprobs)
        text += piece.text
    check_finish(gen)
    choice = {"index": 0, "text": text, "logprobs": logprobs if req.logprobs is not None else None,
              "finish_reason": "length" if gen.reason == "length" else "stop"}
    return reply.envelope("text_completion", [choice], _usage(gen))


async def _completion_chunks(backend: Backend, gen: Generation, reply: _Reply, want_logprobs: bool,
                             include_usage: bool, keepalive_s: float):
    offset = 0
    async for piece in with_keepalive(gen, keepalive_s):
        if piece is None:
            yield KEEPALIVE
            continue
        logprobs = _new_logprobs()
        _completion_logprobs(backend.tokenizer, gen, piece, offset, logprobs)
        offset += len(piece.text)
        if piece.text or logprobs["tokens"]:
            choice = {"index": 0, "text": piece.text, "logprobs": logprobs if want_logprobs else None,
                      "finish_reason": None}
            yield sse_data(reply.envelope("text_completion", [choice]))
    if gen.reason == "error":
        yield sse_data(ApiError(500, GENERATION_FAILED).openai_body())
    else:
        choice = {"index": 0, "text": "", "logprobs": None,
                  "finish_reason": "length" if gen.reason == "length" else "stop"}
        yield sse_data(reply.envelope("text_completion", [choice]))
        if include_usage:
            yield sse_data(reply.envelope("text_completion", [], _usage(gen)))
    yield "data: [DONE]\n\n"
