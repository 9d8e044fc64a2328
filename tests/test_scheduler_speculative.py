"""Speculative decoding inside the serving engine (``kimi_mlx.server.scheduler`` with ``draft=`` or a request's
``prediction``) on the Kimi Linear fixture (KDA + MLA layers, float32): a request's greedy tokens and log-probabilities
equal those of the same request without speculation, also when the accepted run is cut by a stop token, by
``max_tokens`` or by a reasoning budget, while other requests join and leave the batch (turns switch between
speculative passes and batched steps), and the reply snapshot left after a cut run resumes the next turn with the
log-probabilities of a cold prefill.

References: ``kimi_mlx.generate.stream_generate`` (greedy, one prompt, a fresh cache) and the same engine with
``speculative=False`` requests; drafts that are all accepted / all rejected come from a prediction built from the
reference's own continuation.
"""

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load
from kimi_mlx.server.scheduler import FinishEvent, GenerationRequest, ReasoningBudget, SamplingParams, Scheduler

N = 16
VOCAB = 512


@pytest.fixture(scope="module")
def kl(kl_dir):
    return load(kl_dir / "hf", dtype=mx.float32)


@pytest.fixture(scope="module")
def engines(kl):
    """One engine with prompt lookup and one without a drafter (float latent cache), prefix cache on."""
    made = {"lookup": Scheduler(kl[0], max_batch=4, prefill_chunk=64, draft="lookup", num_draft_tokens=6).start(),
            None: Scheduler(kl[0], max_batch=4, prefill_chunk=64).start()}
    yield made
    for e in made.values():
        e.stop()


def _prompts(count, seed=0):
    """Random prompts that repeat a span of themselves (prompt lookup finds drafts in them)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        head, span = rng.integers(0, VOCAB, 9).tolist(), rng.integers(0, VOCAB, 8).tolist()
        out.append(head + span + head + span[:3])
    return out


def _reference(model, tok, prompt, n=N):
    return [r.token for r in stream_generate(model, tok, prompt, n)]


def _run(stream):
    """(tokens, chosen-token logprobs, finish event) of a stream read to its end."""
    events = list(stream)
    assert isinstance(events[-1], FinishEvent)
    return [e.token for e in events[:-1]], [e.logprob for e in events[:-1]], events[-1]


def _req(prompt, n=N, **kw):
    return GenerationRequest(list(prompt), n, top_logprobs=0, **kw)


@pytest.mark.parametrize("case", ["right", "wrong", "lookup"])
def test_greedy_speculation_equals_plain(kl, engines, case):
    """Predictions that are the reference continuation (every draft accepted), one wrong everywhere (every draft
    rejected) and prompt lookup alone: tokens equal the reference, log-probabilities equal the request without
    speculation (1e-4), and the finish event counts what was drafted and accepted."""
    model, tok = kl
    for prompt in _prompts(3, seed=1):
        want = _reference(model, tok, prompt)
        kw = {"right": {"prediction": tuple(want)}, "wrong": {"prediction": tuple((t + 1) % VOCAB for t in want)},
              "lookup": {}}[case]
        plain_tokens, plain_lps, plain_fin = _run(engines["lookup"].submit(_req(prompt, speculative=False, **kw)))
        tokens, lps, fin = _run(engines["lookup"].submit(_req(prompt, **kw)))
        assert plain_tokens == want and tokens == want
        assert lps == pytest.approx(plain_lps, abs=1e-4)
        assert (plain_fin.drafted, plain_fin.accepted) == (0, 0)
        if case == "right":
            assert fin.accepted == fin.drafted >= N // 2
        elif case == "wrong":
            assert fin.accepted == 0 < fin.drafted
        else:
            assert fin.accepted <= fin.drafted
        assert (fin.reason, fin.generated_tokens) == ("length", N)


def test_a_prediction_speculates_without_a_server_drafter(kl, engines):
    """The engine without ``draft=`` speculates for a request with a prediction, for no other."""
    model, tok = kl
    prompt = _prompts(1, seed=2)[0]
    want = _reference(model, tok, prompt)
    tokens, _, fin = _run(engines[None].submit(_req(prompt, prediction=tuple(want))))
    assert tokens == want and fin.accepted == fin.drafted > 0
    tokens, _, fin = _run(engines[None].submit(_req(prompt)))
    assert tokens == want and fin.drafted == 0


def test_a_stop_token_cuts_the_accepted_run_and_the_reply_snapshot_is_exact(kl, engines):
    """A stop token inside an accepted run ends the reply there; the cache keeps exactly what was emitted, so the
    next turn (from the reply snapshot) has the tokens and log-probabilities of a cold prefill."""
    model, tok = kl
    prompt = _prompts(1, seed=3)[0]
    want = _reference(model, tok, prompt)
    stop = want[9]
    cut = want.index(stop) + 1
    tokens, _, fin = _run(engines["lookup"].submit(_req(prompt, prediction=tuple(want),
                                                        stop_token_ids=frozenset({stop}))))
    assert tokens == want[:cut] and fin.reason == "stop"
    assert fin.drafted > fin.accepted > 0  # every draft was right: the ones not counted followed the stop token
    turn2 = prompt + tokens + [5, 6, 7]
    tokens2, lps2, fin2 = _run(engines["lookup"].submit(_req(turn2, 6, speculative=False)))
    assert fin2.cached_tokens == len(prompt) + cut - 1  # resumed from the reply snapshot
    cold = Scheduler(model, prompt_cache_bytes=0).start()
    try:
        cold_tokens, cold_lps, _ = _run(cold.submit(_req(turn2, 6)))
    finally:
        cold.stop()
    assert tokens2 == cold_tokens == _reference(model, tok, turn2, 6)
    assert lps2 == pytest.approx(cold_lps, abs=1e-4)


def test_max_tokens_and_the_reasoning_budget_cap_the_pass(kl, engines):
    """Every draft right: ``max_tokens`` 5 gives 5 tokens; a reasoning budget of 4 gets its closer after the 4th
    token, as without speculation."""
    model, tok = kl
    prompt = _prompts(1, seed=4)[0]
    want = _reference(model, tok, prompt)
    tokens, _, fin = _run(engines["lookup"].submit(_req(prompt, 5, prediction=tuple(want))))
    assert tokens == want[:5] and (fin.reason, fin.generated_tokens) == ("length", 5) and fin.accepted > 0
    close = (300, 301, 302)
    budget = ReasoningBudget(4, close, frozenset())
    expected = want[:4] + list(close) + _reference(model, tok, prompt + want[:4] + list(close), N - 7)
    tokens, _, fin = _run(engines["lookup"].submit(_req(prompt, prediction=tuple(expected), reasoning=budget)))
    assert tokens == expected and fin.accepted > 0


def test_rows_join_and_leave_while_one_speculates(kl, engines):
    """A long request speculating (every draft right) while three others join and leave (its turns alternate
    between passes and batched steps): every output equals its reference."""
    model, tok = kl
    prompts = _prompts(4, seed=5)
    long_want = _reference(model, tok, prompts[0], 40)
    wants = [_reference(model, tok, p, n) for p, n in zip(prompts[1:], (4, N, 9))]
    e = engines["lookup"]
    long = e.submit(_req(prompts[0], 40, prediction=tuple(long_want)))
    first = next(iter(long))  # it runs alone for a while
    others = [e.submit(_req(p, n)) for p, n in zip(prompts[1:], (4, N, 9))]
    rest, _, fin = _run(long)
    assert [first.token] + rest == long_want and fin.accepted > 0
    for s, want in zip(others, wants):
        assert _run(s)[0] == want
    assert e.stats["speculation"]["accepted"] >= fin.accepted


def test_sampled_speculation_is_reproducible(kl, engines):
    """A seeded sampled request that speculates gives the same tokens twice (its row's key draws the acceptance)."""
    prompt = _prompts(1, seed=6)[0]
    runs = [_run(engines["lookup"].submit(_req(prompt, sampling=SamplingParams(temp=0.9, seed=11))))
            for _ in range(2)]
    assert runs[0][0] == runs[1][0] and runs[0][2].drafted > 0


def test_draft_max_batch_above_one_is_refused(kl):
    with pytest.raises(ValueError, match="draft_max_batch 2: only 1 is supported"):
        Scheduler(kl[0], draft="lookup", draft_max_batch=2)
    with pytest.raises(ValueError, match="draft must be None, 'lookup' or a draft model"):
        Scheduler(kl[0], draft="lokup")


def test_prompt_lookup_reads_a_reference_in_order():
    """A reference (a predicted reply) is proposed from its start when nothing is generated yet, then from where
    the accepted drafts from it ended (a repeated n-gram later in it is not jumped to), before the history."""
    from kimi_mlx.speculative import PromptLookup

    prompt = [1, 2, 3, 9, 8]
    ref = [7, 8, 9, 7, 8, 6, 7, 8, 5]
    look = PromptLookup(ngram_sizes=(2, 1), reference=ref, reference_at=len(prompt))
    assert look.propose(prompt, 4) == [7, 8, 9, 7]
    look.observe(4, 4)
    history = prompt + [7, 8, 9, 7, 8]  # the target's own token after them: 8
    assert look.propose(history, 3) == [6, 7, 8]  # after "7 8" at 3..4, not after its first occurrence at 0..1
    look.observe(1, 3)
    assert look.propose(history + [6, 4], 3) == []  # "6 4" and "4" occur nowhere
    assert PromptLookup(ngram_sizes=(1,)).propose([5, 6, 5], 2) == [6, 5]


def test_a_draft_model_speculates_exactly(kl):
    """``draft=`` a model (the target itself: every greedy draft is right): each row's ``DraftModel`` follows its
    history across passes and batched turns; tokens and log-probabilities equal the request without speculation;
    a request with a (wrong) prediction drafts by lookup instead."""
    model, tok = kl
    prompts = _prompts(3, seed=7)
    wants = [_reference(model, tok, p) for p in prompts]
    e = Scheduler(model, max_batch=2, prefill_chunk=64, draft=model, num_draft_tokens=4).start()
    try:
        plain = [_run(e.submit(_req(p, speculative=False))) for p in prompts]
        first = _run(e.submit(_req(prompts[0])))
        both = [e.submit(_req(p, 20 if i else N)) for i, p in enumerate(prompts[1:])]  # batched, then one alone
        rest = [_run(s) for s in both]
        wrong = _run(e.submit(_req(prompts[0], prediction=tuple((t + 1) % VOCAB for t in wants[0]))))
    finally:
        e.stop()
    for (tokens, lps, fin), (want_tokens, want_lps, _) in zip([first, *rest], plain):
        assert tokens[:N] == want_tokens and lps[:N] == pytest.approx(want_lps, abs=1e-4)
    assert rest[1][0] == _reference(model, tok, prompts[2], 20)
    assert first[2].accepted == first[2].drafted > 0 and rest[1][2].accepted == rest[1][2].drafted > 0
    assert wrong[0] == wants[0] and wrong[2].accepted == 0 < wrong[2].drafted
    assert e.stats["speculation"]["draft"] == "model"


def test_an_8_bit_latent_cache_speculates_exactly(kl):
    """With ``kv_bits=8`` (every row's latent cache quantized) a right and a wrong prediction give the tokens and
    log-probabilities of the request without speculation, and the reply snapshot after a stop-token cut resumes
    the next turn as a cold 8-bit engine does."""
    model, _ = kl
    prompt = _prompts(1, seed=8)[0]
    e = Scheduler(model, prefill_chunk=64, kv_bits=8).start()
    cold = Scheduler(model, prompt_cache_bytes=0, kv_bits=8).start()
    try:
        want, want_lps, _ = _run(e.submit(_req(prompt, speculative=False)))
        for prediction in (want, [(t + 1) % VOCAB for t in want]):
            tokens, lps, fin = _run(e.submit(_req(prompt, prediction=tuple(prediction))))
            assert tokens == want and lps == pytest.approx(want_lps, abs=1e-4) and fin.drafted > 0
        stop = want[7]
        tokens, _, _ = _run(e.submit(_req(prompt, prediction=tuple(want), stop_token_ids=frozenset({stop}))))
        turn2 = prompt + tokens + [5, 6]
        resumed, resumed_lps, fin = _run(e.submit(_req(turn2, 6, speculative=False)))
        assert fin.cached_tokens == len(prompt) + len(tokens) - 1
        fresh, fresh_lps, _ = _run(cold.submit(_req(turn2, 6)))
        assert resumed == fresh and resumed_lps == pytest.approx(fresh_lps, abs=1e-4)
    finally:
        e.stop()
        cold.stop()
