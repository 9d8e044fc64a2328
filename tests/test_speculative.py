"""Speculative decoding (``kimi_mlx.speculative``): greedy output identical to plain decoding, exact rollback of the
hybrid cache, the speculative-sampling rule preserving the target's distribution, the adaptive draft length.

References are independent computations: plain decoding is mlx-lm's ``generate_step`` (one token per forward pass);
a "fresh prefill" is a new cache fed the same tokens in one pass; distributions are numpy's softmax of the logits.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from speculative_helpers import (
    VOCAB, ScriptedDrafter, chi2, chi2_threshold, max_diff, plain_greedy, random_prompts, softmax,
)

from kimi_mlx.sampling import SamplingParams
from kimi_mlx.speculative.adaptive import EMPTY_OFF
from kimi_mlx.speculative import (
    DraftLength, PromptLookup, TargetSampling, accept_greedy, accept_sampled, rollback, speculative_steps, verify_pass,
)


def _spec(model, prompt, n, drafter, kv_bits=None, k=6, length=None):
    steps = speculative_steps(model, prompt, model.make_cache(kv_bits=kv_bits), drafter, params=SamplingParams(),
                              max_tokens=n, num_draft_tokens=k, length=length)
    return [t for t, _, _ in steps][:n]


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_greedy_lookup_equals_plain_decoding(arch, kv_bits):
    """20 prompts x 64 tokens (and 2 x 128) per fixture and latent cache: prompt-lookup speculation (kept on) gives
    the tokens of plain greedy decoding, and it did draft, accept and reject (the check is not vacuous)."""
    _, _, _, model = arch
    drafted = accepted = 0
    for i, prompt in enumerate(random_prompts(22, seed=1)):
        n = 128 if i >= 20 else 64
        plain = plain_greedy(model, prompt, n, kv_bits)
        drafter = PromptLookup(max_draft=8)
        seen = []
        length = DraftLength(8, start=8, off_below=0.0)  # kept on: every lookup hit is verified and rolled back
        steps = speculative_steps(model, prompt, model.make_cache(kv_bits=kv_bits), drafter, params=SamplingParams(),
                                  max_tokens=n, length=length)
        for t, _, s in steps:
            seen.append((t, s))
        assert [t for t, _ in seen][:n] == plain, f"prompt {i}"
        drafted, accepted = drafted + seen[-1][1].drafted, accepted + seen[-1][1].accepted
    assert drafted > 0 and 0 < accepted < drafted


@pytest.mark.parametrize("kv_bits", [None, 8])
@pytest.mark.parametrize("right", [True, False], ids=["all-accepted", "all-rejected"])
def test_greedy_forced_acceptance_equals_plain_decoding(arch, kv_bits, right):
    """Drafts made from the target's own greedy continuation: all accepted, or all rejected (speculation kept on);
    the tokens are plain decoding's and the outcomes are what was forced."""
    _, _, _, model = arch
    for prompt in random_prompts(4, seed=2):
        plain = plain_greedy(model, prompt, 72, kv_bits)
        drafter = ScriptedDrafter(len(prompt), plain, right)
        length = DraftLength(5, start=5, off_below=0.0)  # never switched off: every pass drafts
        assert _spec(model, prompt, 64, drafter, kv_bits, k=5, length=length) == plain[:64]
        full = [(a, p) for a, p in drafter.outcomes if p > 0]
        assert full and all(a == (p if right else 0) for a, p in full)


def _rollback_rounds(model, kv_bits, seed, check):
    """Prefill a prompt, then 10 verify passes whose drafts mix the target's right next token with wrong ones (so
    0 .. k drafts are accepted), each followed by ``rollback``; ``check(cache, segments)`` after each."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 30).tolist()
    cache = model.make_cache(kv_bits=kv_bits)
    model(mx.array([prompt[:-1]]), cache=cache)
    segments, last, counts = [prompt[:-1]], prompt[-1], set()
    for r in range(10):
        right = int(rng.integers(0, 4))  # how many right drafts lead the proposal
        probe = model.make_cache(kv_bits=kv_bits)
        for s in segments:
            model(mx.array([s]), cache=probe)
        ids, drafts = [last], []
        for _ in range(right):  # the target's greedy continuation, from a separate cache
            nxt = int(mx.argmax(model(mx.array([ids[-1:]]), cache=probe)[0, -1]).item())
            ids.append(nxt)
            drafts.append(nxt)
        drafts += rng.integers(0, VOCAB, int(rng.integers(1, 4))).tolist() if r % 3 else []
        tokens, n = accept_greedy(verify_pass(model, cache, last, drafts), drafts)
        rollback(model, cache, last, drafts, n)
        counts.add((n, len(drafts)))
        segments.append([last] + drafts[:n])
        last = tokens[-1]
        check(cache, segments)
    assert any(n < k for n, k in counts) and any(n == k > 0 for n, k in counts)


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_rollback_equals_the_same_tokens_fed_fresh(arch, kv_bits):
    """After each rollback the cache is exactly (bitwise: nothing of a rejected token is left) a fresh cache fed the
    same accepted segments, float and 8-bit latent."""
    _, _, _, model = arch

    def check(cache, segments):
        ref = model.make_cache(kv_bits=kv_bits)
        for s in segments:
            model(mx.array([s]), cache=ref)
        assert max_diff(cache, ref, relative=False) == 0.0

    _rollback_rounds(model, kv_bits, seed=3, check=check)


@pytest.mark.parametrize("case", ["kimi_linear-float", "kimi_k3-float", "kimi_linear-8bit"])
def test_rollback_matches_a_fresh_prefill(request, case):
    """After each rollback the cache equals a fresh one-pass prefill of the same tokens to 1e-5 (relative to the
    array's scale where it exceeds 1). For K3's 8-bit latent a one-pass prefill is not a 1e-5 reference: plain
    decoding itself differs from it by flipped 8-bit codes (see the package docstring); the bitwise test covers it."""
    name, kind = case.split("-")
    model = request.getfixturevalue("kl_model" if name == "kimi_linear" else "k3_model")
    kv_bits = 8 if kind == "8bit" else None

    def check(cache, segments):
        ref = model.make_cache(kv_bits=kv_bits)
        model(mx.array([[t for s in segments for t in s]]), cache=ref)
        assert max_diff(cache, ref) <= 1e-5

    _rollback_rounds(model, kv_bits, seed=4, check=check)


# --- sampled acceptance on fixed logits -----------------------------------------------------------------------------

N_DRAWS = 20000


@pytest.mark.parametrize("with_q", [False, True], ids=["one-hot draft", "draft distribution"])
def test_sampled_acceptance_preserves_the_target_distribution(with_q):
    """Fixed logits (3 positions, vocab 12): over 20000 seeded draws, the first emitted token follows softmax(l_0 / T)
    and, when the first draft was accepted, the second follows softmax(l_1 / T) (chi-square, each test's
    false-failure rate 1e-4; both together <= 2e-4). One-hot: fixed likely drafts (model-free drafter); with a draft
    distribution q, each draft is drawn from q as a draft model would."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1.5, (3, 12)).astype(np.float32)
    temp = 0.8
    p = softmax(logits, temp)
    q = softmax(rng.normal(0, 1.0, (2, 12)), 1.0) if with_q else None
    target = TargetSampling(temp).probs(mx.log(mx.softmax(mx.array(logits), axis=-1)))
    mx.random.seed(11)
    firsts, seconds = np.zeros(12), np.zeros(12)
    for _ in range(N_DRAWS):
        if q is None:
            tokens, n = accept_sampled(target, [int(np.argsort(p[0])[-2]), int(np.argmax(p[1]))])
        else:
            drafts = [int(rng.choice(12, p=q[0])), int(rng.choice(12, p=q[1]))]
            tokens, n = accept_sampled(target, drafts, mx.array(q.astype(np.float32)))
        firsts[tokens[0]] += 1
        if n >= 1:
            seconds[tokens[1]] += 1
    assert 0.1 * N_DRAWS < seconds.sum() < 0.9 * N_DRAWS  # both acceptance and rejection happen often
    for counts, probs in ((firsts, p[0]), (seconds, p[1])):
        stat, df = chi2(counts, probs)
        assert stat < chi2_threshold(df), (stat, df, counts, probs * counts.sum())


def test_target_sampling_matches_mlx_lm_filters():
    """TargetSampling's distribution with top_k / top_p is what mlx-lm's filters leave, at temperature T (numpy)."""
    logits = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], np.float32)
    lp = mx.array(logits) - mx.logsumexp(mx.array(logits), axis=-1, keepdims=True)
    got = np.array(TargetSampling(0.7, top_k=3).probs(lp))
    want = softmax(np.where(np.arange(6) < 3, logits, -np.inf), 0.7)
    np.testing.assert_allclose(got, want, atol=1e-6)
    got = np.array(TargetSampling(1.0, top_p=0.8).probs(lp))
    p = softmax(logits, 1.0)[0]
    keep = np.cumsum(np.sort(p)[::-1]) - np.sort(p)[::-1] < 0.8  # smallest set whose mass reaches top_p
    want = np.where(keep, p, 0) / p[keep].sum()
    np.testing.assert_allclose(got[0], want, atol=1e-6)


def test_sampled_runs_are_reproducible_and_speculate(kl_model):
    """Seeded sampled runs with speculation give the same tokens twice; drafts are accepted on a repetitive prompt."""
    prompt = random_prompts(2, seed=6)[1]

    def run():
        mx.random.seed(7)
        steps = speculative_steps(kl_model, prompt, kl_model.make_cache(), PromptLookup(),
                                  params=SamplingParams(temp=0.3), max_tokens=48)
        return [(t, s.drafted, s.accepted) for t, _, s in steps]

    first = run()
    assert first == run() and first[-1][1] > 0


# --- drafts and the draft length ------------------------------------------------------------------------------------


def test_prompt_lookup_proposes_the_continuation_of_the_latest_match():
    d = PromptLookup(ngram_sizes=(2, 1), max_draft=3)
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2], 8) == [5, 6, 1]  # latest "1 2" wins, capped at max_draft
    assert d.propose([1, 2, 3, 4, 9, 1, 2], 2) == [3, 4]
    assert d.propose([7, 8, 9], 4) == []  # no earlier occurrence
    assert PromptLookup(ngram_sizes=(3,)).propose([1, 2, 3, 9, 2, 3], 4) == []  # only the 3-gram is tried


def test_draft_length_grows_shrinks_and_switches_off():
    L = DraftLength(8, start=2, window=2, off_below=0.3, cooldown=4)
    lengths = []
    for _ in range(3):  # every draft accepted: 2 -> 4 -> 8 -> 8
        lengths.append(L.next_length())
        L.observe(lengths[-1], lengths[-1])
    assert lengths == [2, 4, 8] and L.next_length() == 8
    L.observe(2, 8)  # two accepted: draft three next (a = 11 / 13 still pays)
    assert L.next_length() == 3
    L.observe(0, 3)  # window (2 of 8, 0 of 3): 2 / 11 < 0.3: off for the cool-down
    for _ in range(4):  # the run before paid for more than the window: the base cool-down
        assert L.next_length() == 0
        L.observe(0, 0)  # plain steps count the cool-down down
    assert L.next_length() == 1  # a probe at min_k
    L.observe(0, 1)  # it found nothing: off again, for twice as long
    for _ in range(8):
        assert L.next_length() == 0
        L.observe(0, 0)
    L.observe(1, L.next_length())  # a probe that accepts: a = 2 / 3 pays at k = 2: on, growing
    assert L.next_length() == 2
    L.observe(0, 2)  # window (1 of 1, 0 of 2): 1 / 3 >= 0.3 but a = 2 / 4 does not pay at k = 1: off
    assert L.gain(1, 0.5) < 1 and L.next_length() == 0
    assert L.off_for == 16  # the run since the probe did not pay: twice the last cool-down again


def test_draft_length_gain_is_tokens_per_pass_over_cost():
    """``gain`` against a direct count: E(a, k) = sum of a^i for i = 0..k tokens per pass (geometric acceptance),
    cost 1 + draft_cost k + refeed_cost P(a rejection)."""
    L = DraftLength(8, draft_cost=0.5, refeed_cost=1.0)
    for a, k in ((0.0, 1), (0.5, 3), (0.9, 8), (1.0, 4)):
        tokens = sum(a**i for i in range(k + 1))
        assert L.gain(k, a) == pytest.approx(tokens / (1 + 0.5 * k + (1 - a**k)))
    assert L.gain(4, 1.0) == pytest.approx(5 / 3)


def test_draft_length_at_zero_acceptance_backs_off_exponentially():
    """Every draft rejected: the drafting passes of n tokens grow like log2(n / cooldown), and a drafter that is right
    now and then (every fourth probe hits once) does not reset the back-off."""

    def passes(n, hit_every):
        L, count = DraftLength(8, cooldown=16), 0
        for _ in range(n):
            k = L.next_length()
            if k:
                count += 1
                L.observe(int(count % hit_every == 0) if hit_every else 0, k)
            else:
                L.observe(0, 0)
        return count

    assert passes(1024, 0) == 7  # at 0, 17, 50, 115, 244, 501, 1014: cool-downs 16, 32, .. 512
    assert passes(4096, 0) == 10  # then one per max_cooldown (1024)
    assert passes(4096, 4) <= 14
    empty = DraftLength(8, cooldown=16)  # a drafter with nothing to propose: off after EMPTY_OFF asks
    for _ in range(EMPTY_OFF):
        assert empty.next_length() == 2
        empty.observe(0, 0)
    assert empty.next_length() == 0 and empty.off_for == 16
    forced = DraftLength(8, off_below=0.0)  # off_below 0: never off, whatever the cost
    for _ in range(10):
        forced.observe(0, forced.next_length())
    assert forced.next_length() == 1


def test_speculation_switches_off_when_every_draft_is_rejected(kl_model):
    """With the adaptive length, a drafter whose every draft is wrong is asked less and less: far fewer tokens are
    drafted than with speculation forced on."""
    prompt = random_prompts(1, seed=8)[0]
    plain = plain_greedy(kl_model, prompt, 100)

    def drafted(length):
        steps = speculative_steps(kl_model, prompt, kl_model.make_cache(), ScriptedDrafter(len(prompt), plain, False),
                                  params=SamplingParams(), max_tokens=96, num_draft_tokens=4, length=length)
        out = list(steps)
        assert [t for t, _, _ in out][:96] == plain[:96]
        return out[-1][2].drafted

    forced, adaptive = drafted(DraftLength(4, off_below=0.0)), drafted(None)
    assert adaptive * 4 < forced


class CountingModel:
    """The model, counting the token positions each forward pass feeds (what a pass costs, up to the pass's fixed
    overhead: a regression test of the low-acceptance cost that does not time anything)."""

    def __init__(self, model):
        self.model, self.fed = model, []

    def __call__(self, x, cache=None):
        self.fed.append(x.shape[1])
        return self.model(x, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_low_acceptance_costs_a_few_extra_positions(kl_model):
    """Every draft rejected, the default adaptive length: over 256 tokens the passes feed at most 8 positions beyond
    plain decoding's one per token (the drafting passes back off exponentially: passes at tokens 0, 66, 195), and
    between them the model runs plain single-token steps. The tokens are plain decoding's."""
    prompt = random_prompts(3, seed=11)[2]
    plain = plain_greedy(kl_model, prompt, 260)
    counting = CountingModel(kl_model)
    drafter = ScriptedDrafter(len(prompt), plain, False)
    out = list(speculative_steps(counting, prompt, kl_model.make_cache(), drafter, params=SamplingParams(),
                                 max_tokens=256, num_draft_tokens=8))
    assert [t for t, _, _ in out] == plain[:256]
    decode = counting.fed[1:] if len(prompt) > 1 else counting.fed  # the first call is the prompt's prefill
    passes = [p for p in drafter.outcomes if p[1]]
    assert len(passes) == 3 and all(a == 0 for a, _ in passes)
    assert sum(decode) - 256 <= 8  # drafts fed (2 + 1 + 1) and re-feeds of `last` (3), beyond one per token
    assert len(decode) == 256 + 3  # one forward per token (plain decoding's) + one re-feed per drafting pass


def test_the_callers_checkpoints_survive_speculation(kl_model):
    """A checkpoint the caller took after the prompt is still there after speculative decoding (the passes release
    their own), and restoring it gives the prompt's cache back."""
    prompt = random_prompts(2, seed=9)[1]
    cache = kl_model.make_cache()
    kl_model(mx.array([prompt]), cache=cache)
    cp = cache.checkpoint()
    fresh = kl_model.make_cache()
    kl_model(mx.array([prompt]), cache=fresh)
    out = list(speculative_steps(kl_model, [prompt[-1]] * 2, cache, PromptLookup(), params=SamplingParams(),
                                 max_tokens=40))
    assert out[-1][2].drafted > 0 and cache.checkpoints == [cp]
    cache.restore(cp)
    assert max_diff(cache, fresh, relative=False) == 0.0


def test_greedy_with_logits_processors_equals_plain_decoding():
    """With penalties and a logit bias (processors that read the history), speculation gives the tokens of plain
    decoding: each verified position is processed on the history plus the drafts before it. Drafts: prompt lookup,
    and the plain continuation itself (every draft accepted, so later positions depend on the drafts' penalties)."""
    from kimi_mlx import load
    from kimi_mlx.generate import stream_generate

    model, tok = load("demo")
    prompt = tok.encode("one two three four, one two three four, one two three four, one two")
    opts = dict(repetition_penalty=1.5, presence_penalty=1.0, logit_bias={int(prompt[3]): 2.0})
    plain = [r.token for r in stream_generate(model, tok, prompt, 72, **opts)]
    for drafter in (PromptLookup(), ScriptedDrafter(len(prompt), plain, right=True)):
        length = DraftLength(6, start=6, off_below=0.0)
        steps = speculative_steps(model, prompt, model.make_cache(), drafter, params=SamplingParams(**opts),
                                  processors=_processors(opts), max_tokens=64, length=length)
        out = list(steps)
        assert [t for t, _, _ in out][:64] == plain[:64] and out[-1][2].drafted > 0
        if isinstance(drafter, ScriptedDrafter):
            assert out[-1][2].accepted == out[-1][2].drafted


def _processors(opts):
    from kimi_mlx.sampling import make_sampling

    return make_sampling(SamplingParams(**opts))[1]


def test_stream_generate_with_lookup_reports_counts():
    from kimi_mlx import load
    from kimi_mlx.generate import stream_generate

    model, tok = load("demo")
    prompt = tok.encode("the cat sat on the mat. the cat sat on the mat. the cat")
    plain = [(r.token, r.text) for r in stream_generate(model, tok, prompt, 40)]
    spec = list(stream_generate(model, tok, prompt, 40, draft="lookup", num_draft_tokens=4))
    assert [(r.token, r.text) for r in spec] == plain
    assert spec[-1].drafted_tokens > 0 and spec[-1].finish_reason == "length"
    assert spec[-1].drafted_tokens >= spec[-1].accepted_tokens
    assert [r.drafted_tokens for r in stream_generate(model, tok, prompt, 5)] == [0] * 5
    with pytest.raises(ValueError, match="sampler"):
        list(stream_generate(model, tok, prompt, 5, draft="lookup", sampler=lambda lp: mx.argmax(lp, -1)))
