"""Bad requests against a real ``kimi-mlx serve`` (demo model, an API key, small limits): each gets the right 4xx
with an error body in the route's style (OpenAI's ``{"error": {...}}`` naming the field in ``param``,
Anthropic's ``{"type": "error", ...}`` on ``/v1/messages``), never a 500, and the server keeps answering; a full
queue gets 429 with ``Retry-After``.
"""

import json

import httpx2 as httpx
import openai
import pytest
from serve_helpers import Server

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 2048  # --max-kv-size
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--model", "demo", "--api-key", KEY, "--served-model-name", "kimi-demo", "--max-body-mb", "0.02",
             "--max-kv-size", str(CONTEXT), "--max-batch", "1", "--max-queue", "0", "--max-tokens", "8"]
    home = tmp_path_factory.getbasetemp() / "kimi-mlx-home"
    with Server(flags, tmp_path_factory.mktemp("serve"), home) as s:
        yield s


def chat(**fields):
    return {"model": "kimi-demo", "messages": MSG, **fields}


def anth(**fields):
    return {"model": "kimi-demo", "max_tokens": 8, "messages": MSG, **fields}


def chunked(data: bytes):
    """A body sent with chunked transfer encoding (no Content-Length)."""
    for i in range(0, len(data), 4096):
        yield data[i:i + 4096]


BIG = json.dumps(chat(messages=[{"role": "user", "content": "x" * 30000}])).encode()

# (id, path, body (dict: JSON, bytes: raw, callable: chunked), headers, status, param the error names)
CASES = [
    ("no key", "/chat/completions", chat(), {}, 401, None),
    ("wrong key", "/chat/completions", chat(), {"Authorization": "Bearer nope"}, 401, None),
    ("wrong x-api-key", "/messages", anth(), {"x-api-key": "nope"}, 401, None),
    ("bad json", "/chat/completions", b'{"messages": [', AUTH, 400, None),
    ("invalid utf-8", "/chat/completions", b'{"messages": "\xff\xfe"}', AUTH, 400, None),
    ("json array", "/chat/completions", b"[1, 2]", AUTH, 400, None),
    ("NaN", "/chat/completions", b'{"messages": [], "temperature": NaN}', AUTH, 400, None),
    ("no messages", "/chat/completions", {"model": "kimi-demo"}, AUTH, 400, "messages"),
    ("messages not a list", "/chat/completions", chat(messages="Hi"), AUTH, 400, "messages"),
    ("empty messages", "/chat/completions", chat(messages=[]), AUTH, 400, "messages"),
    ("unknown role", "/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), AUTH, 400,
     "messages[0].role"),
    ("tool message without id", "/chat/completions",
     chat(messages=[*MSG, {"role": "tool", "content": "22C"}]), AUTH, 400, "messages[1].tool_call_id"),
    ("content a number", "/chat/completions", chat(messages=[{"role": "user", "content": 5}]), AUTH, 400,
     "messages[0].content"),
    ("image part", "/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), AUTH, 400,
     "messages[0].content"),
    ("tool calls on a user message", "/chat/completions",
     chat(messages=[{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]), AUTH, 400,
     "messages[0].tool_calls"),
    ("negative max_tokens", "/chat/completions", chat(max_tokens=-5), AUTH, 400, "max_tokens"),
    ("huge max_tokens", "/chat/completions", chat(max_tokens=10**9), AUTH, 400, "max_tokens"),
    ("max_tokens a string", "/chat/completions", chat(max_tokens="8"), AUTH, 400, "max_tokens"),
    ("huge max_completion_tokens", "/chat/completions", chat(max_completion_tokens=CONTEXT), AUTH, 400,
     "max_completion_tokens"),
    ("temperature a string", "/chat/completions", chat(temperature="hot"), AUTH, 400, "temperature"),
    ("temperature 5", "/chat/completions", chat(temperature=5), AUTH, 400, "temperature"),
    ("top_p 2", "/chat/completions", chat(top_p=2), AUTH, 400, "top_p"),
    ("n=2", "/chat/completions", chat(n=2), AUTH, 400, "n"),
    ("stream a string", "/chat/completions", chat(stream="yes"), AUTH, 400, "stream"),
    ("stop numbers", "/chat/completions", chat(stop=[1, 2]), AUTH, 400, "stop"),
    ("logit_bias not an id", "/chat/completions", chat(logit_bias={"hello": 5}), AUTH, 400, "logit_bias"),
    ("logit_bias outside vocab", "/chat/completions", chat(logit_bias={"99999": 5}), AUTH, 400, "logit_bias"),
    ("top_logprobs without logprobs", "/chat/completions", chat(top_logprobs=2), AUTH, 400, "top_logprobs"),
    ("top_logprobs 50", "/chat/completions", chat(logprobs=True, top_logprobs=50), AUTH, 400, "top_logprobs"),
    ("tool without a name", "/chat/completions", chat(tools=[{"type": "function", "function": {}}]), AUTH, 400,
     "tools[0].function.name"),
    ("tool_choice required on Kimi Linear", "/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"), AUTH, 400,
     "tool_choice"),
    ("reasoning_effort on Kimi Linear", "/chat/completions", chat(reasoning_effort="high"), AUTH, 400,
     "reasoning_effort"),
    ("unknown template kwarg", "/chat/completions", chat(chat_template_kwargs={"foo": True}), AUTH, 400,
     "chat_template_kwargs"),
    ("json mode on Kimi Linear", "/chat/completions", chat(response_format={"type": "json_object"}), AUTH, 400,
     "response_format"),
    ("unknown response_format", "/chat/completions", chat(response_format={"type": "yaml"}), AUTH, 400,
     "response_format"),
    ("unknown model", "/chat/completions", chat(model="gpt-5"), AUTH, 404, "model"),
    ("prompt over the context", "/chat/completions", chat(messages=[{"role": "user", "content": "x" * CONTEXT}]), AUTH,
     400, "messages"),
    ("oversize body", "/chat/completions", BIG, AUTH, 413, None),
    ("oversize chunked body", "/chat/completions", lambda: chunked(BIG), AUTH, 413, None),
    ("ids outside the vocabulary", "/completions", {"prompt": [1, 2, 99999]}, AUTH, 400, "prompt"),
    ("negative id", "/completions", {"prompt": [5, -1]}, AUTH, 400, "prompt"),
    ("empty text prompt", "/completions", {"prompt": ""}, AUTH, 400, "prompt"),
    ("batched prompts", "/completions", {"prompt": ["a", "b"]}, AUTH, 400, "prompt"),
    ("prompt a dict", "/completions", {"prompt": {"text": "a"}}, AUTH, 400, "prompt"),
    ("echo", "/completions", {"prompt": "a", "echo": True}, AUTH, 400, "echo"),
    ("completion over the context", "/completions", {"prompt": list(range(60, 124)) * (CONTEXT // 64)}, AUTH, 400,
     "prompt"),
    ("anthropic no max_tokens", "/messages", {"model": "kimi-demo", "messages": MSG}, AUTH, 400, "max_tokens"),
    ("anthropic system role", "/messages", anth(messages=[{"role": "system", "content": "x"}]), AUTH, 400,
     "messages[0].role"),
    ("anthropic image block", "/messages",
     anth(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), AUTH, 400,
     "messages[0].content"),
    ("anthropic tool_result without id", "/messages",
     anth(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]), AUTH, 400,
     "messages[0].content"),
    ("anthropic temperature 1.5", "/messages", anth(temperature=1.5), AUTH, 400, "temperature"),
    ("anthropic thinking on Kimi Linear", "/messages", anth(thinking={"type": "enabled", "budget_tokens": 1024}),
     AUTH, 400, "thinking"),
    ("anthropic unknown model", "/messages", anth(model="claude-opus"), AUTH, 404, "model"),
    ("anthropic bad json", "/messages", b"{", AUTH, 400, None),
    ("count_tokens without messages", "/messages/count_tokens", {"model": "kimi-demo"}, AUTH, 400, "messages"),
    ("unknown route", "/embeddings", {"input": "x"}, AUTH, 404, None),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, name, path, body, headers, status, param):
    kwargs = {"json": body} if isinstance(body, dict) else {"content": body() if callable(body) else body}
    r = httpx.post(server.url + path, headers=headers, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()
    if path.startswith("/messages"):
        assert err["type"] == "error" and err["error"]["type"]
    else:
        assert err["error"]["type"] and err["error"]["param"] == param
    assert err["error"]["message"].startswith(param or "")
    assert httpx.get(server.url + "/models", headers=AUTH).status_code == 200  # still serving


def test_explicit_nulls_are_defaults(server):
    """``null`` for an optional field means the default (clients send them)."""
    nulls = {k: None for k in ("temperature", "top_p", "max_tokens", "stop", "n", "stream", "stream_options",
                               "logprobs", "top_logprobs", "seed", "tools", "tool_choice", "response_format",
                               "logit_bias", "reasoning_effort", "chat_template_kwargs")}
    r = httpx.post(server.url + "/chat/completions", json=chat(**nulls), headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = httpx.post(server.url + "/completions", json={"prompt": "Hi", "echo": None, "logprobs": None}, headers=AUTH)
    assert r.status_code == 200
    r = httpx.post(server.url + "/messages", json=anth(stream=None, stop_sequences=None, system=None), headers=AUTH)
    assert r.status_code == 200


def test_method_and_model_routes(server):
    assert httpx.get(server.url + "/chat/completions", headers=AUTH).status_code == 405
    assert httpx.get(server.url + "/models").status_code == 401
    assert httpx.get(server.base + "/health").status_code == 200  # no key needed
    assert httpx.get(server.url + "/models/kimi-demo", headers=AUTH).json()["id"] == "kimi-demo"
    assert httpx.get(server.url + "/models/demo", headers=AUTH).status_code == 404


def test_queue_full_then_serving(server):
    """With one slot and no queue, a second request while the first streams gets 429 and Retry-After (the openai
    client raises RateLimitError); once the first is gone the server answers again, with the right key in either
    header."""
    client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    body = chat(max_tokens=CONTEXT - 40, stream=True, logit_bias={"257": -100, "258": -100})
    with httpx.stream("POST", server.url + "/chat/completions", json=body, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()  # kept open: closing the iterator would close the stream
        next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
        second = httpx.post(server.url + "/chat/completions", json=chat(), headers=AUTH)
        assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
        assert second.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="kimi-demo", messages=MSG)
    for _ in range(100):
        r = httpx.post(server.url + "/chat/completions", json=chat(), headers=AUTH)
        if r.status_code != 429:
            break
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    r = httpx.post(server.url + "/messages", json=anth(), headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text"
    assert "Traceback" not in server.log()
