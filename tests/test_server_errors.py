"""Bad requests against a real ``kimi-mlx serve`` (demo model, an API key, small limits): each gets the right 4xx
with an error body in the route's style (OpenAI's ``{"error": {...}}`` naming the field in ``param``,
Anthropic's ``{"type": "error", ...}`` on ``/v1/messages``), never a 500, and the server keeps answering; a full
queue gets 429 with ``Retry-After``. Values at the edges of what the APIs accept (seeds over the signed 64-bit
range, ``top_k`` past the vocabulary, integers written ``2.0``, penalties that leave no finite log-probability)
get a 200 whose body, whole or streamed, is strict JSON; a client that leaves while uploading is one log line;
``HEAD /health`` and ``/openapi.json`` answer.
"""

import json
import socket

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
DEEP = b'{"messages": ' + b"[" * 10000 + b"]" * 10000 + b"}"  # 10,000 levels: Python's json recursed out
VOCAB = 512  # the demo model's

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
    ("image to a text-only model", "/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"},
                                                 {"type": "image_url", "image_url": {"url": "x"}}]}]), AUTH, 400,
     "messages[0].content[1]"),
    ("image part without its url", "/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), AUTH, 400,
     "messages[0].content[0]"),
    ("audio part", "/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]), AUTH, 400,
     "messages[0].content[0]"),
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
    ("logit_bias key --5", "/chat/completions", chat(logit_bias={"--5": 5}), AUTH, 400, "logit_bias"),
    ("logit_bias key -5", "/chat/completions", chat(logit_bias={"-5": 5}), AUTH, 400, "logit_bias"),
    ("logit_bias key superscript two", "/chat/completions", chat(logit_bias={"\u00b2": 5}), AUTH, 400, "logit_bias"),
    ("logit_bias key 5000 digits", "/completions", {"prompt": "a", "logit_bias": {"1" * 5000: 5}}, AUTH, 400,
     "logit_bias"),
    ("seed 2**64", "/chat/completions", chat(seed=2**64), AUTH, 400, "seed"),
    ("seed 2**63", "/completions", {"prompt": "a", "seed": 2**63}, AUTH, 400, "seed"),
    ("seed below -2**63", "/chat/completions", chat(seed=-2**63 - 1), AUTH, 400, "seed"),
    ("max_tokens 2.5", "/chat/completions", chat(max_tokens=2.5), AUTH, 400, "max_tokens"),
    ("nested 10,000 deep: chat", "/chat/completions", DEEP, AUTH, 400, None),
    ("nested 10,000 deep: completions", "/completions", DEEP, AUTH, 400, None),
    ("json_schema without a schema", "/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), AUTH, 400,
     "response_format.json_schema.schema"),
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
     "response_format.type"),
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
    ("anthropic nested 10,000 deep", "/messages", DEEP, AUTH, 400, None),
    ("count_tokens nested 10,000 deep", "/messages/count_tokens", DEEP, AUTH, 400, None),
    ("anthropic max_tokens 1.5", "/messages", anth(max_tokens=1.5), AUTH, 400, "max_tokens"),
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


def test_text_only_model_refuses_images(server):
    """An image for a model without a vision tower: a 400 that says so, in either API."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    r = httpx.post(server.url + "/chat/completions", headers=AUTH,
                   json=chat(messages=[{"role": "user", "content": [image]}]))
    assert r.status_code == 400 and "this model takes no images (Kimi Linear is a text-only model" in r.text, r.text
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    r = httpx.post(server.url + "/messages", headers=AUTH, json=anth(messages=[{"role": "user", "content": [block]}]))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[0].content[0]: this model "
                                                                             "takes no images"), r.text


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


def strict_json(text: str):
    """``text`` as JSON, refusing NaN and Infinity (which Python's json module would take)."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def logprob_values(body: dict) -> list[float]:
    """Every log-probability in an OpenAI response or chunk (chat or completions shape)."""
    out = []
    for choice in body.get("choices", []):
        lp = choice.get("logprobs") or {}
        for entry in lp.get("content") or []:
            out += [entry["logprob"], *(t["logprob"] for t in entry["top_logprobs"])]
        out += lp.get("token_logprobs") or []
        for top in lp.get("top_logprobs") or []:
            out += list(top.values())
    return out


# (id, path, body): values the APIs accept; each must answer 200, whole and streamed, with strict JSON throughout
ACCEPTED = [
    ("seed -1", "/chat/completions", chat(seed=-1, temperature=1)),
    ("seed -2**63", "/completions", {"prompt": "a", "seed": -2**63, "temperature": 1, "max_tokens": 4}),
    ("seed 2**63-1", "/chat/completions", chat(seed=2**63 - 1, temperature=1)),
    ("top_k the vocabulary", "/chat/completions", chat(top_k=VOCAB, temperature=1)),
    ("top_k 10**23", "/completions", {"prompt": "a", "top_k": 10**23, "temperature": 1, "max_tokens": 4}),
    ("anthropic top_k 10**23", "/messages", anth(top_k=10**23, temperature=1)),
    ("anthropic top_k the vocabulary", "/messages", anth(top_k=VOCAB + 7, temperature=0.5)),
    ("completion logprobs, penalty 5e-324", "/completions",
     {"prompt": "Hello there", "logprobs": 3, "repetition_penalty": 5e-324, "max_tokens": 6}),
    ("chat logprobs, penalty 5e-324", "/chat/completions",
     chat(logprobs=True, top_logprobs=3, repetition_penalty=5e-324, max_tokens=6)),
    ("chat logprobs, bias -100", "/chat/completions",
     chat(logprobs=True, top_logprobs=20, logit_bias={str(i): -100 for i in range(0, VOCAB, 2)}, max_tokens=4)),
    ("response_format text with an extra key", "/chat/completions", chat(response_format={"type": "text", "x": 1})),
    ("integers written 2.0", "/chat/completions", chat(max_tokens=2.0, n=1.0, logprobs=True, top_logprobs=2.0)),
    ("max_completion_tokens 3.0", "/chat/completions", chat(max_completion_tokens=3.0)),
    ("completion ids and logprobs as 2.0", "/completions", {"prompt": [72.0, 105], "logprobs": 2.0, "max_tokens": 3}),
    ("anthropic max_tokens 4.0", "/messages", anth(max_tokens=4.0, top_k=5.0)),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name,path,body", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_edge_values(server, name, path, body, stream):
    """A 200 whose body (every SSE data line when streamed) is strict JSON without an error, log-probabilities
    within [-9999, 0]."""
    r = httpx.post(server.url + path, json={**body, "stream": stream}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        events = [strict_json(d) for d in data]
    else:
        events = [strict_json(r.text)]
    assert events and not any(e.get("type") == "error" or "error" in e for e in events), r.text
    lps = [lp for e in events for lp in logprob_values(e)]
    assert all(-9999 <= lp <= 0 for lp in lps), lps
    if "logprobs" in body:
        assert lps
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if not stream and max_tokens is not None:
        usage = events[0]["usage"]
        assert usage.get("completion_tokens", usage.get("output_tokens")) <= max_tokens
    assert httpx.get(server.url + "/models", headers=AUTH).status_code == 200


def test_health_head_and_openapi(server):
    """``HEAD /health`` answers like GET without a body; ``/openapi.json`` (no key needed) describes every route,
    with the request models as the bodies."""
    head = httpx.head(server.base + "/health")
    assert head.status_code == 200 and head.content == b""
    doc = httpx.get(server.base + "/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in doc["components"]["schemas"]
    chat_schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat_schema["required"] == ["messages"] and "seed" in chat_schema["properties"]
    assert doc["components"]["schemas"]["MessagesRequest"]["properties"]["model"]["enum"] == ["kimi-demo"]
    assert {"/v1/models", "/health"} <= set(doc["paths"])


def test_upload_abandoned_is_one_log_line(server):
    """A client that promises a body and leaves halfway: one log line, no traceback, no 500; still serving."""
    before = server.log()
    host, port = "127.0.0.1", server.port
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n" + b'{"messages": [')
    for _ in range(100):
        new = server.log()[len(before):]
        if "client disconnected" in new:
            break
        httpx.get(server.base + "/health")
    assert new.count("client disconnected while sending the request") == 1, new
    assert "Traceback" not in new and " 500 " not in new, new
    assert httpx.post(server.url + "/chat/completions", json=chat(), headers=AUTH).status_code == 200
