"""Draft-model speculation (``kimi_mlx.speculative.DraftModel``, ``loading.load_draft``, ``draft=`` /
``draft_model=``): greedy output identical to plain decoding with a draft that always agrees (the target itself),
rarely (other random weights of the same shapes) or sometimes (the target's weights perturbed); the draft's cache after
its rollbacks is what it claims to hold, also when the history diverges or skips ahead; the sampled rule with the
draft's own q; the refusals.

References are independent computations: plain decoding is mlx-lm's ``generate_step``; a cache's reference is a fresh
cache fed the same ids (the same segments: bitwise; in one pass: within 1e-5); a fresh ``DraftModel`` on the same
history gives the reference drafts; the target's distributions are numpy's softmax of a fresh forward's logits.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from speculative_helpers import VOCAB, chi2, chi2_threshold, max_diff, plain_greedy, random_prompts

from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load, load_draft, load_model
from kimi_mlx.sampling import SamplingParams
from kimi_mlx.speculative import DraftLength, DraftModel, TargetSampling, accept_sampled, speculative_steps, verify_pass

_VARIANTS: dict = {}


def _variant(path, eps=None, seed=1):
    """The fixture's model with other weights of the same shapes: each tensor redrawn from a normal with its own mean
    and std (``eps`` None), or the target's tensor plus ``eps`` times its std of noise. Built once per module."""
    key = (str(path), eps, seed)
    if key not in _VARIANTS:
        model, _ = load_model(path, dtype=mx.float32)
        rng = np.random.default_rng(seed)
        new = []
        for name, v in tree_flatten(model.parameters()):
            a = np.array(v, dtype=np.float64)
            noise = rng.standard_normal(a.shape)
            a = a.mean() + a.std() * noise if eps is None else a + eps * a.std() * noise
            new.append((name, mx.array(a.astype(np.float32))))
        model.update(tree_unflatten(new))
        mx.eval(model.parameters())
        _VARIANTS[key] = model
    return _VARIANTS[key]


def _draft_for(kind, path, target):
    """"self": the target; "other": other random weights; "perturbed": the target's weights plus 2% noise."""
    return {"self": lambda: target, "other": lambda: _variant(path),
            "perturbed": lambda: _variant(path, eps=0.02)}[kind]()


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_greedy_with_a_draft_model_equals_plain_decoding(arch, kv_bits):
    """Two prompts x 32 tokens per fixture and latent cache, speculation kept on: with the target as its own draft
    every draft is accepted, with other random weights almost none (<= 10%), with perturbed weights some but not
    all; the tokens are plain greedy decoding's in every case."""
    _, path, _, model = arch
    counts = {kind: [0, 0] for kind in ("self", "other", "perturbed")}
    for prompt in random_prompts(2, seed=21):
        plain = plain_greedy(model, prompt, 32, kv_bits)
        for kind in counts:
            draft = DraftModel(_draft_for(kind, path / "hf", model), kv_bits=kv_bits)
            length = DraftLength(6, start=4, off_below=0.0)
            out = list(speculative_steps(model, prompt, model.make_cache(kv_bits=kv_bits), draft,
                                         params=SamplingParams(), max_tokens=32, length=length))
            assert [t for t, _, _ in out] == plain, kind
            counts[kind][0] += out[-1][2].drafted
            counts[kind][1] += out[-1][2].accepted
    (sd, sa), (od, oa), (pd, pa) = counts["self"], counts["other"], counts["perturbed"]
    assert sd > 0 and sa == sd, counts
    assert od > 0 and oa <= 0.1 * od, counts
    assert 0.1 * pd < pa < pd, counts


class Recording:
    """A model wrapper logging each forward (the cache, its offset before, the ids): which segments a cache was fed."""

    def __init__(self, model):
        self.model, self.args, self.calls = model, model.args, []

    def make_cache(self, **kwargs):
        return self.model.make_cache(**kwargs)

    def __call__(self, inputs, cache=None):
        self.calls.append((cache, cache.offset, inputs[0].tolist()))
        return self.model(inputs, cache=cache)

    def segments(self, cache):
        """The segments ``cache`` now holds: its forwards in order, those a rollback went back over dropped (a
        rollback must land between segments: the states inside one were never computed)."""
        segs = []
        for c, offset, ids in self.calls:
            if c is not cache:
                continue
            while sum(map(len, segs)) > offset:
                segs.pop()
            assert sum(map(len, segs)) == offset, "the cache went back to a position inside a fed segment"
            segs.append(ids)
        return segs


def _drive(draft, prompt, rng, check):
    """Nine proposals on a history that, in turn, takes some drafts and a token of its own (a verify pass's
    outcome), skips ahead by tokens the draft never proposed, or is edited before its end (diverges);
    ``check(history, drafts)`` after each. After an outcome the next proposal feeds only what is new (the last
    draft when all were taken, the token, the draft steps): the rejected drafts are dropped by a checkpoint restore,
    not re-fed."""
    history, expect = list(prompt), None
    for r in range(9):
        k = int(rng.integers(1, 6))
        before = len(draft.model.calls)
        drafts = draft.propose(history, k)
        fed = [t for _, _, ids in draft.model.calls[before:] for t in ids]
        if expect is not None:
            assert fed == expect + [history[-1]] + drafts[:-1], (fed, expect, history[-1], drafts)
        check(history, drafts)
        expect = None
        if r % 4 == 2:
            history += rng.integers(0, VOCAB, int(rng.integers(2, 8))).tolist()
        elif r % 4 == 3:
            history = history[: len(history) - int(rng.integers(1, 6))] + rng.integers(0, VOCAB, 3).tolist()
        else:
            n = int(rng.integers(0, k + 1))
            token = (drafts[n] + 1) % VOCAB if n < k else int(rng.integers(0, VOCAB))
            history += drafts[:n] + [token]
            expect = drafts[-1:] if n == k else []


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_the_draft_cache_after_rollbacks_is_what_it_holds(arch, kv_bits):
    """After every proposal the draft holds the history and its drafts but the last (``tokens``), and its cache is
    bitwise a fresh cache fed the same segments and within 1e-5 of a fresh one-pass prefill of those ids (not for
    K3's 8-bit latent, where incremental feeding flips codes against a one-pass prefill: tests/test_speculative.py);
    a rejected suffix is not re-fed (``_drive``); float drafts equal a fresh draft model's on the same history (also
    after a skip or an edit)."""
    name, _, _, model = arch
    draft = DraftModel(Recording(model), kv_bits=kv_bits)

    def check(history, drafts):
        assert len(drafts) >= 1 and draft.tokens == history + drafts[:-1]
        ref = model.make_cache(kv_bits=kv_bits)
        for seg in draft.model.segments(draft.cache):
            model(mx.array([seg]), cache=ref)
        assert max_diff(draft.cache, ref, relative=False) == 0.0
        if not (name == "kimi_k3" and kv_bits):
            one = model.make_cache(kv_bits=kv_bits)
            model(mx.array([draft.tokens]), cache=one)
            assert max_diff(draft.cache, one) <= 1e-5
        if kv_bits is None:
            assert drafts == DraftModel(model).propose(history, len(drafts))

    _drive(draft, random_prompts(3, seed=31)[2], np.random.default_rng(32), check)


def test_sampled_draft_probs_are_the_draft_models_distribution(kl_model):
    """Sampled drafting: ``draft_probs`` row i is the target's sampling options (temp, top_k, the processors) applied
    to a fresh forward of the draft model over the history and the drafts before it (numpy softmax), and each draft
    lies where its row is positive."""
    prompt = random_prompts(3, seed=41)[1]
    draft = DraftModel(kl_model)
    bias = {int(prompt[-1]): 3.0}
    from kimi_mlx.sampling import make_sampling

    _, processors = make_sampling(SamplingParams(logit_bias=bias))
    draft.prepare(kl_model, TargetSampling(0.7, top_k=5), processors)
    mx.random.seed(4)
    drafts = draft.propose(prompt, 3)
    q = np.array(draft.draft_probs)
    assert q.shape == (3, VOCAB)
    for i in range(3):
        logits = np.array(kl_model(mx.array([prompt + drafts[:i]]))[0, -1], dtype=np.float64)
        for t, b in bias.items():
            logits[t] += b
        keep = np.argsort(logits)[::-1][:5]
        want = np.zeros(VOCAB)
        want[keep] = np.exp((logits[keep] - logits[keep].max()) / 0.7)
        np.testing.assert_allclose(q[i], want / want.sum(), atol=1e-5)
        assert q[i, drafts[i]] > 0


N_DRAWS = 400


def test_sampled_with_a_draft_model_keeps_the_target_distribution(kl_dir, kl_model):
    """One verify pass of k = 2 drafts drawn by a perturbed draft model (top_k 4, temp 0.7: its top 4 overlap the
    target's in part, so drafts are accepted, rejected, and sometimes have p = 0), repeated over 400 seeded draws from
    the same prompt, the acceptance rule given the draft's q: the first token follows the target's p_0 and, when the
    first token was the accepted draft a (the likeliest accepted first draft), the second follows p_1( . | a), numpy's
    softmax of fresh forwards (chi-square; each test's false-failure rate 1e-4, 2e-4 together)."""
    target, prompt = kl_model, random_prompts(3, seed=11)[1]
    sampling = TargetSampling(0.7, top_k=4)
    draft = DraftModel(_variant(kl_dir / "hf", eps=0.1))
    draft.prepare(target, sampling)

    def dist(model, ids):
        logits = np.array(model(mx.array([ids]))[0, -1], dtype=np.float64)
        keep, out = np.argsort(logits)[::-1][:4], np.zeros(VOCAB)
        out[keep] = np.exp((logits[keep] - logits[keep].max()) / 0.7)
        return out / out.sum()

    p0, q0 = dist(target, prompt), dist(draft.model, prompt)
    a = int(np.argmax(np.minimum(p0, q0)))  # the likeliest accepted first draft
    p1 = dist(target, prompt + [a])
    cache = target.make_cache()
    target(mx.array([prompt[:-1]]), cache=cache)
    cp = cache.checkpoint()
    firsts, seconds, accepted = np.zeros(VOCAB), np.zeros(VOCAB), 0
    mx.random.seed(12)
    for _ in range(N_DRAWS):
        cache.restore(cp)
        drafts = draft.propose(prompt, 2)
        logits = verify_pass(target, cache, prompt[-1], drafts)
        probs = sampling.probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        tokens, n = accept_sampled(probs, drafts, draft.draft_probs)
        firsts[tokens[0]] += 1
        accepted += n
        if n >= 1 and tokens[0] == a:
            seconds[tokens[1]] += 1
    assert 0.2 * N_DRAWS < accepted < 1.8 * N_DRAWS and seconds.sum() > 100  # both outcomes, often
    assert firsts[p0 == 0].sum() == 0 and seconds[p1 == 0].sum() == 0  # never a token the target cannot sample
    for counts, probs in ((firsts, p0), (seconds, p1)):
        stat, df = chi2(counts, probs)
        assert stat < chi2_threshold(df), (stat, df, counts[probs > 0], probs[probs > 0] * counts.sum())


def test_sampled_self_draft_accepts_everything_and_reproduces(kl_dir, kl_model):
    """Sampling (temp 0.8, top_p 0.9) with the target as its own draft: q equals p, so the rule accepts (nearly)
    every draft (one-hot q would accept with probability p(d), a few percent here); seeded runs give the same tokens
    and counts, with that draft and with a perturbed one."""
    prompt = random_prompts(2, seed=51)[0]

    def run(draft):
        mx.random.seed(9)
        steps = speculative_steps(kl_model, prompt, kl_model.make_cache(), DraftModel(draft),
                                  params=SamplingParams(temp=0.8, top_p=0.9), max_tokens=48,
                                  length=DraftLength(6, start=4, off_below=0.0))
        return [(t, s.drafted, s.accepted) for t, _, s in steps]

    first = run(kl_model)
    assert first == run(kl_model)
    drafted, accepted = first[-1][1:]
    assert drafted > 20 and accepted >= 0.95 * drafted, (drafted, accepted)
    perturbed = _variant(kl_dir / "hf", eps=0.02)
    assert run(perturbed) == run(perturbed)


def test_greedy_with_processors_and_a_draft_model_equals_plain_decoding(kl_dir):
    """``stream_generate(draft=load_draft(path, tok))`` with a repetition penalty and a logit bias, float and 8-bit
    latent (the draft's cache quantized as the target's): the responses' tokens and text are plain decoding's, and
    the target as its own draft has every draft accepted: the draft applies the same processors (without them it
    would propose the tokens the penalty moves the target away from)."""
    model, tok = load(kl_dir / "hf", dtype=mx.float32)
    draft = load_draft(kl_dir / "hf", tok, dtype=mx.float32)
    assert draft.image_encoder is None
    prompt = random_prompts(4, seed=61)[3]
    opts = dict(repetition_penalty=1.3, logit_bias={int(prompt[2]): 1.5})
    for kv_bits in (None, 8):

        def kw():  # a quantized latent needs a prompt cache on the plain path (mlx-lm's rule)
            return {} if kv_bits is None else dict(kv_bits=kv_bits, prompt_cache=model.make_cache())

        plain = [(r.token, r.text) for r in stream_generate(model, tok, prompt, 40, **opts, **kw())]
        spec = list(stream_generate(model, tok, prompt, 40, draft=draft, num_draft_tokens=4, **opts, **kw()))
        assert [(r.token, r.text) for r in spec] == plain
        assert spec[-1].drafted_tokens > 10 and spec[-1].accepted_tokens == spec[-1].drafted_tokens


def _swap_two_tokens(path):
    lines = (path / "tiktoken.model").read_text().splitlines()
    (a, ra), (b, rb) = lines[100].split(), lines[101].split()
    lines[100], lines[101] = f"{b} {ra}", f"{a} {rb}"
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")


def test_load_draft_refuses_another_vocabulary(kl_copy, kl_dir):
    """``load_draft`` of a checkpoint whose tokenizer maps two ids to each other's tokens, or has one id fewer
    (its last special token removed): ValueError naming the path and what differs."""
    _, tok = load(kl_dir / "hf")
    _swap_two_tokens(kl_copy)
    with pytest.raises(ValueError, match=rf"{kl_copy}.*2 ids name other tokens \(id 100"):
        load_draft(kl_copy, tok)
    _swap_two_tokens(kl_copy)  # back as it was
    cfg = json.loads((kl_copy / "tokenizer_config.json").read_text())
    del cfg["added_tokens_decoder"][str(max(map(int, cfg["added_tokens_decoder"])))]
    (kl_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"{kl_copy}.*vocabulary of 511 ids, the target's 512"):
        load_draft(kl_copy, tok)


def test_draft_refusals(kl_dir, kl_model):
    """A draft model of another vocabulary size (naming both), draft= and draft_model= together, draft_model= that
    is not a model, an unknown draft name, a draft model with images=."""
    from kimi_mlx.config import KimiConfig
    from kimi_mlx.models.kimi_linear import Model

    tok = load(kl_dir / "hf")[1]
    raw = json.loads((kl_dir / "hf" / "config.json").read_text())
    small = Model(KimiConfig.from_hf({**raw, "vocab_size": 256}, source="test"))
    prompt = random_prompts(1, seed=71)[0]

    def refused(match, **kw):
        with pytest.raises(ValueError, match=match):
            list(stream_generate(kl_model, tok, prompt, 4, **kw))

    refused(r"draft model's vocabulary has 256 ids, the target's 512", draft=small)
    refused(r"draft model's vocabulary has 256 ids, the target's 512", draft_model=DraftModel(small))
    refused(r"draft= or draft_model=.*not both", draft="lookup", draft_model=kl_model)
    refused(r"draft_model= takes a loaded Kimi model", draft_model="lookup")
    refused(r"draft='ngram'.*only named drafter is 'lookup'", draft="ngram")
    refused(r"draft= with images= is not supported", draft=kl_model, images=[np.zeros((8, 8, 3), np.uint8)])
    with pytest.raises(ValueError, match="a Kimi model"):
        DraftModel(object())

