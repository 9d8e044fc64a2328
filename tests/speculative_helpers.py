"""Helpers shared by the speculative-decoding tests (test_speculative.py, test_speculative_draft_model.py): plain
greedy decoding as the reference (mlx-lm's ``generate_step``), prompts that repeat themselves, a drafter scripted from
the target's own continuation, cache comparison, and the chi-square test used for sampled acceptance."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

VOCAB = 512  # both reference fixtures
ALPHA = 1e-4  # each chi-square test fails a correct implementation with probability 1e-4 (over seeds)


def plain_greedy(model, prompt, n, kv_bits=None):
    """Greedy tokens of plain decoding (mlx-lm's loop, one token per pass)."""
    cache = model.make_cache(kv_bits=kv_bits)
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda lp: mx.argmax(lp, axis=-1),
                          prompt_cache=cache)
    return [int(t) for t, _ in steps]


def random_prompts(count, seed):
    """Prompts of random ids; most repeat a span of themselves (so that prompt lookup finds drafts)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        head = rng.integers(0, VOCAB, int(rng.integers(5, 30))).tolist()
        span = rng.integers(0, VOCAB, int(rng.integers(4, 20))).tolist()
        out.append(head + span + head[: i % 5] + span if i % 4 else head + span)
    return out


class ScriptedDrafter:
    """Drafts from the target's own greedy continuation (known in advance): ``right`` proposes it (every draft is
    accepted), otherwise each draft is a wrong token (every draft is rejected)."""

    def __init__(self, prompt_len, continuation, right):
        self.prompt_len, self.cont, self.right = prompt_len, continuation, right
        self.outcomes = []

    def propose(self, history, k):
        at = len(history) - self.prompt_len  # generated so far
        true = self.cont[at : at + k]
        return list(true) if self.right else [(t + 1) % VOCAB for t in true]

    def observe(self, accepted, proposed):
        self.outcomes.append((accepted, proposed))


def max_diff(cache, ref, relative=True):
    """Largest |difference| over every float array of two caches (scaled by max(1, max |ref|) when ``relative``);
    quantized codes must be equal."""
    worst = 0.0
    for a, b in zip(cache, ref):
        assert a.offset == b.offset
        for x, y in zip(a.state, b.state):
            assert x.shape == y.shape and x.dtype == y.dtype
            if x.dtype == mx.uint32:
                assert mx.array_equal(x, y).item(), "quantized latent codes differ"
                continue
            x, y = x.astype(mx.float32), y.astype(mx.float32)
            scale = max(1.0, float(mx.abs(y).max().item())) if relative else 1.0
            worst = max(worst, float(mx.abs(x - y).max().item()) / scale)
    return worst


def chi2_threshold(df, alpha=ALPHA):
    """Upper alpha-quantile of chi-square(df) (Wilson-Hilferty; z = 3.719 for alpha = 1e-4)."""
    z = {1e-4: 3.719}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts, probs):
    """(Pearson's statistic, degrees of freedom) of observed ``counts`` against ``probs`` (same length)."""
    keep = probs * counts.sum() >= 5  # bins expected >= 5 times; the rest pooled
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    obs = np.append(counts[keep], counts[~keep].sum())
    nz = exp > 0
    return float(((obs[nz] - exp[nz]) ** 2 / exp[nz]).sum()), int(nz.sum() - 1)


def softmax(x, temp):
    e = np.exp((x - x.max(-1, keepdims=True)) / temp)
    return e / e.sum(-1, keepdims=True)
