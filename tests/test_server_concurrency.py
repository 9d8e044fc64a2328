"""Continuous batching in a real ``kimi-mlx serve --model demo``, driven by the official ``openai`` client from
threads: 16 concurrent streaming chats (different prompts and lengths) each get their single-request greedy text,
and a client that disconnects frees its slot for a queued request while another generation keeps running.

The expected text is ``kimi_mlx.generate.stream_generate`` (greedy, one request, fresh cache) on the rendered
prompt, in this process. No fixed sleeps: every wait polls ``/health`` or a thread with a deadline.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest
from serve_helpers import Server

from kimi_mlx.chat.format import render_chat
from kimi_mlx.chat.parser import parse_reply
from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load

CLIENTS = 16
NO_STOP = {"257": -100, "258": -100}  # no [EOS] / <|im_end|>: a long generation runs until it is cancelled


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "kimi-mlx-home"


@pytest.fixture(scope="module")
def ref(home):
    """The demo model and tokenizer in this process (made here first, so the servers only load it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMI_MLX_HOME", str(home))
        return load("demo")


def greedy_text(ref, messages, max_tokens):
    """The reply content of greedy ``stream_generate`` on the rendered conversation, and its finish reason."""
    model, tok = ref
    text, finish = "", None
    for r in stream_generate(model, tok, render_chat(tok, messages), max_tokens):
        text, finish = text + r.text, r.finish_reason
    return parse_reply(text, "kimi_linear").content, finish


def stats(server) -> dict:
    return httpx.get(server.base + "/health", timeout=10).json()["stats"]


def wait_for(server, condition, what, timeout=30.0) -> dict:
    """Poll /health until ``condition(stats)``; the last stats, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server)
        if condition(s):
            return s
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s; /health stats {s}"
        time.sleep(0.02)


def conversation(i: int) -> list[dict]:
    """Client i's chat: prompts from ~40 to ~500 tokens, some with a system prompt."""
    user = {"role": "user", "content": f"Request {i}: " + "describe the weather in detail. " * (i * i // 16 + 1)}
    return [{"role": "system", "content": f"You are helper number {i}."}, user] if i % 3 else [user]


def test_16_concurrent_streams_each_get_their_greedy_text(tmp_path_factory, home, ref):
    """16 threads start their streamed chats together (16 rows, 128-token prefill chunks, so prompts prefill while
    others decode); every stream completes with its own single-request greedy text, finish reason and usage;
    /health saw all 16 requests in the engine at once and several rows in one decode batch."""
    maxes = [4 + (7 * i) % 29 for i in range(CLIENTS)]  # 4 .. 32 reply tokens
    convs = [conversation(i) for i in range(CLIENTS)]
    want = [greedy_text(ref, c, m) for c, m in zip(convs, maxes)]
    flags = ["--model", "demo", "--max-batch", str(CLIENTS), "--prefill-chunk", "128"]
    with Server(flags, tmp_path_factory.mktemp("batch16"), home) as server:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
        start = threading.Barrier(CLIENTS + 1)
        seen, done = [], threading.Event()

        def watch():  # requests in the engine (prefilling or decoding), and in the decode batch
            while not done.is_set():
                s = stats(server)
                seen.append((s["running"] + s["prefilling"], s["running"]))
                time.sleep(0.01)  # a poll, not a wait for anything

        def run(i):
            start.wait(timeout=30)
            stream = client.chat.completions.create(model="demo", messages=convs[i], max_tokens=maxes[i],
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            return text, finish, chunks[-1].usage

        watcher = threading.Thread(target=watch, daemon=True)
        try:
            with ThreadPoolExecutor(CLIENTS) as pool:
                futures = [pool.submit(run, i) for i in range(CLIENTS)]
                watcher.start()
                start.wait(timeout=30)
                results = [f.result(timeout=120) for f in futures]
        finally:
            done.set()
            watcher.join(timeout=10)
        for i, ((text, finish, usage), (want_text, want_finish)) in enumerate(zip(results, want)):
            assert text == want_text, f"client {i}"
            assert finish == [want_finish] and usage.completion_tokens == maxes[i], f"client {i}"
            assert usage.prompt_tokens == len(render_chat(ref[1], convs[i]))
        assert max(n for n, _ in seen) == CLIENTS, f"the engine never held all {CLIENTS} requests at once: {seen}"
        assert max(r for _, r in seen) >= 3, f"rows were not decoded together: {seen}"  # ~9 seen; >= 5 any order
        wait_for(server, lambda s: s["finished"] == CLIENTS, "every request counted as finished", timeout=10)


def test_disconnect_frees_its_slot_for_a_queued_request(tmp_path_factory, home, ref):
    """--max-batch 2 --max-queue 1: two endless streams fill both rows; a third request waits (queued 1; a fourth
    gets 429). Closing one stream cancels its generation: the third is admitted and completes with its greedy text
    while the other endless stream is still running (it keeps streaming; /health: running 1, queued 0)."""
    short = [{"role": "user", "content": "Say something short."}]
    want_text, _ = greedy_text(ref, short, 6)
    flags = ["--model", "demo", "--max-batch", "2", "--max-queue", "1"]
    with Server(flags, tmp_path_factory.mktemp("batch2"), home) as server:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=30)

        def endless(name):
            stream = client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": f"Tell {name} a very long story."}],
                max_tokens=50000, temperature=0, logit_bias=NO_STOP, stream=True)
            it = iter(stream)
            for _ in range(3):  # a few tokens: it is decoding
                while not next(it).choices[0].delta.content:
                    pass
            return stream, it

        a, _ = endless("A")
        b, b_chunks = endless("B")
        try:
            s = wait_for(server, lambda s: s["running"] == 2, "both endless streams running")
            assert s["queued"] == 0 and s["prefilling"] == 0

            third = {"text": None, "chunks": 0}

            def queued_request():
                chunks = list(client.chat.completions.create(model="demo", messages=short, max_tokens=6,
                                                             temperature=0, stream=True))
                third["chunks"] = sum(bool(c.choices and c.choices[0].delta.content) for c in chunks)
                third["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

            t = threading.Thread(target=queued_request, daemon=True)
            t.start()
            s = wait_for(server, lambda s: s["queued"] == 1, "the third request queued")
            assert s["running"] == 2 and third["text"] is None
            with pytest.raises(openai.RateLimitError) as full:  # the queue (1) is full
                client.chat.completions.create(model="demo", messages=short, max_tokens=2)
            assert int(full.value.response.headers["retry-after"]) >= 1
            assert t.is_alive()  # still waiting behind the two endless streams

            a.close()  # A's client goes away
            s = wait_for(server, lambda s: s["queued"] == 0, "the third request admitted after A disconnected")
            t.join(timeout=30)
            assert not t.is_alive(), "the third request did not complete"
            assert third["text"] == want_text and third["chunks"] > 0

            # A (cancelled) and the third are counted (just after their last event); the 429 never entered
            s = wait_for(server, lambda s: s["finished"] == 2, "A and the third counted as finished", timeout=10)
            assert (s["running"], s["queued"], s["prefilling"]) == (1, 0, 0)  # B alone: A's slot is free again
            for _ in range(5):  # B is still generating
                while not next(b_chunks).choices[0].delta.content:
                    pass
        finally:
            a.close()
            b.close()
        wait_for(server, lambda s: (s["running"], s["queued"], s["finished"]) == (0, 0, 3),
                 "B cancelled after its client left")
