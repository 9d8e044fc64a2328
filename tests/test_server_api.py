"""``kimi-mlx serve --model demo`` as a real process, driven by the official ``openai`` and ``anthropic`` clients:
models, chat whole and streamed, completions from text and from token ids, log-probabilities, stop strings, a
tool-call round trip, Anthropic messages whole and streamed, count_tokens, prefix-cache reuse, and a client that
disconnects. The expected text is ``kimi_mlx.generate.stream_generate`` (greedy) on the same rendered prompt,
in this process.
"""

import time

import anthropic
import httpx2 as httpx
import openai
import pytest
from serve_helpers import Server

from kimi_mlx.chat.format import render_chat
from kimi_mlx.chat.parser import parse_reply
from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load

N = 12
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "kimi-mlx-home"


@pytest.fixture(scope="module")
def server(tmp_path_factory, home):
    with Server(["--model", "demo", "--max-tokens", str(N)], tmp_path_factory.mktemp("serve"), home) as s:
        yield s


@pytest.fixture(scope="module")
def ref(home):
    """The demo model and tokenizer in this process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMI_MLX_HOME", str(home))
        return load("demo")


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0)


def greedy(ref, prompt, n=N):
    """(text, tokens, chosen-token logprobs, finish reason) of greedy ``stream_generate`` on ``prompt``."""
    model, tok = ref
    text, tokens, lps = "", [], []
    for r in stream_generate(model, tok, prompt, n):
        text, tokens, lps = text + r.text, tokens + [r.token], lps + [r.logprobs[r.token].item()]
    return text, tokens, lps, r.finish_reason


def test_models(oai, server):
    assert [m.id for m in oai.models.list().data] == ["demo"]
    assert oai.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("other")
    assert "kimi-mlx serve: http://127.0.0.1" in server.log() and "model demo (kimi_linear format)" in server.log()


def test_chat_whole_and_streamed_equal_greedy(oai, ref, server):
    """The same greedy text whole and streamed; usage counts the rendered prompt and the reply; one log line per
    request."""
    prompt = render_chat(ref[1], CHAT)
    text, tokens, _, finish = greedy(ref, prompt)
    want = parse_reply(text, "kimi_linear").content
    r = oai.chat.completions.create(model="demo", messages=CHAT, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(tokens))
    chunks = list(oai.chat.completions.create(model="demo", messages=CHAT, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == finish and chunks[-1].usage.completion_tokens == len(tokens)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(prompt) - 1  # the prompt's snapshot
    assert f"POST /v1/chat/completions | prompt {len(prompt)} tok, {len(prompt) - 1} cached" in server.log()


def test_completions_text_ids_logprobs(oai, ref):
    """Completions from text and from token ids give the greedy text; the chosen token's logprob matches the
    reference and is the top one; streamed text is the same."""
    model, tok = ref
    prompt = tok.encode("Once upon a time")
    text, tokens, lps, finish = greedy(ref, prompt)
    r = oai.completions.create(model="demo", prompt="Once upon a time", max_tokens=N, logprobs=2)
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    got = r.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(lps, abs=1e-4)
    assert got.tokens == [tok.decode([t]) for t in tokens]
    for top, lp in zip(got.top_logprobs, got.token_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(lp, abs=1e-6)
    r = oai.completions.create(model="demo", prompt=prompt, max_tokens=N)
    assert r.choices[0].text == text and r.usage.prompt_tokens == len(prompt)
    streamed = oai.completions.create(model="demo", prompt=prompt, max_tokens=N, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_chat_logprobs(oai, ref):
    prompt = render_chat(ref[1], CHAT)
    _, tokens, lps, _ = greedy(ref, prompt)
    r = oai.chat.completions.create(model="demo", messages=CHAT, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(lps[: len(content)], abs=1e-4)
    assert len(content) in (len(tokens), len(tokens) - 1)  # the stop token has no entry
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)


def test_stop_strings(oai, claude, ref):
    """A stop string ends the text just before it (finish "stop", Anthropic "stop_sequence"); never part of it."""
    prompt = render_chat(ref[1], CHAT)
    text, _, _, _ = greedy(ref, prompt)
    cut = next(i for i in range(2, len(text) - 2) if text[i:i + 2] not in text[:i + 1])
    stop = text[cut:cut + 2]
    r = oai.chat.completions.create(model="demo", messages=CHAT, stop=[stop, "never-there"])
    assert r.choices[0].message.content == text[:cut] and r.choices[0].finish_reason == "stop"
    streamed = oai.chat.completions.create(model="demo", messages=CHAT, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text[:cut]
    m = claude.messages.create(model="demo", max_tokens=N, system="Be brief.", stop_sequences=[stop],
                               messages=[{"role": "user", "content": "Hello there"}])
    assert m.content[0].text == text[:cut] and m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_tool_round_trip(oai, claude, ref):
    """Tools declared, an assistant tool call and its result sent back (OpenAI and Anthropic shapes): the reply
    is the greedy text on the rendered round, and count_tokens is its length."""
    call = {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}
    messages = [{"role": "user", "content": "Weather in Tokyo?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "22C sunny"}]
    prompt = render_chat(ref[1], messages, tools=TOOLS)
    text, _, _, _ = greedy(ref, prompt)
    want = parse_reply(text, "kimi_linear")
    r = oai.chat.completions.create(model="demo", messages=messages, tools=TOOLS)
    assert r.usage.prompt_tokens == len(prompt) and r.choices[0].message.content == want.content

    tools = [{"name": "get_weather", "description": "Get weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    anthropic_messages = [
        {"role": "user", "content": "Weather in Tokyo?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call["id"], "name": "get_weather",
                                           "input": {"city": "Tokyo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "22C sunny"}]}]
    assert claude.messages.count_tokens(model="demo", tools=tools, messages=anthropic_messages).input_tokens \
        == len(prompt)
    m = claude.messages.create(model="demo", max_tokens=N, tools=tools, messages=anthropic_messages)
    assert m.content[0].text == want.content and m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt)


def test_anthropic_whole_and_streamed(claude, ref):
    prompt = render_chat(ref[1], CHAT)
    text, tokens, _, finish = greedy(ref, prompt)
    want = parse_reply(text, "kimi_linear").content
    kwargs = dict(model="demo", max_tokens=N, system="Be brief.", messages=[{"role": "user", "content": "Hello there"}])
    m = claude.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.stop_reason == ("max_tokens" if finish == "length" else "end_turn")
    assert m.usage.output_tokens == len(tokens)
    with claude.messages.stream(**kwargs) as stream:
        events = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert final.content[0].text == want and final.stop_reason == m.stop_reason
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events[1] == "content_block_start" and "content_block_stop" in events


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_disconnect_stops_the_generation(server, stream):
    """A client that goes away (a stream closed after its first event, or a whole reply given up on): its
    generation stops (the engine has nothing running soon after), well before its 20000 tokens, and the server
    keeps answering."""
    body = {"model": "demo", "prompt": "Tell me a long story", "max_tokens": 20000, "stream": stream,
            "logit_bias": {"257": -100, "258": -100}}  # no [EOS] / <|im_end|>: it would run its 20000 tokens
    if stream:
        with httpx.stream("POST", server.url + "/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    for _ in range(100):
        stats = httpx.get(server.base + "/health").json()["stats"]
        if stats["running"] == 0 and stats["prefilling"] == 0:
            break
        time.sleep(0.05)
    assert stats["running"] == 0, stats
    assert httpx.post(server.url + "/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
