"""Tool-call ids (``kimi_mlx.chat.tool_ids``): the template's ``functions.{name}:{n}`` ids, the ids clients send back,
tool results put back in call order, and what cannot be paired refused.

- ``in_call_order`` on hand-made conversations (client ids, template ids, none; out of order; the refusals), and on
  every order of a three-call round: rendered, the conversation equals the Kimi Linear template's rendering of the
  in-order conversation (``chat_references.py``).
- The server in-process on a scripted model (the app and the official ``openai`` / ``anthropic`` clients; the model
  replays a reply with two tool calls): the client sees the template's ids, sends them (or its own ids) back in any
  order, and the prompt the model gets is the template's string for the in-order conversation; unpairable results
  are a 400 naming the id.
- ``kimi-mlx serve --model demo`` as a real process and the official client: a history carrying the client's own ids
  with results out of call order; the reply's log-probabilities equal greedy generation in this process on the
  template's prompt (and differ from those on the prompt a server that kept the client's order would build).
- ``ChatSession.tool_results`` in any order writes them in call order; a K3 session renders JSON-string arguments
  as Moonshot's encoder does.
"""

import itertools
import json
import re

import anthropic
import openai
import pytest
from chat_references import encoder_ids, k2_reference, k3_reference
from conftest import K3_FIXTURE, KL_FIXTURE
from fastapi.testclient import TestClient
from serve_helpers import Server
from test_server_app import ScriptedEngine
from xtml_tokenizer import write_xtml_tokenizer_dir

from kimi_mlx.chat.format import render_chat, render_chat_text
from kimi_mlx.chat.session import ChatSession
from kimi_mlx.chat.tokenizer import load_kimi_tokenizer
from kimi_mlx.chat.tool_ids import in_call_order, tool_call_ids
from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load
from kimi_mlx.server.app import create_app
from kimi_mlx.server.backend import Backend

N = 8
TOOLS = [{"type": "function", "function": {"name": name, "description": f"Get the {what} of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}
         for name, what in (("get_weather", "weather"), ("get_time", "time"), ("get_news", "news"))]
SYSTEM = {"role": "system", "content": "Use the tools."}
USER = {"role": "user", "content": "Weather, time and news in Tokyo?"}


def call(name: str, city: str = "Tokyo", cid: str | None = None) -> dict:
    out = {"type": "function", "function": {"name": name, "arguments": json.dumps({"city": city})}}
    if cid is not None:
        out["id"] = cid
    return out


def result(cid, content: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": content}


ROUND = [SYSTEM, USER, {"role": "assistant", "content": "", "tool_calls": [
    call("get_weather", cid="call_w"), call("get_time", cid="call_t"), call("get_news", cid="call_n")]}]
ANSWERS = {"call_w": "22C", "call_t": "09:00", "call_n": "quiet"}


# ----------------------------------------------------------------------------------------------- in_call_order


def test_tool_call_ids_count_across_the_conversation():
    messages = [*ROUND, *(result(c, a) for c, a in ANSWERS.items()),
                {"role": "assistant", "tool_calls": [call("get_weather", "Paris")]}]
    ids = tool_call_ids(messages)
    assert [(c.message, c.position, c.template_id, c.client_id) for c in ids] == [
        (2, 0, "functions.get_weather:0", "call_w"), (2, 1, "functions.get_time:1", "call_t"),
        (2, 2, "functions.get_news:2", "call_n"), (6, 0, "functions.get_weather:3", None)]


@pytest.mark.parametrize("order", list(itertools.permutations(ANSWERS)), ids="-".join)
@pytest.mark.parametrize("by", ["client ids", "template ids", "mixed"])
def test_results_in_any_order_render_as_the_template_in_call_order(order, by):
    """Every order of a three-call round's results, named by the client's ids, by the template's (the ids the server
    hands out) or a mix: put in call order, the conversation renders as the template renders the in-order one."""
    template_id = {"call_w": "functions.get_weather:0", "call_t": "functions.get_time:1",
                   "call_n": "functions.get_news:2"}
    name = {"client ids": lambda c: c, "template ids": template_id.get,
            "mixed": lambda c: c if c == "call_t" else template_id[c]}[by]
    messages = [*ROUND, *(result(name(c), ANSWERS[c]) for c in order)]
    ordered = in_call_order(messages)
    assert [m["content"] for m in ordered[3:]] == ["22C", "09:00", "quiet"]
    assert ordered[:3] == messages[:3] and all(any(m is o for o in messages) for m in ordered)  # not copied
    reference = k2_reference([*ROUND, *(result(c, ANSWERS[c]) for c in ANSWERS)], TOOLS)
    assert render_chat_text(None, ordered, tools=TOOLS, chat_format="kimi_linear") == reference
    assert "## Return of functions.get_time:1\n09:00<|im_end|>" in reference


def test_unpairable_results_are_refused_naming_the_ids():
    answered = [result(c, a) for c, a in ANSWERS.items()]
    cases = [
        ([*ROUND, result("call_x", "?"), *answered[1:]], "'call_x' names none of the tool calls"),
        ([*ROUND, *answered, result("call_w", "again")], "two tool results answer the tool call 'call_w'"),
        ([*ROUND, *answered[:2]], "'call_n' (functions.get_news:2) have no result"),
        ([*ROUND, *answered[:2], USER, answered[2]], "'call_n' (functions.get_news:2) have no result"),
        ([*ROUND, USER], "'call_w' (functions.get_weather:0), 'call_t' (functions.get_time:1), 'call_n'"),
        (ROUND, "have no result"),
        ([*ROUND, *answered, {"role": "tool", "content": "extra"}], "tool result 4 of 4 answers no call"),
    ]
    for messages, match in cases:
        with pytest.raises(ValueError, match=re.escape(match)):
            in_call_order(messages)


def test_what_the_templates_pair_by_themselves_is_left_alone():
    """A result that follows no call (the template's ``functions.{name}:{n}``) and results without ids (paired by
    position) are left as they are; ``complete=False`` allows calls still waiting for their results."""
    orphan = [SYSTEM, USER, {"role": "tool", "name": "get_weather", "content": "22C"}]
    assert in_call_order(orphan) == orphan
    positional = [*ROUND, *({"role": "tool", "content": a} for a in ANSWERS.values())]
    assert in_call_order(positional) == positional
    partial = [*ROUND, result("call_t", "09:00"), result("call_w", "22C")]
    assert [m["content"] for m in in_call_order(partial, complete=False)[3:]] == ["22C", "09:00"]


# ----------------------------------------------------------------------------------------------- the server, scripted


@pytest.fixture(scope="module")
def kltok():
    return load_kimi_tokenizer(KL_FIXTURE / "hf")


TWO_CALLS = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "functions.get_weather:0", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}},
    {"id": "functions.get_time:1", "type": "function",
     "function": {"name": "get_time", "arguments": '{"city": "Tokyo"}'}}]}


def scripted_app(tok):
    """The app on a model that answers every request with TWO_CALLS (as the model writes them after [SYSTEM, USER])."""
    prompt = render_chat(tok, [SYSTEM, USER], tools=TOOLS)
    full = render_chat(tok, [SYSTEM, USER, TWO_CALLS], tools=TOOLS, add_generation_prompt=False)
    engine = ScriptedEngine(full[len(prompt):])
    return create_app(Backend(engine, tok, "kimi_linear", vocab_size=len(tok), max_context=4096), model_id="m"), engine


def template_prompt(tok, messages) -> list[int]:
    """The template's string for ``messages`` (in call order), encoded with the fixture tokenizer's specials."""
    return tok.encode(k2_reference(messages, TOOLS), allowed_special="all")


def test_openai_client_round_trips_the_template_ids(kltok):
    """The client sees the model's ``functions.{name}:{n}`` ids, answers with them out of order, then (after a
    second round, where the scripted model repeats ``:0``/``:1``) with its own ids out of order: each prompt the
    model gets is the template's string for the in-order conversation, with the template's ids (``:2``, ``:3`` in
    round two) and never the client's."""
    app, engine = scripted_app(kltok)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        r = client.chat.completions.create(model="m", messages=[SYSTEM, USER], tools=TOOLS)
        assert [c.id for c in r.choices[0].message.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]
        reply = r.choices[0].message.model_dump(exclude_none=True)
        history = [SYSTEM, USER, reply, result("functions.get_time:1", "09:00"),
                   result("functions.get_weather:0", "22C")]
        r2 = client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        expected = [SYSTEM, USER, TWO_CALLS, result(None, "22C"), result(None, "09:00")]
        assert engine.requests[-1].tokens == template_prompt(kltok, expected)

        reply2 = r2.choices[0].message.model_dump(exclude_none=True)
        assert [c["id"] for c in reply2["tool_calls"]] == ["functions.get_weather:0", "functions.get_time:1"]
        history2 = [*history, reply2, result("functions.get_time:1", "10:00"), result("functions.get_weather:0", "23C")]
        client.chat.completions.create(model="m", messages=history2, tools=TOOLS)
        expected2 = [*expected, TWO_CALLS, result(None, "23C"), result(None, "10:00")]
        prompt = engine.requests[-1].tokens
        assert prompt == template_prompt(kltok, expected2)
        text = kltok.decode(prompt)
        assert "## Return of functions.get_weather:2\n23C<|im_end|><|im_system|>tool<|im_middle|>## Return of " \
               "functions.get_time:3\n10:00" in text

        # a client that keeps its own ids (say, from another provider) and answers out of order
        mine = json.loads(json.dumps(history2).replace('"functions.get_weather:0"', '"call_A"')
                          .replace('"functions.get_time:1"', '"call_B"'))
        assert "functions." not in json.dumps([m.get("tool_call_id") for m in mine])
        client.chat.completions.create(model="m", messages=mine, tools=TOOLS)
        assert engine.requests[-1].tokens == prompt and "call_A" not in kltok.decode(engine.requests[-1].tokens)

        with pytest.raises(openai.BadRequestError, match="'call_Z' names none of the tool calls"):
            client.chat.completions.create(model="m", messages=[*history[:3], result("call_Z", "?")], tools=TOOLS)
        with pytest.raises(openai.BadRequestError, match=re.escape("'functions.get_weather:0' (functions.get_weat")):
            client.chat.completions.create(model="m", messages=history[:4] + [USER], tools=TOOLS)


def test_anthropic_client_tool_use_ids(kltok):
    """Anthropic ``tool_use`` / ``tool_result`` blocks with the client's own ids, results out of order: the model gets
    the template's prompt; count_tokens counts it."""
    app, engine = scripted_app(kltok)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    messages = [
        {"role": "user", "content": USER["content"]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_w", "name": "get_weather", "input": {"city": "Tokyo"}},
            {"type": "tool_use", "id": "toolu_t", "name": "get_time", "input": {"city": "Tokyo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_t", "content": "09:00"},
                                     {"type": "tool_result", "tool_use_id": "toolu_w", "content": "22C"}]}]
    with TestClient(app) as http:
        client = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http, max_retries=0)
        msg = client.messages.create(model="m", max_tokens=200, system=SYSTEM["content"], tools=tools,
                                     messages=messages)
        ids = [b.id for b in msg.content if b.type == "tool_use"]
        assert ids == [f"toolu_{msg.id.removeprefix('msg_')}_{n}" for n in range(2)]  # Anthropic's id pattern
        assert all(re.fullmatch(r"[a-zA-Z0-9_-]+", i) for i in ids)
        want = template_prompt(kltok, [SYSTEM, USER, TWO_CALLS, result(None, "22C"), result(None, "09:00")])
        assert engine.requests[-1].tokens == want
        count = client.messages.count_tokens(model="m", system=SYSTEM["content"], tools=tools, messages=messages)
        assert count.input_tokens == len(want)


# ----------------------------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "kimi-mlx-home"


@pytest.fixture(scope="module")
def demo(home):
    """The demo model and tokenizer in this process (made here first, so the server only loads it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMI_MLX_HOME", str(home))
        return load("demo")


@pytest.fixture(scope="module")
def server(tmp_path_factory, home, demo):
    with Server(["--model", "demo", "--max-tokens", str(N)], tmp_path_factory.mktemp("serve"), home) as s:
        yield s


def greedy_logprobs(demo, prompt) -> list[float]:
    model, tok = demo
    return [r.logprobs[r.token].item() for r in stream_generate(model, tok, prompt, N)]


def test_real_server_renders_the_template_ids_in_call_order(server, demo):
    """A client history with its own ids and results out of call order, sent with the official client to
    ``kimi-mlx serve``: the model got the template's prompt for the in-order conversation (the reply's logprobs are
    greedy generation's on it, not on the prompt of a server that kept the client's order)."""
    _, tok = demo
    messages = [*ROUND, result("call_n", "quiet"), result("call_w", "22C"), result("call_t", "09:00")]
    ordered = [*ROUND, result("call_w", "22C"), result("call_t", "09:00"), result("call_n", "quiet")]
    prompt = render_chat(tok, ordered, tools=TOOLS)
    assert prompt == tok.encode(k2_reference(ordered, TOOLS), allowed_special="all")
    assert "## Return of functions.get_weather:0\n22C" in tok.decode(prompt) and "call_w" not in tok.decode(prompt)
    client_order = render_chat(tok, messages, tools=TOOLS)  # positional pairing: each result under another call
    assert client_order != prompt

    oai = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    r = oai.chat.completions.create(model="demo", messages=messages, tools=TOOLS, temperature=0, max_tokens=N,
                                    logprobs=True)
    assert r.usage.prompt_tokens == len(prompt)
    got = [c.logprob for c in r.choices[0].logprobs.content]
    want = greedy_logprobs(demo, prompt)
    assert got == pytest.approx(want[: len(got)], abs=1e-4)
    assert got != pytest.approx(greedy_logprobs(demo, client_order)[: len(got)], abs=1e-3)


# ----------------------------------------------------------------------------------------------- ChatSession


def test_session_tool_results_in_call_order(demo):
    """``tool_results`` given out of order are written in the last reply's call order (the template pairs by
    position); a call the last reply did not make is refused before anything changes."""
    model, tok = demo
    s = ChatSession(model, tok, system=SYSTEM["content"], tools=TOOLS, max_tokens=N)
    list(s.send(USER["content"]))
    s.messages[-1] = TWO_CALLS
    weather, time_ = TWO_CALLS["tool_calls"]
    with pytest.raises(ValueError, match="'functions.get_news:9' names none"):
        s.tool_results([(weather, "22C"), ({**time_, "id": "functions.get_news:9"}, "?")])
    assert s.messages[-1] is TWO_CALLS
    list(s.tool_results([(time_, "09:00"), (weather, "22C")]))
    assert [m.get("content") for m in s.messages[2:4]] == ["22C", "09:00"]
    conversation = s.conversation()
    assert render_chat(tok, conversation, tools=TOOLS) == tok.encode(k2_reference(conversation, TOOLS),
                                                                     allowed_special="all")


def test_k3_session_renders_string_arguments_as_the_encoder(tmp_path):
    """A K3 session whose history holds a tool call with JSON-string arguments (as an OpenAI client keeps it)
    renders it as Moonshot's encoder does: typed arguments, ids segment by segment."""
    model_dir = write_xtml_tokenizer_dir(tmp_path)
    (model_dir / "model.safetensors").symlink_to(K3_FIXTURE / "hf" / "model.safetensors")
    model, tok = load(model_dir)
    s = ChatSession(model, tok, system=SYSTEM["content"], tools=TOOLS[:1], thinking_effort="high")
    s.messages = [USER, {**TWO_CALLS, "reasoning_content": "Both.", "tool_calls": TWO_CALLS["tool_calls"][:1]},
                  result("functions.get_weather:0", "22C")]
    segments = k3_reference(s.conversation(), TOOLS[:1], thinking=True, thinking_effort="high")
    assert s.render() == encoder_ids(segments, tok)
    assert '<|open|>argument key="city" type="string"<|sep|>Tokyo' in "".join(x.text for x in segments)
