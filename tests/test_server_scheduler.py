"""The serving engine (``kimi_mlx.server.scheduler``) on real models: continuous batching gives each request its
single-request output, seeds are per request, cancellation frees a slot, the prefix cache resumes conversations with
the logits of a cold prefill, a reasoning budget gives its closer after the allowed tokens.

References are independent of the engine: ``kimi_mlx.generate.stream_generate`` on one prompt with a fresh cache
(greedy, or after ``mx.random.seed``), and a fresh engine with the prefix cache off (cold prefill).
"""

import threading

import mlx.core as mx
import pytest

from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load
from kimi_mlx.server.scheduler import (FinishEvent, GenerationRequest, QueueFullError, ReasoningBudget, SamplingParams,
                                       Scheduler)

N = 10


@pytest.fixture(scope="module")
def demo():
    return load("demo", dtype=mx.float32)


@pytest.fixture(scope="module")
def kl(kl_dir):
    return load(kl_dir / "hf", dtype=mx.float32)


def _prompts(vocab: int, lengths) -> list[list[int]]:
    rng = __import__("numpy").random.default_rng(0)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _reference(model, tok, prompt, max_tokens=N, **kw) -> list[int]:
    return [r.token for r in stream_generate(model, tok, prompt, max_tokens, **kw)]


def _run(stream):
    """(tokens, token events, finish event) of a stream read to its end."""
    events = list(stream)
    tokens = [e.token for e in events[:-1]]
    assert isinstance(events[-1], FinishEvent)
    return tokens, events[:-1], events[-1]


@pytest.fixture
def engine(demo):
    engines = []

    def make(model=None, **kw):
        e = Scheduler(model if model is not None else demo[0], **kw).start()
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.stop()


def test_concurrent_requests_get_their_single_request_output(demo, engine):
    """7 prompts of different lengths (1 to 300 tokens) submitted at once to a 4-row batch with 64-token prefill
    chunks: each greedy output equals the prompt generated alone; later ones wait, then join as rows leave."""
    model, tok = demo
    prompts = _prompts(512, [5, 300, 1, 40, 17, 120, 64])
    maxes = [N, N, 4, N + 6, 3, N, N]
    e = engine(max_batch=4, prefill_chunk=64, prompt_cache_bytes=0)
    streams = [e.submit(GenerationRequest(p, m)) for p, m in zip(prompts, maxes)]
    for p, m, s in zip(prompts, maxes, streams):
        tokens, _, fin = _run(s)
        assert tokens == _reference(model, tok, p, m)
        assert (fin.reason, fin.generated_tokens, fin.prompt_tokens) == ("length", m, len(p))


def test_kimi_linear_fixture_batch_matches_single(kl, engine):
    """The same on the transformers-made Kimi Linear fixture (KDA + MLA layers, float32), greedy, 3 rows."""
    model, tok = kl
    prompts = _prompts(512, [9, 33, 2])
    e = engine(model, max_batch=3, prefill_chunk=16, prompt_cache_bytes=0)
    streams = [e.submit(GenerationRequest(p, N)) for p in prompts]
    for p, s in zip(prompts, streams):
        assert _run(s)[0] == _reference(model, tok, p)


def test_seeded_sampling_is_per_request(demo, engine):
    """temp 0.9, top_k 50, seed 11: the draws equal stream_generate after mx.random.seed(11), alone or beside
    other sampled requests."""
    model, tok = demo
    p = _prompts(512, [12])[0]
    mx.random.seed(11)
    ref = _reference(model, tok, p, 16, temp=0.9, top_k=50)
    e = engine(max_batch=4, prompt_cache_bytes=0)
    params = dict(temp=0.9, top_k=50)
    others = [e.submit(GenerationRequest(q, 16, SamplingParams(**params, seed=s))) for s, q in
              zip((1, 2), _prompts(512, [30, 7]))]
    mine = e.submit(GenerationRequest(p, 16, SamplingParams(**params, seed=11)))
    assert _run(mine)[0] == ref
    for s in others:
        _run(s)


def test_stop_tokens_and_logprobs(demo, engine):
    """A stop token ends the request with reason "stop" (the token is reported); logprobs are the model's
    log-softmax, top ones sorted."""
    model, tok = demo
    p = _prompts(512, [20])[0]
    ref = _reference(model, tok, p, N)
    e = engine(prompt_cache_bytes=0)
    tokens, events, fin = _run(e.submit(GenerationRequest(p, N, stop_token_ids=frozenset({ref[3]}),
                                                          top_logprobs=3)))
    cut = ref.index(ref[3]) + 1
    assert tokens == ref[:cut] and fin.reason == "stop"
    logits = model(mx.array(p)[None])[0, -1]
    lp = logits - mx.logsumexp(logits)
    first = events[0]
    assert abs(first.logprob - lp[ref[0]].item()) < 1e-5
    assert [t for t, _ in first.top_logprobs][0] == ref[0]
    assert [v for _, v in first.top_logprobs] == sorted([v for _, v in first.top_logprobs], reverse=True)


def test_cancel_frees_the_slot(demo, engine):
    """With one row, a cancelled long request ends "cancelled" within a step and the queued request runs."""
    model, tok = demo
    p, q = _prompts(512, [8, 9])
    e = engine(max_batch=1, max_queue=4, prompt_cache_bytes=0)
    long = e.submit(GenerationRequest(p, 100000))
    waiting = e.submit(GenerationRequest(q, N))
    seen = 0
    for ev in long:
        seen += 1
        if seen == 3:
            long.cancel()
        if isinstance(ev, FinishEvent):
            assert ev.reason == "cancelled" and ev.generated_tokens <= 5
    assert _run(waiting)[0] == _reference(model, tok, q)


def test_queue_full(demo, engine):
    e = engine(max_batch=1, max_queue=1, prompt_cache_bytes=0)
    p = _prompts(512, [4])[0]
    first = e.submit(GenerationRequest(p, 100000))
    streams = [first]
    with pytest.raises(QueueFullError) as err:
        for _ in range(3):
            streams.append(e.submit(GenerationRequest(p, 2)))
    assert err.value.retry_after >= 1
    for s in streams:
        s.cancel()
    for s in streams:
        _run(s)


def _turn_logprobs(e, prompt, k=8):
    _, events, fin = _run(e.submit(GenerationRequest(prompt, 6, top_logprobs=k)))
    return [t.token for t in events], [dict(t.top_logprobs) for t in events], fin


def test_conversation_resumes_from_snapshots_with_cold_logits(kl, engine):
    """An agent re-sends the whole, growing conversation: each turn takes all it has seen from the prefix cache
    (the reply snapshot) and prefills only the new tokens; its top-8 logprobs at every step equal a cold engine's
    within 1e-5. An edit inside the first message resumes from the last snapshot before it (a 32-token interval
    checkpoint)."""
    warm = engine(kl[0], prefill_chunk=16, checkpoint_interval=32)
    cold = engine(kl[0], prefill_chunk=16, prompt_cache_bytes=0)
    conv = _prompts(512, [70])[0]
    seen = 0
    for turn in range(4):
        reply, top, fin = _turn_logprobs(warm, conv)
        ref_reply, ref_top, _ = _turn_logprobs(cold, conv)
        assert reply == ref_reply
        for a, b in zip(top, ref_top):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-5
        assert fin.cached_tokens == seen, turn
        seen = len(conv) + len(reply) - 1
        conv = conv + reply + _prompts(512, [11 + turn])[0]
    edited = conv[:40] + [(conv[40] + 1) % 512] + conv[41:]
    _, _, fin = _turn_logprobs(warm, edited)
    assert fin.cached_tokens == 32


def test_system_snapshot_is_shared(demo, engine):
    """Two conversations with the same system part: the second starts from the "system" snapshot."""
    e = engine(checkpoint_interval=0)
    system, a, b = _prompts(512, [50, 20, 25])
    _run(e.submit(GenerationRequest(system + a, 3, system_end=len(system))))
    _, _, fin = _run(e.submit(GenerationRequest(system + b, 3, system_end=len(system))))
    assert fin.cached_tokens == len(system)


class _CountingModel:
    """``model`` that records the tokens per row of each forward call (prefill chunks and decode steps)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, inputs, **kw):
        self.calls.append(inputs.shape[1])
        return self.model(inputs, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_resent_turn_prefills_in_one_call_through_its_snapshot_points(demo, engine):
    """A re-sent agent conversation (messages: system, user, assistant tool call, tool result; each turn ends with
    the generation prompt): each turn prefills its new tokens in one forward call, from the previous prompt's end to
    its own prompt's end (all but the last token: the first decode input), and still leaves a snapshot at every
    message boundary inside them (marked in the call). Its reply is the single-request greedy one; a regenerated
    turn 2 resumes from its prompt's end, and a turn 2 whose tool result is edited resumes where the assistant's
    message ends, with the reply of that prompt on a cold engine."""
    model, tok = demo
    counting = _CountingModel(model)
    e = engine(counting, checkpoint_interval=0)
    system, user, call, result, gen = _prompts(512, [30, 12, 9, 17, 3])
    S, U, A, T, G = (len(x) for x in (system, user, call, result, gen))
    p1 = system + user + gen
    _, _, fin = _run(e.submit(GenerationRequest(p1, 4, boundaries=(S, S + U), system_end=S)))
    assert fin.cached_tokens == 0
    assert [n for n in counting.calls if n > 1] == [S + U + G - 1]
    counting.calls.clear()
    p2 = p1 + call + result + gen  # the assistant message starts with the generation prompt's tokens
    bounds = (S, S + U, S + U + G + A, S + U + G + A + T)
    req = GenerationRequest(p2, 4, boundaries=bounds, system_end=S)
    reply, _, fin = _run(e.submit(req))
    assert fin.cached_tokens == len(p1) - 1
    assert [n for n in counting.calls if n > 1] == [A + 1 + T + G - 1]  # new: from len(p1) - 1 to len(p2) - 1
    assert reply == _reference(model, tok, p2, 4)
    _, _, fin = _run(e.submit(req))
    assert fin.cached_tokens == len(p2) - 1
    edited = p1 + call + [(result[0] + 1) % 512] + result[1:] + gen
    reply, _, fin = _run(e.submit(GenerationRequest(edited, 4, boundaries=bounds, system_end=S)))
    assert fin.cached_tokens == S + U + G + A
    assert reply == _reference(model, tok, edited, 4)


def test_many_threads_submit(demo, engine):
    """Submissions from 8 threads at once: every stream completes with its own greedy output."""
    model, tok = demo
    prompts = _prompts(512, [3 + 5 * i for i in range(8)])
    e = engine(max_batch=8, prompt_cache_bytes=0)
    results = {}

    def client(i):
        results[i] = _run(e.submit(GenerationRequest(prompts[i], 6)))[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        assert results[i] == _reference(model, tok, p, 6)


def test_penalties_see_prompt_and_reply(demo, engine):
    """Repetition / presence / frequency penalties and a logit bias, greedy: the output of stream_generate with the
    same settings (its penalties count the prompt's and the reply's last 20 tokens), and not the unpenalized one."""
    model, tok = demo
    p = _prompts(512, [6])[0] * 4
    kw = dict(repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4, logit_bias={p[0]: -3.0})
    ref = _reference(model, tok, p, 16, **kw)
    assert ref != _reference(model, tok, p, 16)
    e = engine(max_batch=2, prompt_cache_bytes=0)
    other = e.submit(GenerationRequest(_prompts(512, [9])[0], 16))
    assert _run(e.submit(GenerationRequest(p, 16, SamplingParams(**kw))))[0] == ref
    _run(other)


def test_a_failing_request_ends_alone_and_a_stopped_engine_refuses(demo, engine):
    """A request whose cache cannot be made ends with an "error" event naming the cause; the next request is served
    as usual. After ``stop()`` requests in flight end with "error" and ``submit`` raises EngineStoppedError."""
    from kimi_mlx.server.scheduler import EngineStoppedError

    model, tok = demo
    fail = []

    class Flaky:
        def __call__(self, *a, **k):
            return model(*a, **k)

        def make_cache(self):
            if fail:
                fail.pop()
                raise MemoryError("no room for a cache")
            return model.make_cache()

    p = _prompts(512, [9])[0]
    e = engine(Flaky(), prompt_cache_bytes=0)
    fail.append(True)
    tokens, _, fin = _run(e.submit(GenerationRequest(p, N)))
    assert (tokens, fin.reason) == ([], "error") and "no room for a cache" in fin.error
    assert _run(e.submit(GenerationRequest(p, N)))[0] == _reference(model, tok, p)
    running = e.submit(GenerationRequest(p, 100000))
    next(iter(running))
    e.stop()
    assert _run(running)[2].reason == "error"
    with pytest.raises(EngineStoppedError):
        e.submit(GenerationRequest(p, N))


def test_reasoning_budget(demo, engine):
    """Three rows in one batch: one reaching its budget of 3 gets the closer ids next, then continues as the model
    does after them; one whose reasoning ends (a token of ``ends``) within its budget is never given the closer; one
    without a budget is unchanged."""
    model, tok = demo
    p1, p2, p3 = _prompts(512, [7, 12, 5])
    close = [300, 301, 302]  # the engine deals in ids: any will do
    reasoning = _reference(model, tok, p1, 3)
    want1 = reasoning + close + _reference(model, tok, p1 + reasoning + close, N - 6)
    want2 = _reference(model, tok, p2, N)
    e = engine(max_batch=3, prompt_cache_bytes=0)
    s1 = e.submit(GenerationRequest(p1, N, reasoning=ReasoningBudget(3, tuple(close), frozenset())))
    s2 = e.submit(GenerationRequest(p2, N, reasoning=ReasoningBudget(5, tuple(close), frozenset({want2[1]}))))
    s3 = e.submit(GenerationRequest(p3, N))
    assert _run(s1)[0] == want1
    assert _run(s2)[0] == want2
    assert _run(s3)[0] == _reference(model, tok, p3, N)
