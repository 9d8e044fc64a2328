"""The HTTP layer in-process (``kimi_mlx.server``): the app on a scripted engine (a stand-in for the scheduler that
replays a given reply's tokens), driven by the official ``openai`` and ``anthropic`` clients over Starlette's test
client, so reply parsing (reasoning, tool calls, finish reasons, Anthropic blocks and events) is checked on exact
model output; ``/health`` while loading; failures inside the server answered without their exception text;
``TextStream`` stop strings and UTF-8; message boundaries of prompts.

The real engine and real models are in ``test_server_api.py`` / ``test_server_k3.py`` / ``test_server_errors.py``.
"""

import asyncio
import json
import logging
import threading

import anthropic
import openai
import pytest
from conftest import KL_FIXTURE
from fastapi.testclient import TestClient
from xtml_tokenizer import load_xtml_tokenizer

from kimi_mlx.chat.format import render_chat, render_chat_with_starts
from kimi_mlx.chat.tokenizer import load_kimi_tokenizer
from kimi_mlx.server.app import create_app
from kimi_mlx.server.backend import Backend, render_prompt
from kimi_mlx.server.errors import GENERATION_FAILED, INTERNAL_ERROR
from kimi_mlx.server.scheduler import FinishEvent, TokenEvent
from kimi_mlx.text_stream import TextStream

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
USER = {"role": "user", "content": "Weather in Tokyo?"}


class ScriptedStream:
    """Replays ``script`` as the request's tokens (stopping on a stop id or max_tokens), like a RequestStream."""

    def __init__(self, request, script, cached, delay):
        self.request, self.script, self.cached_tokens, self.delay = request, script, cached, delay
        self.cancelled = False

    def cancel(self):
        self.cancelled = True

    async def __aiter__(self):
        req, n, reason = self.request, 0, "length"
        await asyncio.sleep(self.delay)  # the prefill
        for token in self.script[: req.max_tokens]:
            if self.cancelled:
                reason = "cancelled"
                break
            n += 1
            yield TokenEvent(token, -0.5 if req.top_logprobs is not None else None,
                             [(token, -0.5)] if req.top_logprobs else None)
            if token in req.stop_token_ids:
                reason = "stop"
                break
        yield FinishEvent(reason, len(req.tokens), self.cached_tokens, n)


class ScriptedEngine:
    """The scheduler's interface, replaying one script for every request; records the requests."""

    def __init__(self, script, cached=0, delay=0.0):
        self.script, self.cached, self.delay, self.requests = script, cached, delay, []

    def submit(self, request):
        self.requests.append(request)
        return ScriptedStream(request, self.script, self.cached, self.delay)

    def stop(self):
        pass

    stats = {}


def _app(tok, fmt, script, keepalive_s=10.0, **kwargs):
    engine = ScriptedEngine(script, **kwargs)
    backend = Backend(engine, tok, fmt, vocab_size=len(tok), max_context=4096)
    return create_app(backend, model_id="m", keepalive_s=keepalive_s), engine


def _reply_tokens(tok, fmt, messages, answer, **render):
    """The exact tokens the chat format writes for ``answer`` after ``messages`` (incl. the turn end)."""
    prompt = render_chat(tok, messages, chat_format=fmt, **render)
    full = render_chat(tok, [*messages, answer], add_generation_prompt=False, chat_format=fmt, **render)
    assert full[: len(prompt)] == prompt
    return full[len(prompt):]


@pytest.fixture(scope="module")
def k3_tok(tmp_path_factory):
    return load_xtml_tokenizer(tmp_path_factory.mktemp("xtml"))


@pytest.fixture(scope="module")
def kl_tok():
    return load_kimi_tokenizer(KL_FIXTURE / "hf")


K3_ANSWER = {"role": "assistant", "reasoning_content": "Need the tool.", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}]}


def test_k3_reasoning_and_tool_call_openai(k3_tok):
    """A K3 reply with reasoning and a typed tool call: ``reasoning_content`` and ``reasoning``, ``tool_calls`` with
    JSON-string arguments and ``finish_reason: tool_calls``, whole and streamed; the prompt the engine got is the
    rendered conversation (tools declared, thinking on)."""
    script = _reply_tokens(k3_tok, "kimi_k3", [USER], K3_ANSWER, tools=TOOLS)
    app, engine = _app(k3_tok, "kimi_k3", script)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        r = client.chat.completions.create(model="m", messages=[USER], tools=TOOLS, max_tokens=200)
        assert engine.requests[0].tokens == render_chat(k3_tok, [USER], tools=TOOLS)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert m.model_extra["reasoning_content"] == m.model_extra["reasoning"] == "Need the tool."
        assert m.content is None
        (call,) = m.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Tokyo"}
        assert call.id == "functions.get_weather:1"
        assert r.usage.completion_tokens == len(script)

        chunks = list(client.chat.completions.create(model="m", messages=[USER], tools=TOOLS, max_tokens=200,
                                                     stream=True))
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Need the tool."
        (streamed,) = [tc for d in deltas for tc in d.tool_calls or []]
        assert streamed.index == 0 and streamed.id == call.id and streamed.function.arguments == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_k3_reply_openai_thinking_off_and_length(k3_tok):
    """thinking off (``chat_template_kwargs``): the prompt opens ``response``, the reply is content; cut short by
    max_tokens it is ``length`` with the text so far."""
    answer = {"role": "assistant", "content": "It is sunny."}
    script = _reply_tokens(k3_tok, "kimi_k3", [USER], answer, thinking=False)
    app, engine = _app(k3_tok, "kimi_k3", script)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        r = client.chat.completions.create(model="m", messages=[USER], extra_body={
            "chat_template_kwargs": {"thinking": False}})
        assert engine.requests[-1].tokens == render_chat(k3_tok, [USER], thinking=False)
        assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
        assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
        r = client.chat.completions.create(model="m", messages=[USER], reasoning_effort="none", max_tokens=3)
        assert r.choices[0].finish_reason == "length"
        cut = k3_tok.decode(script[:3])
        assert r.choices[0].message.content == cut and "It is sunny.".startswith(cut) and cut != "It is sunny."
        r = client.chat.completions.create(model="m", messages=[USER], reasoning_effort="medium")
        assert engine.requests[-1].tokens == render_chat(k3_tok, [USER], thinking=True, thinking_effort="high")


def test_k3_anthropic_blocks_and_events(k3_tok):
    """Anthropic: a thinking block, then a tool_use block with the arguments as ``input``; ``stop_reason:
    tool_use``; streamed as message_start, content_block_start/delta/stop per block, message_delta, message_stop."""
    script = _reply_tokens(k3_tok, "kimi_k3", [USER], K3_ANSWER, tools=TOOLS)
    app, _ = _app(k3_tok, "kimi_k3", script, cached=5)
    tools = [{"name": "get_weather", "description": "Get weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    with TestClient(app) as http:
        client = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http, max_retries=0)
        msg = client.messages.create(model="m", max_tokens=200, tools=tools, messages=[USER])
        assert [b.type for b in msg.content] == ["thinking", "tool_use"]
        assert msg.content[0].thinking == "Need the tool."
        assert msg.content[1].name == "get_weather" and msg.content[1].input == {"city": "Tokyo"}
        assert msg.stop_reason == "tool_use"
        assert msg.usage.cache_read_input_tokens == 5 and msg.usage.output_tokens == len(script)
        with client.messages.stream(model="m", max_tokens=200, tools=tools, messages=[USER]) as stream:
            kinds = [ev.type for ev in stream if ev.type in (
                "message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop")]
            final = stream.get_final_message()
        assert kinds == ["message_start", "content_block_start", "content_block_stop", "content_block_start",
                         "content_block_stop", "message_delta", "message_stop"]
        def same(blocks):  # each message's tool_use ids are its own: toolu_{message}_{n}
            return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]

        assert same(final.content) == same(msg.content)
        assert [b.id for b in (msg.content[1], final.content[1])] == [f"toolu_{m.id[4:]}_0" for m in (msg, final)]
        assert final.stop_reason == "tool_use"


def test_kimi_linear_tool_call(kl_tok):
    """A Kimi Linear tool-call section parses to an OpenAI tool call with the model's own id and raw JSON
    arguments, and to an Anthropic tool_use block."""
    answer = {"role": "assistant", "content": "Let me check.",
              "tool_calls": [{"id": "functions.get_weather:0", "function": {"name": "get_weather",
                                                                            "arguments": '{"city": "Tokyo"}'}}]}
    script = _reply_tokens(kl_tok, "kimi_linear", [USER], answer, tools=TOOLS)
    app, _ = _app(kl_tok, "kimi_linear", script)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        r = client.chat.completions.create(model="m", messages=[USER], tools=TOOLS)
        m = r.choices[0].message
        assert m.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
        assert m.tool_calls[0].id == "functions.get_weather:0"
        assert m.tool_calls[0].function.arguments == '{"city": "Tokyo"}'
        client = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http, max_retries=0)
        msg = client.messages.create(model="m", max_tokens=100, messages=[USER], tools=[
            {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}])
        assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.content[1].input == {"city": "Tokyo"}


def test_keepalive_while_prefilling(kl_tok):
    """A stream whose first token takes a while (a long prefill) sends keep-alives meanwhile (OpenAI: SSE comments,
    Anthropic: ping events); the clients still read the same reply."""
    answer = {"role": "assistant", "content": "Fine."}
    script = _reply_tokens(kl_tok, "kimi_linear", [USER], answer)
    app, _ = _app(kl_tok, "kimi_linear", script, keepalive_s=0.05, delay=0.4)
    with TestClient(app) as http:
        raw = http.post("/v1/chat/completions", json={"messages": [USER], "stream": True}).text
        assert raw.count(": keepalive") >= 3 and raw.endswith("data: [DONE]\n\n")
        raw = http.post("/v1/completions", json={"prompt": "x", "stream": True}).text
        assert raw.count(": keepalive") >= 3
        raw = http.post("/v1/messages", json={"model": "m", "max_tokens": 50, "messages": [USER], "stream": True}).text
        assert raw.count("event: ping") >= 3 and raw.index("event: ping") < raw.index("event: message_start")
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        chunks = client.chat.completions.create(model="m", messages=[USER], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Fine."
        claude = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http, max_retries=0)
        with claude.messages.stream(model="m", max_tokens=50, messages=[USER]) as stream:
            assert stream.get_final_message().content[0].text == "Fine."


def test_health_while_loading(kl_tok):
    """/health is 503 while the model loads (API routes too, with Retry-After), 200 once it has; a failed load
    stays 503 with the error."""
    release = threading.Event()

    def load():
        release.wait(30)
        return Backend(ScriptedEngine([]), kl_tok, "kimi_linear", len(kl_tok), 4096)

    with TestClient(create_app(load, model_id="m")) as http:
        assert http.get("/health").json() == {"status": "loading"}
        r = http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"]
        release.set()
        for _ in range(100):
            if http.get("/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert http.get("/health").json()["status"] == "ok"

    errors = []

    def broken():
        raise OSError("no such model")

    with TestClient(create_app(broken, model_id="m", on_load_error=errors.append)) as http:
        for _ in range(100):
            if http.get("/health").json()["status"] == "error":
                break
            threading.Event().wait(0.05)
        r = http.get("/health")
        assert r.status_code == 503 and "no such model" in r.json()["error"]
        assert isinstance(errors[0], OSError)


SECRET = "key(): incompatible function arguments"  # an MLX signature, as an engine failure once carried


class FailedStream(ScriptedStream):
    """A generation that ends in an engine error before its first token."""

    async def __aiter__(self):
        yield FinishEvent("error", len(self.request.tokens), 0, 0, f"TypeError: {SECRET}")


class FailingEngine(ScriptedEngine):
    """Every request fails inside the server: ``submit`` raises (``on_submit``) or the generation fails."""

    def __init__(self, on_submit: bool):
        super().__init__([])
        self.on_submit = on_submit

    def submit(self, request):
        if self.on_submit:
            raise TypeError(SECRET)
        return FailedStream(request, [], 0, 0.0)


@pytest.mark.parametrize("on_submit", [True, False], ids=["route-raises", "engine-error"])
def test_internal_failures_keep_their_details_in_the_log(kl_tok, caplog, on_submit):
    """A failure that is not the client's: 500 with a fixed message in the route's error style (streamed: an error
    event), never the exception's text; the server log has it."""
    backend = Backend(FailingEngine(on_submit), kl_tok, "kimi_linear", len(kl_tok), 4096)
    message = INTERNAL_ERROR if on_submit else GENERATION_FAILED
    bodies = []
    with caplog.at_level(logging.INFO, "kimi_mlx.server"), \
            TestClient(create_app(backend, model_id="m"), raise_server_exceptions=False) as http:
        r = http.post("/v1/chat/completions", json={"messages": [USER]})
        assert r.status_code == 500 and r.json()["error"]["message"] == message
        bodies.append(r.text)
        r = http.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [USER]})
        assert r.status_code == 500
        assert r.json() == {"type": "error", "error": {"type": "api_error", "message": message}}
        bodies.append(r.text)
        if not on_submit:
            raw = http.post("/v1/completions", json={"prompt": "x", "stream": True}).text
            assert json.loads(raw.split("data: ")[-2])["error"]["message"] == message
            bodies.append(raw)
            raw = http.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [USER],
                                                  "stream": True}).text
            assert "event: error" in raw and message in raw
            bodies.append(raw)
    assert not any(SECRET in b for b in bodies)
    assert SECRET in caplog.text


def test_text_stream_stop_strings_and_utf8(kl_tok):
    """A stop string split over tokens is never shown, not even its first part; text before it is; a multi-byte
    character split over tokens comes out whole; stop ids add nothing."""
    text = "héllo wörld, stop here"
    ids = kl_tok.encode_ordinary(text)
    assert len(kl_tok.encode_ordinary("é")) > 1  # the character is split over tokens
    stream = TextStream(kl_tok, stop_strings=["stop", "xyz"], stop_ids=frozenset({kl_tok.eos_token_id}))
    shown = ""
    for t in ids:
        shown += stream.add(t)
        assert "héllo wörld, ".startswith(shown)  # never a half character, never the start of "stop"
    assert shown + stream.finish() == "héllo wörld, " and stream.stop_string == "stop"
    stream = TextStream(kl_tok, stop_strings=["zzz"], stop_ids=frozenset({kl_tok.eos_token_id}))
    out = "".join(stream.add(t) for t in kl_tok.encode_ordinary("naïve z") + [kl_tok.eos_token_id])
    assert out + stream.finish() == "naïve z" and stream.stop_string is None


@pytest.mark.parametrize("fmt", ["kimi_linear", "kimi_k3"])
def test_message_boundaries(fmt, kl_tok, k3_tok):
    """``render_chat_with_starts``: the ids of ``render_chat``, and each message starts where ``render_chat(start=k)``
    says; ``render_prompt`` reports those starts as boundaries and the end of the system part as ``system_end``."""
    tok = kl_tok if fmt == "kimi_linear" else k3_tok
    messages = [{"role": "system", "content": "Be brief."}, USER,
                {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.get_weather:0", "function": {
                    "name": "get_weather", "arguments": {"city": "T"}}}]},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "22C"}]
    ids, starts = render_chat_with_starts(tok, messages, chat_format=fmt, tools=TOOLS)
    assert ids == render_chat(tok, messages, chat_format=fmt, tools=TOOLS)
    for k in range(1, len(messages) + 1):
        assert ids[starts[k]:] == render_chat(tok, messages, chat_format=fmt, tools=TOOLS, start=k)
    prompt = render_prompt(Backend(None, tok, fmt, len(tok), 4096), messages, tools=TOOLS)
    assert prompt.tokens == ids
    assert prompt.boundaries == tuple(starts[1:]) and prompt.system_end == starts[1]
