"""The Ollama API of ``kimi-mlx serve``: a real ``--model demo`` process driven by the official ``ollama`` client
(``chat``, ``generate``, ``list``, ``show``, ``ps``, whole and streamed), checked against the server's own Chat
Completions and Completions routes for the same conversation or prompt (the independent reference: the OpenAI
client's reading of the established routes): greedy text, finish reason, prompt and reply token counts, durations
in nanoseconds; ``options`` (``num_predict``, ``seed``, ``stop``, ``num_ctx``); a tool-call history rendered as
Chat Completions renders it; malformed requests answered with Ollama's ``{"error": ...}`` and a 4xx while the
server keeps serving; ``pull`` of the served model a success, the model-management and embedding routes a 501
saying so. In process, on a scripted engine (``test_server_app.py``): a Kimi-K3 reply with reasoning and a tool
call read by the ``ollama`` client's types as ``message.thinking`` and ``message.tool_calls`` with object
arguments, empty pieces as keep-alives during a long prefill, the API key on every ``/api`` route, and failures
inside the server as a 500 or an error line without the exception's text.
"""

import json
import time

import httpx2 as httpx
import ollama
import openai
import pytest
from fastapi.testclient import TestClient
from serve_helpers import Server
from test_server_app import SECRET, TOOLS, USER, FailingEngine, ScriptedEngine, _app, _reply_tokens
from xtml_tokenizer import load_xtml_tokenizer

from kimi_mlx.chat.format import render_chat
from kimi_mlx.server.app import create_app
from kimi_mlx.loading import load
from kimi_mlx.server.backend import Backend, describe_model
from kimi_mlx.server.errors import GENERATION_FAILED, INTERNAL_ERROR

N = 12
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0}
# the tool as the ollama client sends it (its types put "required" before "properties"), for both APIs
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--model", "demo", "--max-tokens", str(N), "--max-kv-size", "4096"]
    with Server(flags, tmp_path_factory.mktemp("serve"), tmp_path_factory.getbasetemp() / "kimi-mlx-home") as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def ol(server):
    return ollama.Client(host=server.base)


def reference(oai, messages, **kw):
    """The Chat Completions reply (temperature 0, ``N`` tokens unless ``kw`` says) for ``messages``."""
    return oai.chat.completions.create(model="demo", messages=messages, **{"temperature": 0, "max_tokens": N, **kw})


def check_stats(r, ref, wall_ns):
    """The final object's counts equal Chat Completions' usage; its durations are nanoseconds within the request's
    wall time and add up."""
    assert r.done and r.done_reason == ref.choices[0].finish_reason
    assert (r.prompt_eval_count, r.eval_count) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert r.load_duration == 0
    assert 0 < r.prompt_eval_duration and 0 < r.eval_duration
    assert r.prompt_eval_duration + r.eval_duration <= r.total_duration <= wall_ns
    assert r.total_duration > wall_ns / 50  # nanoseconds, not micro- or milliseconds


def test_chat_equals_chat_completions(ol, oai):
    ref = reference(oai, CHAT)
    tic = time.perf_counter_ns()
    r = ol.chat(model="demo", messages=CHAT, options=GREEDY, stream=False)
    check_stats(r, ref, time.perf_counter_ns() - tic)
    assert r.message.role == "assistant" and r.message.content == ref.choices[0].message.content
    assert r.model == "demo" and r.message.thinking is None and not r.message.tool_calls
    tic = time.perf_counter_ns()
    parts = list(ol.chat(model="demo:latest", messages=CHAT, options=GREEDY, stream=True))
    check_stats(parts[-1], ref, time.perf_counter_ns() - tic)
    assert all(not p.done for p in parts[:-1]) and parts[-1].message.content == ""
    assert "".join(p.message.content for p in parts) == ref.choices[0].message.content
    assert len(parts) > 2 and parts[0].model == "demo:latest"


def test_chat_streams_ndjson(server, oai):
    """The stream is ``application/x-ndjson``, one JSON object per line, the last one ``done``."""
    body = {"model": "demo", "messages": CHAT, "options": GREEDY}
    with httpx.stream("POST", server.base + "/api/chat", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = list(r.iter_lines())
    objs = [json.loads(line) for line in lines]
    assert [o["done"] for o in objs] == [False] * (len(objs) - 1) + [True]
    assert "".join(o["message"]["content"] for o in objs) == reference(oai, CHAT).choices[0].message.content


def test_generate_equals_chat_completions(ol, oai):
    """``generate`` renders ``prompt`` (after ``system``) as one user turn; ``raw`` sends it as it is, as
    Completions does."""
    ref = reference(oai, CHAT)
    tic = time.perf_counter_ns()
    r = ol.generate(model="demo", prompt="Hello there", system="Be brief.", options=GREEDY, stream=False)
    check_stats(r, ref, time.perf_counter_ns() - tic)
    assert r.response == ref.choices[0].message.content
    parts = list(ol.generate(model="demo", prompt="Hello there", system="Be brief.", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == r.response and parts[-1].done
    plain = reference(oai, CHAT[1:])
    assert ol.generate(model="demo", prompt="Hello there", options=GREEDY).response == plain.choices[0].message.content
    raw = oai.completions.create(model="demo", prompt="Once upon a time", max_tokens=N, temperature=0)
    r = ol.generate(model="demo", prompt="Once upon a time", raw=True, options=GREEDY)
    assert r.response == raw.choices[0].text and r.prompt_eval_count == raw.usage.prompt_tokens
    parts = list(ol.generate(model="demo", prompt="Once upon a time", raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == raw.choices[0].text


def test_empty_request_loads(ol):
    """No messages / no prompt: Ollama's "load" answer, nothing generated."""
    r = ol.generate(model="demo")
    assert r.done and r.done_reason == "load" and r.response == ""
    r = ol.chat(model="demo", messages=[])
    assert r.done and r.done_reason == "load"
    (r,) = list(ol.chat(model="demo", messages=[], stream=True))
    assert r.done and r.done_reason == "load" and r.message.content == ""


def test_list_show_ps_version(ol, server):
    (m,) = ol.list().models
    assert m.model == "demo:latest" and m.size > 1_000_000 and m.digest and m.modified_at.year >= 2024
    assert m.details.family == "kimi_linear" and m.details.format == "safetensors"
    assert m.details.quantization_level == "F32" and m.details.parameter_size.endswith("M")
    s = ol.show("demo")
    assert s.capabilities == ["completion", "tools"] and s.details.family == "kimi_linear"
    assert s.modelinfo["general.architecture"] == "kimi_linear"
    assert s.modelinfo["kimi_linear.context_length"] == 4096 and "num_ctx" in s.parameters
    assert "FROM demo" in s.modelfile and s.template
    assert ol.show("demo:latest").details == s.details
    (p,) = ol.ps().models
    assert p.model == "demo:latest" and p.context_length == 4096 and p.size == m.size
    assert httpx.get(server.base + "/api/version").json()["version"].count(".") == 2


def test_num_predict_limits_the_reply(ol, oai):
    ref = reference(oai, CHAT, max_tokens=3)
    r = ol.chat(model="demo", messages=CHAT, options={"temperature": 0, "num_predict": 3})
    assert r.eval_count == 3 and r.done_reason == "length" and r.message.content == ref.choices[0].message.content
    r = ol.generate(model="demo", prompt="Hello there", options={"temperature": 0, "num_predict": 2})
    assert r.eval_count == 2 and r.done_reason == "length"
    r = ol.chat(model="demo", messages=CHAT, options={"temperature": 0, "num_predict": -1})
    assert r.eval_count == N  # the server's --max-tokens


def test_seed_makes_sampling_repeatable(ol, oai):
    """The same seed gives the same sampled reply, equal to Chat Completions' with that seed; another seed
    (over a few tries) another reply."""
    opts = {"temperature": 1.0, "seed": 7}
    a = ol.chat(model="demo", messages=CHAT, options=opts).message.content
    b = ol.chat(model="demo", messages=CHAT, options=opts).message.content
    ref = reference(oai, CHAT, temperature=1.0, seed=7).choices[0].message.content
    assert a == b == ref
    others = {ol.chat(model="demo", messages=CHAT, options={"temperature": 1.0, "seed": s}).message.content
              for s in (8, 9, 10)}
    assert others - {a}


def test_stop_strings_stop(ol, oai):
    full = reference(oai, CHAT).choices[0].message.content
    stop = full[4:6]
    want = full[: full.index(stop)]
    r = ol.chat(model="demo", messages=CHAT, options={"temperature": 0, "stop": [stop]})
    assert r.message.content == want and r.done_reason == "stop"
    assert r.message.content == reference(oai, CHAT, stop=[stop]).choices[0].message.content
    parts = list(ol.generate(model="demo", prompt="Hello there", system="Be brief.",
                             options={"temperature": 0, "stop": [stop]}, stream=True))
    assert "".join(p.response for p in parts) == want


def test_num_ctx_limits_the_context(ol, oai):
    prompt_tokens = reference(oai, CHAT, max_tokens=1).usage.prompt_tokens
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="demo", messages=CHAT, options={"num_ctx": prompt_tokens})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
    r = ol.chat(model="demo", messages=CHAT, options={"temperature": 0, "num_ctx": prompt_tokens + 2})
    assert r.eval_count <= 2 and r.done_reason in ("length", "stop")


def test_tool_history_renders_as_chat_completions(ol, oai):
    """A tool call and its result (``tool_name``; arguments as an object) in the history: the same prompt and
    greedy reply as the Chat Completions conversation with ``tool_call_id``, the tool's ``name`` and JSON-string
    arguments."""
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 C"}]
    openai_history = [history[0],
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"id": "c1", "type": "function",
                           "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                      {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "Sunny, 21 C"}]
    ref = reference(oai, openai_history, tools=WEATHER)
    r = ol.chat(model="demo", messages=history, tools=WEATHER, options=GREEDY)
    assert r.prompt_eval_count == ref.usage.prompt_tokens and r.message.content == ref.choices[0].message.content
    without = ol.chat(model="demo", messages=history, options={"temperature": 0, "num_predict": 1})
    assert without.prompt_eval_count < r.prompt_eval_count  # the tools are declared in the prompt


BAD = [  # (id, path, body, status, words the error has)
    ("unknown model", "/api/chat", {"model": "llama3", "messages": CHAT}, 404, "model 'llama3' not found"),
    ("no model", "/api/chat", {"messages": CHAT}, 400, "model"),
    ("bad json", "/api/chat", b'{"model": "demo", "messages": [', 400, "JSON"),
    ("json array", "/api/generate", b"[1]", 400, "object"),
    ("bad role", "/api/chat", {"model": "demo", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("string options", "/api/chat", {"model": "demo", "messages": CHAT, "options": {"temperature": "hot"}}, 400,
     "temperature"),
    ("negative temperature", "/api/generate", {"model": "demo", "prompt": "x", "options": {"temperature": -1}}, 400,
     "temperature"),
    ("num_predict 0", "/api/generate", {"model": "demo", "prompt": "x", "options": {"num_predict": 0}}, 400,
     "num_predict"),
    ("format not json", "/api/chat", {"model": "demo", "messages": CHAT, "format": "yaml"}, 400, "format"),
    ("format on Kimi Linear", "/api/chat", {"model": "demo", "messages": CHAT, "format": "json"}, 400, "JSON mode"),
    ("think on Kimi Linear", "/api/chat", {"model": "demo", "messages": CHAT, "think": True}, 400, "thinking"),
    ("image on a text model", "/api/chat", {"model": "demo", "messages": [
        {"role": "user", "content": "x", "images": ["iVBORw0KGgo="]}]}, 400, "takes no images"),
    ("image in a system message", "/api/chat", {"model": "demo", "messages": [
        {"role": "system", "content": "x", "images": ["iVBORw0KGgo="]}]}, 400, "user messages"),
    ("template", "/api/generate", {"model": "demo", "prompt": "x", "template": "{{ .Prompt }}"}, 400, "template"),
    ("context", "/api/generate", {"model": "demo", "prompt": "x", "context": [1, 2]}, 400, "context"),
    ("images with raw", "/api/generate", {"model": "demo", "prompt": "", "raw": True,
                                                       "images": ["iVBORw0KGgo="]}, 400, "raw"),
    ("show unknown model", "/api/show", {"model": "other"}, 404, "not found"),
    ("tool call args a string", "/api/chat", {"model": "demo", "messages": [
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]}, 400, "arguments"),
    ("prompt over the context", "/api/generate", {"model": "demo", "prompt": "word " * 5000, "raw": True}, 400,
     "context"),
]


@pytest.mark.parametrize("path, body, status, words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_malformed_request_gets_ollamas_error(server, path, body, status, words):
    for stream in (True, False):
        if isinstance(body, dict):
            r = httpx.post(server.base + path, json={**body, "stream": stream}, timeout=60)
        else:
            r = httpx.post(server.base + path, content=body, timeout=60)
        assert r.status_code == status, r.text
        err = r.json()
        assert list(err) == ["error"] and isinstance(err["error"], str) and words in err["error"], err


def test_errors_through_the_client_and_still_serving(ol, server):
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="nope", messages=CHAT)
    assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    with pytest.raises(ollama.ResponseError) as e:
        list(ol.generate(model="demo", prompt="x", options={"top_p": 3}, stream=True))
    assert e.value.status_code == 400 and "top_p" in e.value.error
    assert ol.pull("demo:latest").status == "success"
    for call, status in ((lambda: ol.pull("llama3"), 404), (lambda: ol.delete("demo"), 501),
                         (lambda: ol.embed(model="demo", input="x"), 501),
                         (lambda: ol.copy("demo", "demo2"), 501)):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == status and ("not found" in e.value.error or "not supported" in e.value.error)
    assert ol.chat(model="demo", messages=CHAT, options={"num_predict": 2}).eval_count == 2
    assert httpx.get(server.base + "/health").status_code == 200 and "Traceback" not in server.log()


# ------------------------------------------------------------------------------------------- in process, scripted


K3_ANSWER = {"role": "assistant", "reasoning_content": "Need the tool.", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}]}


@pytest.fixture(scope="module")
def k3_tok(tmp_path_factory):
    return load_xtml_tokenizer(tmp_path_factory.mktemp("xtml"))


def test_k3_reasoning_and_tool_call_reply(k3_tok):
    """A K3 reply with reasoning and a typed tool call: ``message.thinking`` and ``message.tool_calls`` (arguments
    an object) as the ``ollama`` client's types read them, whole and streamed; the engine got the conversation
    rendered with the tools declared."""
    script = _reply_tokens(k3_tok, "kimi_k3", [USER], K3_ANSWER, tools=TOOLS)
    app, engine = _app(k3_tok, "kimi_k3", script)
    body = {"model": "m", "messages": [USER], "tools": TOOLS, "options": {"num_predict": 200}}
    with TestClient(app) as http:
        r = ollama.ChatResponse(**http.post("/api/chat", json={**body, "stream": False}).json())
        assert engine.requests[0].tokens == render_chat(k3_tok, [USER], tools=TOOLS)
        assert r.message.thinking == "Need the tool." and r.message.content == ""
        (call,) = r.message.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments == {"city": "Tokyo"}
        assert r.done_reason == "stop" and r.eval_count == len(script)
        lines = http.post("/api/chat", json=body).text.splitlines()
        parts = [ollama.ChatResponse(**json.loads(line)) for line in lines]
        assert "".join(p.message.thinking or "" for p in parts) == "Need the tool."
        assert [c for p in parts for c in p.message.tool_calls or []] == [call]
        assert parts[-1].done and not any(p.done for p in parts[:-1])


def test_keepalive_pieces_while_prefilling(k3_tok):
    """A long prefill: empty pieces every ``keepalive_s`` (the client reads them as empty text), then the reply."""
    answer = {"role": "assistant", "content": "Fine.", "reasoning_content": "Easy."}
    script = _reply_tokens(k3_tok, "kimi_k3", [USER], answer)
    app, _ = _app(k3_tok, "kimi_k3", script, keepalive_s=0.05, delay=0.4)
    with TestClient(app) as http:
        lines = http.post("/api/chat", json={"model": "m", "messages": [USER]}).text.splitlines()
        parts = [ollama.ChatResponse(**json.loads(line)) for line in lines]
        empty = [p for p in parts if not p.done and not p.message.content and not p.message.thinking]
        assert len(empty) >= 3
        assert "".join(p.message.content for p in parts) == "Fine."
        assert "".join(p.message.thinking or "" for p in parts) == "Easy."


def test_api_key_guards_the_ollama_routes(k3_tok):
    """With a key, every /api route wants it (as the ollama client sends it: ``Authorization: Bearer``); a missing
    or wrong key is a 401 in Ollama's shape."""
    backend = Backend(ScriptedEngine(_reply_tokens(k3_tok, "kimi_k3", [USER], {"role": "assistant", "content": "Hi"})),
                      k3_tok, "kimi_k3", vocab_size=len(k3_tok), max_context=4096)
    with TestClient(create_app(backend, model_id="m", api_key="sekret")) as http:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            for method, path in (("GET", "/api/tags"), ("POST", "/api/chat"), ("POST", "/api/show")):
                r = http.request(method, path, json={"model": "m", "messages": [USER]}, headers=headers)
                assert r.status_code == 401 and list(r.json()) == ["error"], r.text
        r = http.post("/api/chat", json={"model": "m", "messages": [USER], "stream": False},
                      headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["message"]["content"] == "Hi"


def test_model_info_counts_quantized_weights(server, tmp_path_factory, monkeypatch):
    """``/api/tags``' details of the demo model quantized to 4 bits: the same parameter count as the float model
    (packed values counted as values), ``Q4``, fewer bytes."""
    monkeypatch.setenv("KIMI_MLX_HOME", str(tmp_path_factory.getbasetemp() / "kimi-mlx-home"))
    full = describe_model(load("demo")[0], "demo")
    q4 = describe_model(load("demo", quantize=4)[0], "demo")
    assert (full.quantization, q4.quantization) == ("F32", "Q4") and q4.parameter_count == full.parameter_count
    assert q4.size < full.size / 4 and full.family == q4.family == "kimi_linear"
    assert full.size == ollama.Client(host=server.base).list().models[0].size


@pytest.mark.parametrize("on_submit", [True, False], ids=["route-raises", "engine-error"])
def test_internal_failures_are_ollama_errors(k3_tok, on_submit):
    """A failure that is not the client's: a 500 ``{"error": ...}`` with a fixed message, or (streamed) an error
    line the client raises; never the exception's text."""
    backend = Backend(FailingEngine(on_submit), k3_tok, "kimi_k3", len(k3_tok), 4096)
    message = INTERNAL_ERROR if on_submit else GENERATION_FAILED
    with TestClient(create_app(backend, model_id="m"), raise_server_exceptions=False) as http:
        r = http.post("/api/chat", json={"model": "m", "messages": [USER], "stream": False})
        assert r.status_code == 500 and r.json() == {"error": message}
        r = http.post("/api/generate", json={"model": "m", "prompt": "x"})
        if on_submit:
            assert r.status_code == 500 and r.json() == {"error": message}
        else:
            assert r.status_code == 200 and json.loads(r.text.splitlines()[-1]) == {"error": message}
        assert SECRET not in r.text


def test_tool_results_pair_by_tool_name(ol, oai):
    """Two calls answered out of order, each result naming its tool (``tool_name``): paired with their calls and
    rendered in call order, as Chat Completions renders the same results by ``tool_call_id``."""
    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
             {"function": {"name": "get_time", "arguments": {"city": "Paris"}}}]
    history = [{"role": "user", "content": "Weather and time in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": calls},
               {"role": "tool", "tool_name": "get_time", "content": "10:00"},
               {"role": "tool", "tool_name": "get_weather", "content": "Sunny"}]
    openai_history = [history[0],
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"id": f"c{n}", "type": "function", "function": {
                              "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                          for n, c in enumerate(calls)]},
                      {"role": "tool", "tool_call_id": "c1", "name": "get_time", "content": "10:00"},
                      {"role": "tool", "tool_call_id": "c0", "name": "get_weather", "content": "Sunny"}]
    ref = reference(oai, openai_history)
    r = ol.chat(model="demo", messages=history, options=GREEDY)
    assert r.prompt_eval_count == ref.usage.prompt_tokens and r.message.content == ref.choices[0].message.content
    in_order = [*history[:2], history[3], history[2]]
    assert ol.chat(model="demo", messages=in_order, options=GREEDY).message.content == r.message.content
