"""Speculative decoding in ``ChatSession`` (``draft=``): every turn speculates, and the conversation, the replies, the
session's token history, its checkpoints and its cache are those of the same session without speculation (the
reference: a plain session fed the same turns); the verify passes never release a checkpoint of the caller's.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kimi_mlx.chat.session import ChatSession
from kimi_mlx.sampling import SamplingParams
from kimi_mlx.speculative import InContext, PromptLookup, speculative_steps

TURNS = ["the cat sat on the mat, the cat sat on the mat", "again: the cat sat on the mat", "and once more"]


@pytest.fixture(scope="module")
def demo():
    from kimi_mlx import load

    return load("demo")


def _cache_diff(a, b) -> float:
    """Largest |difference| over the two caches' arrays, relative to max(1, max |b|) per array; offsets equal."""
    worst = 0.0
    for x, y in zip(a, b):
        assert x.offset == y.offset
        for u, v in zip(x.state, y.state):
            u, v = u.astype(mx.float32), v.astype(mx.float32)
            worst = max(worst, float(mx.abs(u - v).max().item()) / max(1.0, float(mx.abs(v).max().item())))
    return worst


def _conversation(session: ChatSession) -> list[tuple]:
    """Three turns, a regenerate, an undo and one more turn; after each: the reply's text and tokens, the session's
    tokens, the checkpoints' offsets and how many prompt tokens came from the cache; and the drafted / accepted
    counts."""
    seen, counts = [], []

    def record(events):
        text = "".join(e.text for e in events)
        st = session.last.stats
        seen.append((text, session.last.tokens, list(session.tokens), [c.offset for c in session.cache.checkpoints],
                     st.reused_tokens, st.generation_tokens))
        counts.append((st.drafted_tokens, st.accepted_tokens))

    for text in TURNS:
        record(session.send(text))
    record(session.regenerate())
    session.undo()
    record(session.send("the cat sat on the mat"))
    return seen, counts


@pytest.mark.parametrize("max_checkpoints", [1, 3])
def test_session_with_lookup_is_the_plain_session(demo, max_checkpoints):
    """With prompt lookup every turn (regenerate and undo included) gives the plain session's reply, token history,
    checkpoints (at the same offsets: none lost to the verify passes, even with one kept) and cache (within 1e-5);
    drafts were proposed, accepted and rejected."""
    model, tok = demo
    plain = ChatSession(model, tok, max_tokens=24, max_checkpoints=max_checkpoints)
    spec = ChatSession(model, tok, max_tokens=24, max_checkpoints=max_checkpoints, draft="lookup", num_draft_tokens=4)
    want, none = _conversation(plain)
    got, counts = _conversation(spec)
    assert got == want and set(none) == {(0, 0)}
    assert _cache_diff(spec.cache, plain.cache) <= 1e-5
    drafted, accepted = sum(d for d, _ in counts), sum(a for _, a in counts)
    assert 0 < accepted < drafted
    assert all(0 <= a <= d for d, a in counts)
    assert spec.stats()["last"]["drafted_tokens"] == counts[-1][0]


def test_session_with_a_draft_model_is_the_plain_session(demo):
    """A draft model (the target itself, so every greedy draft is accepted): the same conversation as the plain
    session, and the draft model's cache follows it across turns, regenerate and undo (its tokens are the session's
    history up to the last pass)."""
    model, tok = demo
    plain = ChatSession(model, tok, max_tokens=16, max_checkpoints=3)
    spec = ChatSession(model, tok, max_tokens=16, max_checkpoints=3, draft=model, num_draft_tokens=4)
    want, _ = _conversation(plain)
    got, counts = _conversation(spec)
    assert got == want
    assert all(d > 0 and a == d for d, a in counts)
    held = spec.drafter.tokens
    assert held and held == spec.tokens[: len(held)] and len(held) > len(spec.tokens) - 16
    assert _cache_diff(spec.cache, plain.cache) <= 1e-5


def test_session_drafts_from_the_whole_conversation(demo):
    """The drafter is asked with the whole conversation as its history (the earlier turns, then this turn's prompt
    and reply), not just the tokens the turn feeds."""
    model, tok = demo
    seen = []

    class Recording(PromptLookup):
        def propose(self, history, k):
            seen.append(len(history))
            return super().propose(history, k)

    spec = ChatSession(model, tok, max_tokens=16, draft=Recording(), num_draft_tokens=4)
    list(spec.send(TURNS[0]))
    first = len(spec.tokens)
    seen.clear()
    list(spec.send(TURNS[1]))
    assert seen and min(seen) > first  # the second turn's histories hold the whole first turn, then its own prompt


def test_in_context_prepends_the_context():
    lookup = InContext(PromptLookup(), [5, 6, 7, 8, 9])
    assert lookup.propose([1, 5, 6], 3) == [7, 8, 9]
    assert PromptLookup().propose([1, 5, 6], 3) == []


def test_verify_pass_keeps_the_callers_checkpoints_when_they_are_full(demo):
    """A cache keeping one checkpoint: the caller's, taken after the prompt, survives speculative decoding (the
    passes' own checkpoints are transient), and restoring it gives the prompt's cache back."""
    model, tok = demo
    prompt = tok.encode("the cat sat on the mat. the cat sat on the mat. the cat sat")
    cache = model.make_cache(max_checkpoints=1)
    model(mx.array([prompt]), cache=cache)
    mx.eval([c.state for c in cache])
    cp = cache.checkpoint()
    fresh = model.make_cache()
    model(mx.array([prompt]), cache=fresh)
    out = list(speculative_steps(model, [prompt[-1]] * 2, cache, InContext(PromptLookup(), prompt),
                                 params=SamplingParams(), max_tokens=32, num_draft_tokens=4))
    assert out[-1][2].drafted > 0 and cache.checkpoints == [cp]
    cache.restore(cp)
    assert _cache_diff(cache, fresh) == 0.0


def test_session_refuses_bad_speculation_settings(demo):
    model, tok = demo
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 1"):
        ChatSession(model, tok, draft="lookup", num_draft_tokens=0)
    with pytest.raises(ValueError, match="draft='nonsense'"):
        ChatSession(model, tok, draft="nonsense")
    with pytest.raises(ValueError, match="sampler"):
        ChatSession(model, tok, draft="lookup", sampling=SamplingParams(sampler=lambda lp: mx.argmax(lp, -1)))


def test_sampled_session_with_a_seed_reproduces(demo):
    """Sampled replies (temp 1, a seed: every reply's draws seeded) with speculation: two sessions give the same
    conversation, drafts were verified, and another seed gives another one."""
    model, tok = demo

    def replies(seed):
        s = ChatSession(model, tok, max_tokens=16, sampling={"temp": 1.0, "seed": seed}, draft=model,
                        num_draft_tokens=4)
        out = []
        for text in TURNS[:2]:
            list(s.send(text))
            out.append(s.last.tokens)
        return out, s.last.stats.drafted_tokens

    (a, drafted), (b, _), (c, _) = replies(3), replies(3), replies(4)
    assert a == b and drafted > 0 and a != c
