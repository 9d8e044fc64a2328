"""``kimi-mlx serve`` on the tiny Kimi-K3 checkpoint with the XTML chat format (tests/xtml_tokenizer.py), driven by
the official clients: reasoning (thinking on by default, off, by effort) returned as ``reasoning_content`` /
``reasoning`` and as Anthropic thinking blocks, a tool-call round trip (reasoning and typed arguments sent
back), and Anthropic ``thinking.budget_tokens`` ending the reasoning section. Expected: greedy ``stream_generate``
on the same rendered prompt in this process, parsed with ``parse_reply``.
"""

import anthropic
import httpx2 as httpx
import openai
import pytest
from conftest import K3_FIXTURE
from serve_helpers import Server
from xtml_tokenizer import write_xtml_tokenizer_dir

from kimi_mlx.chat.format import encode_segments, render_chat
from kimi_mlx.chat.format_k3 import XTML_MARKERS, close_tag, open_tag
from kimi_mlx.chat.parser import parse_reply
from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load

N = 10
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
USER = [{"role": "user", "content": "Is 123 a prime?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The K3 fixture's weights with the XTML tokenizer."""
    out = write_xtml_tokenizer_dir(tmp_path_factory.mktemp("k3"))
    (out / "model.safetensors").symlink_to(K3_FIXTURE / "hf" / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    flags = ["--model", str(model_dir), "--served-model-name", "k3", "--max-tokens", str(N)]
    with Server(flags, tmp_path_factory.mktemp("serve"), tmp_path_factory.getbasetemp() / "kimi-mlx-home") as s:
        yield s


@pytest.fixture(scope="module")
def ref(model_dir):
    return load(model_dir)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def expected(ref, messages, thinking=None, **render):
    """(prompt, parsed greedy reply) for ``messages`` rendered with ``render`` options."""
    model, tok = ref
    prompt = render_chat(tok, messages, thinking=thinking, **render)
    text = "".join(r.text for r in stream_generate(model, tok, prompt, N))
    return prompt, parse_reply(text, "kimi_k3", thinking=thinking)


def _reasoning(message) -> str:
    extra = message.model_extra or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")
    return extra.get("reasoning_content") or ""


@pytest.mark.parametrize("options,render", [
    ({}, {}),
    ({"extra_body": {"chat_template_kwargs": {"thinking": False}}}, {"thinking": False}),
    ({"reasoning_effort": "none"}, {"thinking": False}),
    ({"reasoning_effort": "low"}, {"thinking": True, "thinking_effort": "low"}),
    ({"extra_body": {"chat_template_kwargs": {"enable_thinking": True, "thinking_effort": "high"}}},
     {"thinking": True, "thinking_effort": "high"}),
], ids=["default", "thinking-off", "effort-none", "effort-low", "template-kwargs-high"])
def test_reasoning_whole_and_streamed(oai, ref, options, render):
    """K3 thinking as the request asks: the prompt is the one rendered with those options; reasoning and content
    are the parsed greedy reply, whole and streamed."""
    prompt, want = expected(ref, USER, **render)
    r = oai.chat.completions.create(model="k3", messages=USER, **options)
    assert r.usage.prompt_tokens == len(prompt)
    m = r.choices[0].message
    assert (_reasoning(m), m.content or "") == (want.reasoning, want.content)
    chunks = list(oai.chat.completions.create(model="k3", messages=USER, stream=True, **options))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(_reasoning(d) for d in deltas) == want.reasoning
    assert "".join(d.content or "" for d in deltas) == want.content


def test_tool_round_trip(oai, ref, server):
    """A tool round in K3 format: the assistant's reasoning and its call (arguments as a JSON string, as OpenAI
    clients send them) and the tool result are rendered as K3 expects (typed arguments), the reply is the greedy
    one, and the Anthropic shape of the same conversation renders the same prompt and reply."""
    call = {"id": "functions.get_weather:1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}
    sent = [*USER, {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "22C sunny"}]
    rendered = [*USER, {**sent[1], "tool_calls": [{**call, "function": {"name": "get_weather",
                                                                       "arguments": {"city": "Tokyo"}}}]}, sent[2]]
    prompt, want = expected(ref, rendered, tools=TOOLS)
    r = oai.chat.completions.create(model="k3", messages=sent, tools=TOOLS)
    assert r.usage.prompt_tokens == len(prompt)
    assert (_reasoning(r.choices[0].message), r.choices[0].message.content or "") == (want.reasoning, want.content)

    claude = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0)
    tools = [{"name": "get_weather", "description": "Get weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages = [
        {"role": "user", "content": USER[0]["content"]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
            {"type": "tool_use", "id": call["id"], "name": "get_weather", "input": {"city": "Tokyo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "22C sunny"}]}]
    assert claude.messages.count_tokens(model="k3", tools=tools, messages=messages).input_tokens == len(prompt)
    msg = claude.messages.create(model="k3", max_tokens=N, tools=tools, messages=messages)
    thinking = "".join(b.thinking for b in msg.content if b.type == "thinking")
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert (thinking, text) == (want.reasoning, want.content)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(prompt)


def test_anthropic_thinking_blocks(server, ref):
    """Anthropic: thinking on by default for K3 (thinking blocks), off with ``thinking: disabled``; whole and
    streamed agree."""
    claude = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": USER[0]["content"]}]
    for thinking, render in ((None, None), ({"type": "disabled"}, False), ({"type": "enabled", "budget_tokens": 2048},
                                                                           True)):
        _, want = expected(ref, USER, thinking=render)
        extra = {} if thinking is None else {"thinking": thinking}
        msg = claude.messages.create(model="k3", max_tokens=N, messages=messages, **extra)
        got = ("".join(b.thinking for b in msg.content if b.type == "thinking"),
               "".join(b.text for b in msg.content if b.type == "text"))
        assert got == (want.reasoning, want.content)
        assert (msg.content[0].type == "thinking") == bool(want.reasoning)
        with claude.messages.stream(model="k3", max_tokens=N, messages=messages, **extra) as stream:
            final = stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]


def test_deeply_nested_string_arguments_are_a_400(server):
    """Tool-call arguments sent as a JSON string, which K3's renderer parses: nested 10,000 deep, they are a 400
    naming ``messages`` (not a RecursionError 500), and the server keeps serving."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "[" * 10000}}
    body = {"model": "k3", "messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [call]},
                                        {"role": "tool", "tool_call_id": "c1", "content": "x"}]}
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert httpx.get(server.base + "/health").status_code == 200


def test_anthropic_thinking_budget(server, ref):
    """``thinking.budget_tokens`` B: the reply reasons for the B greedy tokens, then carries K3's closer
    (``<|close|>think<|sep|><|open|>response<|sep|>``) and answers with the greedy continuation after it, whole and
    streamed; the same request with a budget the reply never reaches reasons for more than B tokens."""
    model, tok = ref
    budget, answer_tokens = 3, 4
    prompt = render_chat(tok, USER, thinking=True)
    reasoning = [r.token for r in stream_generate(model, tok, prompt, budget)]
    assert not {tok.special_tokens[m] for m in XTML_MARKERS} & set(reasoning)  # the model stays in the section
    closer = encode_segments(close_tag("think") + open_tag("response"), tok)
    answer = [r.token for r in stream_generate(model, tok, prompt + reasoning + closer, answer_tokens)]
    detok = tok.detokenizer
    for t in reasoning + closer + answer:
        if t not in tok.eos_token_ids:
            detok.add_token(t)
    detok.finalize()
    want = parse_reply(detok.text, "kimi_k3", thinking=True)
    assert want.reasoning and want.content  # B tokens of reasoning, then an answer

    claude = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0)
    request = {"model": "k3", "max_tokens": budget + len(closer) + answer_tokens, "messages": USER}
    msg = claude.messages.create(**request, thinking={"type": "enabled", "budget_tokens": budget})
    got = ("".join(b.thinking for b in msg.content if b.type == "thinking"),
           "".join(b.text for b in msg.content if b.type == "text"))
    assert got == (want.reasoning, want.content)
    assert msg.usage.output_tokens == len(reasoning + closer + answer)
    with claude.messages.stream(**request, thinking={"type": "enabled", "budget_tokens": budget}) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    unbounded = claude.messages.create(**request, thinking={"type": "enabled", "budget_tokens": 1024})
    thinking = "".join(b.thinking for b in unbounded.content if b.type == "thinking")
    assert thinking.startswith(want.reasoning) and len(thinking) > len(want.reasoning)
