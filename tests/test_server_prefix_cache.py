"""The cross-request prefix cache of a real ``kimi-mlx serve --model demo``, over ``/v1/chat/completions`` with the
official ``openai`` client: an agent conversation re-sent whole every turn prefills only its new tokens, an edited
earlier message resumes from where that message starts, a new conversation with the same system prompt and tools
resumes from the shared system snapshot, and every resumed request gives the log-probabilities of a cold prefill
(a second server with ``--prompt-cache-bytes 0``).

The expected ``cached_tokens`` come from the rendered prompts (``render_chat_with_starts`` in this process), never
from the server: turn k resumes from the previous turn's prompt + reply, all but the reply's last token (that token
was sampled, never fed to the model); an edit resumes from the nearest message boundary before it; a new
conversation from the end of the system part. The demo model is float32 on CPU (its weights are stored so).
"""

import openai
import pytest
from serve_helpers import Server

from kimi_mlx.chat.format import render_chat_with_starts
from kimi_mlx.loading import load

N = 8  # reply tokens per turn (the demo never emits its stop token greedily: every reply runs N tokens)
TOP = 20
TOL = 1e-5
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                      "parameters": {"type": "object", "properties": {}}}},
]
SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools, then answer briefly."}
# what each turn appends after the assistant's reply: a tool result or a new user message
FOLLOW_UPS = [
    {"role": "tool", "tool_call_id": "functions.read_file:0", "content": "def add(a, b):\n    return a - b\n"},
    {"role": "user", "content": "Fix the bug, then run the tests."},
    {"role": "tool", "tool_call_id": "functions.run_tests:1", "content": "1 failed, 11 passed"},
]
MAX_DELTA = []  # every |warm - cold| logprob compared, for the report


@pytest.fixture(scope="module", autouse=True)
def report_max_delta():
    yield
    if MAX_DELTA:
        print(f"\nmax |warm - cold| logprob: {max(MAX_DELTA):.3g} over {len(MAX_DELTA)} tokens x top-{TOP} "
              f"(bound {TOL})")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "kimi-mlx-home"


@pytest.fixture(scope="module")
def tok(home):
    """The demo tokenizer in this process (the model is made here first, so the servers only load it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMI_MLX_HOME", str(home))
        return load("demo")[1]


@pytest.fixture(scope="module")
def warm(tmp_path_factory, home, tok):
    with Server(["--model", "demo", "--max-tokens", str(N)], tmp_path_factory.mktemp("warm"), home) as s:
        yield openai.OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def cold(tmp_path_factory, home, tok):
    with Server(["--model", "demo", "--max-tokens", str(N), "--prompt-cache-bytes", "0"],
                tmp_path_factory.mktemp("cold"), home) as s:
        yield openai.OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=60)


def chat(client, messages):
    return client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=N, logprobs=True, top_logprobs=TOP)


def render(tok, messages):
    """(token ids, message start positions) of ``messages`` with the generation prompt, as the server renders."""
    return render_chat_with_starts(tok, messages, tools=TOOLS)


def assert_cold_logprobs(warm_reply, cold_reply):
    """The same tokens, each with the same 20 most likely tokens, every logprob within TOL of the cold one."""
    a, b = warm_reply.choices[0].logprobs.content, cold_reply.choices[0].logprobs.content
    assert [x.bytes for x in a] == [y.bytes for y in b] and len(a) == N
    assert warm_reply.choices[0].message.content == cold_reply.choices[0].message.content
    for x, y in zip(a, b):
        tops_a = {tuple(t.bytes): t.logprob for t in x.top_logprobs}
        tops_b = {tuple(t.bytes): t.logprob for t in y.top_logprobs}
        assert len(tops_a) == TOP and tops_a.keys() == tops_b.keys()
        deltas = [abs(tops_a[k] - tops_b[k]) for k in tops_a] + [abs(x.logprob - y.logprob)]
        MAX_DELTA.append(max(deltas))
        assert max(deltas) <= TOL, (x.token, max(deltas))


def cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def conversation(warm, cold, tok):
    """A 4-turn agent conversation sent whole each turn to both servers; each turn appends the warm server's reply
    and the next follow-up. Returns [(messages, warm reply, cold reply)] per turn."""
    messages = [SYSTEM, {"role": "user", "content": "The add() test fails. Find out why."}]
    turns = []
    for k in range(4):
        w, c = chat(warm, messages), chat(cold, messages)
        turns.append((messages, w, c))
        if k < 3:
            messages = [*messages, {"role": "assistant", "content": w.choices[0].message.content}, FOLLOW_UPS[k]]
    return turns


def test_each_turn_prefills_only_its_new_tokens(conversation, tok):
    """Turn 1 on a fresh server: nothing cached. Turn k: the whole of turn k-1's prompt and reply but the reply's
    last generated token (the reply snapshot), counted from the rendered prompts. Every turn's top-20 logprobs
    equal the cold server's."""
    previous = None
    for k, (messages, w, c) in enumerate(conversation):
        tokens, _ = render(tok, messages)
        assert w.usage.prompt_tokens == c.usage.prompt_tokens == len(tokens)
        assert w.usage.completion_tokens == N and w.choices[0].finish_reason == "length"
        assert cached(c) == 0  # the cold server never resumes
        if previous is None:
            assert cached(w) == 0
        else:
            prev_tokens, prev_reply = previous
            reply = tok.encode(prev_reply.choices[0].message.content)  # the text the model generated, re-encoded
            assert len(reply) == N  # the reply's text is exactly its N generated tokens (byte tokenizer)
            assert tokens[: len(prev_tokens) + N] == prev_tokens + reply  # the conversation extends turn k-1's
            assert cached(w) == len(prev_tokens) + N - 1, f"turn {k + 1}"
            assert cached(w) > len(tokens) * 0.75  # the new tokens are a small part of the prompt
        assert_cold_logprobs(w, c)
        previous = tokens, w


@pytest.mark.parametrize("edited", [3, 1], ids=["tool-result-of-turn-2", "first-user-message"])
def test_edited_earlier_message_resumes_where_it_starts(conversation, warm, cold, tok, edited):
    """The last turn re-sent with an earlier message changed: the server resumes from the snapshot at the start of
    that message (a message boundary of an earlier turn's prompt), with the cold server's logprobs."""
    messages = [dict(m) for m in conversation[-1][0]]
    messages[edited]["content"] += " (edited)"
    tokens, starts = render(tok, messages)
    unedited, _ = render(tok, conversation[-1][0])
    diverge = next(i for i, (a, b) in enumerate(zip(tokens, unedited)) if a != b)
    assert starts[edited] < diverge  # the message's role header is unchanged; no snapshot lies inside a message
    w, c = chat(warm, messages), chat(cold, messages)
    assert w.usage.prompt_tokens == len(tokens)
    assert cached(w) == starts[edited]
    assert_cold_logprobs(w, c)


def test_new_conversation_starts_from_the_system_snapshot(conversation, warm, cold, tok):
    """A second conversation with the same system prompt and tools: it resumes from the end of the system part
    (where its first non-system message starts), shared across conversations."""
    messages = [SYSTEM, {"role": "user", "content": "List the files of the repository."}]
    tokens, starts = render(tok, messages)
    first, _ = render(tok, conversation[0][0])
    assert tokens[: starts[1]] == first[: starts[1]] and starts[1] > 0
    w, c = chat(warm, messages), chat(cold, messages)
    assert cached(w) == starts[1]
    assert_cold_logprobs(w, c)
