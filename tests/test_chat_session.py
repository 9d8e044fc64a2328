"""ChatSession: cache reuse across turns, regenerate/undo through checkpoints, interruption, context limit, save/load.

The reference for every reply is greedy generation on a fresh cache from the whole conversation rendered by
``render_chat`` (what a stateless client would do). The demo model's greedy text barely depends on the context, so
after every rollback (regenerate, undo, interruption, changed system prompt, tool round, load) the session's cache
arrays are also compared with a fresh prefill of the session's tokens.
"""

import mlx.core as mx
import pytest
from xtml_tokenizer import load_xtml_tokenizer

from kimi_mlx import load
from kimi_mlx.cache import KDACache
from kimi_mlx.chat.format import render_chat
from kimi_mlx.chat.session import ChatSession, ContextFullError
from kimi_mlx.generate import stream_generate
from kimi_mlx.prompt_cache import PromptCacheError, save_prompt_cache

N = 12  # reply length (the demo model rarely stops by itself)
# Cache arrays of a session (prefill chunks + decode steps) vs one fresh prefill of the same tokens: float32 noise of
# chunked vs step-by-step KDA and expanded vs absorbed MLA, measured up to 5.1e-6 (|values| up to ~4).
FRESH_ATOL = 1.5e-5


@pytest.fixture(scope="module")
def demo():
    return load("demo", dtype=mx.float32)


def _fresh_reply(session: ChatSession) -> tuple[list[int], list[int]]:
    """(rendered prompt, greedy reply ids from a fresh cache) for the session's conversation as it stands."""
    prompt = session.render()
    reply = [r.token for r in stream_generate(session.model, session.tokenizer, prompt, N,
                                              stop_tokens=session.stop_tokens)]
    return prompt, reply


def _run(events) -> list:
    return list(events)


def _check_turn(session: ChatSession, prompt: list[int], reply: list[int]) -> None:
    assert session.last.tokens == reply
    assert session.tokens == prompt + reply and session.cache.offset == len(session.tokens)


def _cache_arrays(cache) -> dict[str, mx.array]:
    """{"layer {i} {name}": array} of what the next model call reads: KDA conv/recurrent state, MLA latents."""
    out = {}
    for i, c in enumerate(cache):
        names = ("conv_state", "recurrent_state") if isinstance(c, KDACache) else ("kv_latent", "k_pe")
        out.update({f"layer {i} {name}": a for name, a in zip(names, c.state)})
    return out


def _assert_same_cache(got, want, atol: float) -> None:
    """Same offset in every layer and the same arrays within ``atol``; a mismatch names the layer and array."""
    assert [c.offset for c in got] == [c.offset for c in want]
    got, want = _cache_arrays(got), _cache_arrays(want)
    assert got.keys() == want.keys()
    for key, a in got.items():
        assert a.shape == want[key].shape, f"{key}: shape {a.shape}, expected {want[key].shape}"
        err = mx.abs(a - want[key]).max().item()
        assert err <= atol, f"{key}: max |difference| {err:.3g} > {atol:g}"


def _assert_cache_is_fresh(session: ChatSession) -> None:
    """The session's cache holds what a fresh prefill of ``session.tokens`` gives (within FRESH_ATOL)."""
    fresh = session.model.make_cache()
    mx.eval(session.model(mx.array(session.tokens)[None], cache=fresh))
    _assert_same_cache(session.cache, fresh, FRESH_ATOL)


def test_second_turn_prefills_only_new_tokens(demo):
    """Turn 1 prefills the whole prompt; turn 2 reuses every cached token and prefills only the new ones; both
    replies equal greedy generation from a fresh cache on the full rendering; messages alternate user/assistant."""
    model, tok = demo
    s = ChatSession(model, tok, system="Be brief.", max_tokens=N)
    s.messages.append({"role": "user", "content": "Hello there"})
    p1, r1 = _fresh_reply(s)
    s.messages.pop()
    events = _run(s.send("Hello there"))
    assert "".join(e.text for e in events if e.kind == "content") == s.messages[-1]["content"]
    _check_turn(s, p1, r1)
    assert s.last.stats.prefill_tokens == len(p1) and s.last.stats.reused_tokens == 0

    before = len(s.tokens)
    s.messages.append({"role": "user", "content": "And then?"})
    p2, r2 = _fresh_reply(s)
    s.messages.pop()
    _run(s.send("And then?"))
    _check_turn(s, p2, r2)
    st = s.last.stats
    assert st.reused_tokens == before and st.prefill_tokens == len(p2) - before
    assert st.generation_tokens == N and st.prompt_tps > 0 and st.generation_tps > 0 and st.finish_reason == "length"
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]


def test_regenerate_restores_the_prompt_checkpoint(demo):
    """/regenerate replaces the last reply: only the last prompt token is fed again (the rest comes from the
    checkpoint), greedy gives the same reply and the cache equals a fresh prefill; sampling with another seed gives
    the fresh reference's sample."""
    model, tok = demo
    s = ChatSession(model, tok, max_tokens=N)
    _run(s.send("One"))
    _run(s.send("Two"))
    prompt, first = s.tokens[: -len(s.last.tokens)], list(s.last.tokens)
    _run(s.regenerate())
    assert s.last.stats.prefill_tokens == 1 and s.last.stats.reused_tokens == len(prompt) - 1
    _check_turn(s, prompt, first)
    _assert_cache_is_fresh(s)
    assert len(s.messages) == 4

    s.sampling = {"temp": 1.0}
    mx.random.seed(3)
    _run(s.regenerate())
    mx.random.seed(3)
    sampled = [r.token for r in stream_generate(model, tok, prompt, N, temp=1.0, stop_tokens=s.stop_tokens)]
    _check_turn(s, prompt, sampled)


def test_undo_rolls_back_to_the_previous_reply(demo):
    """/undo removes the last exchange; the next turn restores the checkpoint taken after the previous reply (every
    token up to it is reused), its reply equals the fresh reference and the cache a fresh prefill. (The undone reply
    is 2 tokens, so the state it leaves differs from the restored one: the demo model forgets within ~20 tokens.)"""
    model, tok = demo
    s = ChatSession(model, tok, max_tokens=N)
    _run(s.send("First question"))
    after_first = len(s.tokens)
    _run(s.send("Second question", max_tokens=2))
    assert s.undo() == 2 and [m["role"] for m in s.messages] == ["user", "assistant"]
    s.messages.append({"role": "user", "content": "Another question"})
    prompt, reply = _fresh_reply(s)
    s.messages.pop()
    _run(s.send("Another question"))
    assert s.last.stats.reused_tokens == after_first
    _check_turn(s, prompt, reply)
    _assert_cache_is_fresh(s)
    s.reset()
    assert s.messages == [] and s.tokens == [] and s.cache.offset == 0
    with pytest.raises(ValueError, match="nothing to undo"):
        s.undo()
    with pytest.raises(ValueError, match="nothing to regenerate"):
        s.regenerate()


def test_stopping_a_reply_keeps_the_session(demo):
    """Closing the reply stream after 3 events (what Ctrl-C does in the REPL) keeps the partial reply as the
    assistant message, marks the turn "interrupted", leaves the cache equal to a fresh prefill of the tokens kept,
    and the next turn matches the fresh reference."""
    model, tok = demo
    s = ChatSession(model, tok, max_tokens=N)
    events = s.send("Tell me a story")
    for _ in range(3):
        next(events)
    events.close()
    assert s.last.stats.finish_reason == "interrupted" and 3 <= len(s.last.tokens) < N
    assert s.messages[-1]["role"] == "assistant"
    _assert_cache_is_fresh(s)
    s.messages.append({"role": "user", "content": "Go on"})
    prompt, reply = _fresh_reply(s)
    s.messages.pop()
    _run(s.send("Go on"))
    _check_turn(s, prompt, reply)


class _Interrupting:
    """The model, but the ``at``-th call raises KeyboardInterrupt after updating the cache (a Ctrl-C mid-step)."""

    def __init__(self, model, at: int):
        self.model, self.at, self.calls = model, at, 0

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("at", [1, 5])
def test_ctrl_c_inside_a_model_call(demo, at):
    """KeyboardInterrupt raised inside a model call (at=1: during the prefill, before any reply token: the turn is
    dropped; at=5: mid-reply, the cache one token ahead of the yielded reply) propagates, and the session stays
    consistent: the cache equals a fresh prefill of its tokens and the next turn equals the fresh reference."""
    model, tok = demo
    s = ChatSession(model, tok, max_tokens=N)
    _run(s.send("Hi"))
    s.model = _Interrupting(model, at)
    with pytest.raises(KeyboardInterrupt):
        _run(s.send("Interrupted turn"))
    s.model = model
    _assert_cache_is_fresh(s)
    if at == 1:
        assert [m["role"] for m in s.messages] == ["user", "assistant"]
    else:
        assert s.last.stats.finish_reason == "interrupted" and s.messages[-1]["role"] == "assistant"
        assert s.tokens[-len(s.last.tokens):] == s.last.tokens
    s.messages.append({"role": "user", "content": "Next"})
    prompt, reply = _fresh_reply(s)
    s.messages.pop()
    _run(s.send("Next"))
    _check_turn(s, prompt, reply)


def test_context_limit(demo):
    """With max_kv_size the reply is cut where the context is full (ContextFullError after the partial reply is
    kept) and a further message is refused up front with a clear message, leaving the conversation unchanged."""
    model, tok = demo
    s = ChatSession(model, tok, max_tokens=N)
    s.messages.append({"role": "user", "content": "Hi"})
    limit = len(s.render()) + 5
    s = ChatSession(model, tok, max_tokens=N, max_kv_size=limit)
    with pytest.raises(ContextFullError, match="context full"):
        _run(s.send("Hi"))
    assert s.last.stats.finish_reason == "context" and len(s.last.tokens) == 5 and len(s.tokens) == limit
    with pytest.raises(ContextFullError, match=rf"limit \(max_kv_size\) is {limit}"):
        s.send("More")
    assert len(s.messages) == 2


def test_save_and_load(demo, tmp_path):
    """save + load into a new session restores messages, settings, tokens and cache (bitwise): the next turn reuses
    all cached tokens and gives the same reply and bitwise the same cache as the original session's next turn."""
    model, tok = demo
    s = ChatSession(model, tok, system="You are terse.", max_tokens=N)
    _run(s.send("Hello"))
    _run(s.send("Again"))
    s.save(tmp_path / "chat.safetensors")
    t = ChatSession(model, tok, max_tokens=N)
    t.load(tmp_path / "chat.safetensors")
    assert t.messages == s.messages and t.system == "You are terse." and t.tokens == s.tokens
    _assert_same_cache(t.cache, s.cache, 0)
    _run(s.send("Third"))
    _run(t.send("Third"))
    assert t.last.tokens == s.last.tokens and t.last.stats.prefill_tokens == s.last.stats.prefill_tokens
    _assert_same_cache(t.cache, s.cache, 0)
    save_prompt_cache(tmp_path / "plain.safetensors", model, model.make_cache(), [])
    with pytest.raises(PromptCacheError, match="without a chat session"):
        t.load(tmp_path / "plain.safetensors")


def test_kimi_linear_has_no_thinking(demo):
    """Thinking settings on a Kimi Linear model are refused with a message saying why."""
    model, tok = demo
    with pytest.raises(ValueError, match="no thinking section"):
        ChatSession(model, tok, thinking=True)
    with pytest.raises(ValueError, match="no thinking effort"):
        ChatSession(model, tok).set_effort("high")


def test_k3_format_session(k3_model, tmp_path):
    """On the K3 model with an XTML tokenizer: the prompt ends inside ``think`` (thinking on by default) or
    ``response`` (off); each reply equals the fresh greedy reference; stop token is ``<|end_of_msg|>``; effort is
    validated."""
    tok = load_xtml_tokenizer(tmp_path)
    s = ChatSession(k3_model, tok, max_tokens=N, thinking_effort="low")
    assert s.chat_format == "kimi_k3" and s.stop_tokens == [tok.special_tokens["<|end_of_msg|>"]]
    with pytest.raises(ValueError, match="expected one of low, high, max"):
        s.set_effort("medium")
    for thinking in (None, False):
        s.set_thinking(thinking)
        s.messages.append({"role": "user", "content": f"Question with thinking={thinking}"})
        prompt, reply = _fresh_reply(s)
        s.messages.pop()
        sp = tok.special_tokens
        tail = [sp["<|open|>"], *tok.encode_ordinary("think" if thinking is None else "response"), sp["<|sep|>"]]
        assert prompt[-len(tail) :] == tail
        _run(s.send(f"Question with thinking={thinking}"))
        _check_turn(s, prompt, reply)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_tool_round(demo):
    """Tools are declared in the prompt; after an assistant tool call, ``tool_results`` adds the tool message
    (with the call's id), the reply equals the fresh reference on the whole rendered round and the cache (rolled
    back: the call is rendered unlike the generated reply) a fresh prefill."""
    model, tok = demo
    s = ChatSession(model, tok, tools=TOOLS, max_tokens=N)
    _run(s.send("Weather in Tokyo?"))
    assert b"get_weather" in bytes(t for t in s.tokens if t < 256)
    call = {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}
    s.messages[-1] = {"role": "assistant", "content": "", "tool_calls": [call]}
    s.messages.append({"role": "tool", "tool_call_id": call["id"], "name": "get_weather", "content": "22C sunny"})
    prompt, reply = _fresh_reply(s)
    s.messages.pop()
    _run(s.tool_results([(call, "22C sunny")]))
    assert [m["role"] for m in s.messages] == ["user", "assistant", "tool", "assistant"]
    assert s.messages[2]["tool_call_id"] == "functions.get_weather:0"
    _check_turn(s, prompt, reply)
    _assert_cache_is_fresh(s)


def test_changed_system_prompt(demo):
    """Changing the system prompt mid-conversation: the next turn rolls the cache back (nothing after the change is
    reusable), its reply equals the fresh reference for the new rendering and the cache a fresh prefill."""
    model, tok = demo
    s = ChatSession(model, tok, system="Be brief.", max_tokens=N)
    _run(s.send("Hello"))
    s.system = "Be verbose."
    s.messages.append({"role": "user", "content": "Again"})
    prompt, reply = _fresh_reply(s)
    s.messages.pop()
    _run(s.send("Again"))
    _check_turn(s, prompt, reply)
    assert s.last.stats.reused_tokens == 0  # no checkpoint lies before the system prompt
    _assert_cache_is_fresh(s)


def _forced(script: list[int]):
    """A logits processor making the model emit ``script`` (mlx-lm passes the tokens fed since the prompt's last)."""

    def force(tokens, logits):
        i = min(len(tokens) - 1, len(script) - 1)
        return mx.where(mx.arange(logits.shape[-1]) == script[i], 0.0, -1e9)[None].astype(logits.dtype)

    return force


@pytest.mark.parametrize("fmt", ["kimi_linear", "kimi_k3"])
def test_well_formed_reply_is_reused_as_generated(fmt, demo, k3_model, tmp_path):
    """A well-formed reply (the exact tokens the renderer writes for it, forced through a logits processor) parses
    back to the same reasoning/content, and the next turn reuses every cached token: the generated tokens are what
    the renderer writes for the parsed message."""
    if fmt == "kimi_k3":
        model, tok = k3_model, load_xtml_tokenizer(tmp_path)
        answer = {"role": "assistant", "reasoning_content": "Two and two.", "content": "It is 4."}
    else:
        (model, tok), answer = demo, {"role": "assistant", "content": "It is 4."}
    user = {"role": "user", "content": "What is 2+2?"}
    prompt = render_chat(tok, [user], chat_format=fmt)
    script = render_chat(tok, [user, answer], add_generation_prompt=False, chat_format=fmt)
    assert script[: len(prompt)] == prompt
    script = script[len(prompt) :]
    s = ChatSession(model, tok, max_tokens=len(script) + 5, sampling={"logits_processors": [_forced(script)]})
    events = _run(s.send("What is 2+2?"))
    assert s.last.tokens == script and s.last.stats.finish_reason == "stop"
    assert s.messages[-1] == answer
    assert "".join(e.text for e in events if e.kind == "content") == "It is 4."
    cached = len(s.tokens)
    s.sampling = {}
    _run(s.send("Thanks"))
    assert s.last.stats.reused_tokens == cached


def test_bad_settings_and_session_files(demo, tmp_path):
    """Unknown sampling options, the K3 format forced on a tokenizer without its markers (the message is not kept),
    a session file of another chat format, and a malformed saved session are refused with messages naming the
    problem."""
    model, tok = demo
    with pytest.raises(ValueError, match="unknown option\\(s\\) temperature"):
        ChatSession(model, tok, sampling={"temperature": 0.5})
    with pytest.raises(ValueError, match="max_kv_size must be >= 2"):
        ChatSession(model, tok, max_kv_size=1)
    s = ChatSession(model, tok, max_tokens=4, chat_format="kimi_k3")
    with pytest.raises(ValueError, match="needs the special token"):
        s.send("Hi")
    assert s.messages == [] and s.tokens == []
    plain = ChatSession(model, tok, max_tokens=4)
    _run(plain.send("Hi"))
    plain.chat_format = "kimi_k3"
    plain.save(tmp_path / "k3.safetensors")
    with pytest.raises(PromptCacheError, match="saved with chat format 'kimi_k3', this session uses 'kimi_linear'"):
        ChatSession(model, tok).load(tmp_path / "k3.safetensors")
    save_prompt_cache(tmp_path / "bad.safetensors", model, model.make_cache(), [], {"chat_session": "{not json"})
    with pytest.raises(PromptCacheError, match="saved chat session is malformed"):
        ChatSession(model, tok).load(tmp_path / "bad.safetensors")
