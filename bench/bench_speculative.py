"""Speculative decoding costs on one model: the verify pass against a decode step, the rollback's re-feed, and
decode tok/s at forced acceptance rates (drafts built from the target's own greedy continuation).

    python bench/bench_speculative.py                    # the demo model
    python bench/bench_speculative.py --model bench      # bench_vs_mlx_lm.py's model (written once, cached)
    python bench/bench_speculative.py --ks 1,2,4,8,16 --tokens 96

Prints, as medians of ``--reps`` runs after a warm-up (ms):
- ``decode``: one decode step (1 token, evaluated);
- ``verify k``: one verify pass of 1 + k tokens (checkpoint + forward, evaluated): the cost of drafting k tokens;
  the per-step-state rollback option costs at least this (it must also keep 1 + k states), and nothing more on a
  rejection;
- ``refeed n``: what the chosen rollback adds after a pass that accepted n < k drafts (trim back to the checkpoint,
  re-feed n + 1 tokens, evaluated);
- tok/s of plain decoding and of speculation with every draft accepted, half, none (speculation kept on), and none
  with the adaptive length (which switches itself off): the low-acceptance case must stay >= 0.95x plain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kimi_mlx.sampling import SamplingParams
from kimi_mlx.speculative import DraftLength, speculative_steps, verify_pass


def load(which: str):
    if which == "demo":
        from kimi_mlx import load as load_named

        return load_named("demo")[0]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_vs_mlx_lm import checkpoint_dir, load_kimi

    return load_kimi(checkpoint_dir(Path.home() / ".cache" / "kimi_mlx_bench"), mx.float32)


def timed(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        out.append(time.perf_counter() - tic)
    return statistics.median(out) * 1e3


def timed_part(setup, work, teardown, reps: int) -> float:
    """Median ms of ``work`` (evaluated) between an untimed ``setup`` and ``teardown``, after one warm-up."""
    out = []
    for i in range(reps + 1):
        setup()
        tic = time.perf_counter()
        work()
        out.append(time.perf_counter() - tic)
        teardown()
    return statistics.median(out[1:]) * 1e3


def pass_costs(model, prompt: list[int], ks: list[int], reps: int) -> None:
    cache = model.make_cache()
    model(mx.array([prompt]), cache=cache)
    mx.eval([c.state for c in cache])

    def forward(n):
        mx.eval(model(mx.array([[7] * n]), cache=cache), [c.state for c in cache])

    def verify(k):
        mx.eval(verify_pass(model, cache, 7, [7] * k), [c.state for c in cache])

    base = timed_part(cache.checkpoint, lambda: forward(1), lambda: cache.trim(1), reps)
    print(f"decode (1 token): {base:.2f} ms")
    for k in ks:
        t = timed_part(lambda: None, lambda: verify(k), lambda: cache.trim(k + 1), reps)
        n = k // 2
        r = timed_part(lambda: verify(k), lambda: (cache.trim(k + 1), forward(n + 1)),
                       lambda: _undo(cache, n), reps)
        print(f"verify k={k:2d}: {t:7.2f} ms = {t / base:5.2f} x decode   refeed n={n:2d}: {r:6.2f} ms "
              f"= {r / base:4.2f} x decode   (pass with a rejection: {(t + r) / base:5.2f} x decode)")


def _undo(cache, n):
    """Back to the prompt after a re-feed of n + 1 tokens (the checkpoint the verify pass took is still kept)."""
    cache.trim(n + 1)


class Forced:
    """Drafts from the target's greedy continuation ``cont``: the first ``round(rate * k)`` right, the rest wrong."""

    def __init__(self, prompt_len, cont, rate, vocab):
        self.n, self.cont, self.rate, self.vocab = prompt_len, cont, rate, vocab

    def propose(self, history, k):
        true = self.cont[len(history) - self.n :][:k]
        right = round(self.rate * len(true))
        return true[:right] + [(t + 1) % self.vocab for t in true[right:]]

    def observe(self, accepted, proposed):
        pass


def throughput(model, prompt, tokens, k, reps):
    """Decode tok/s (the prefill and first pass excluded) of plain decoding through the same loop and of speculation
    at forced acceptance rates; every run's tokens are checked against the greedy continuation."""
    vocab = model.args.vocab_size

    def steps(drafter, length, n):
        return speculative_steps(model, prompt, model.make_cache(), drafter, params=SamplingParams(), max_tokens=n,
                                 num_draft_tokens=max(k, 1), length=length)

    never = DraftLength(1)
    never.off_for = 10**9  # never drafts: plain decoding
    cont = [t for t, _, _ in steps(Forced(0, [], 0, vocab), never, tokens + k + 1)][: tokens + k + 1]

    def run(rate, mode):
        length = DraftLength(k, start=k, off_below=0.0) if mode == "forced" else None
        if mode == "plain":
            length = DraftLength(1)
            length.off_for = 10**9
        out, tic = [], None
        for t, _, _ in steps(Forced(len(prompt), cont, rate, vocab), length, tokens):
            out.append(t)
            tic = tic or time.perf_counter()
        assert out[:tokens] == cont[:tokens], "speculation changed the greedy tokens"
        return (time.perf_counter() - tic) / max(len(out) - 1, 1)

    def median(rate, mode):
        return statistics.median(run(rate, mode) for _ in range(reps))

    plain = median(0, "plain")
    print(f"k={k}: plain {1 / plain:7.1f} tok/s")
    for label, rate, mode in (("100%", 1.0, "forced"), ("50%", 0.5, "forced"), ("0%", 0.0, "forced"),
                              ("0% adaptive", 0.0, "adaptive")):
        t = median(rate, mode)
        print(f"k={k}: accept {label:12s} {1 / t:7.1f} tok/s = {plain / t:5.2f} x plain")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["demo", "bench"], default="demo")
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--curve-ks", default="4,8")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    model = load(args.model)
    prompt = np.random.default_rng(0).integers(0, model.args.vocab_size, args.prompt).tolist()
    print(f"model {args.model}, prompt {args.prompt} tokens, {mx.default_device()}")
    pass_costs(model, prompt, [int(k) for k in args.ks.split(",")], args.reps)
    for k in [int(k) for k in args.curve_ks.split(",")]:
        throughput(model, prompt, args.tokens, k, max(1, args.reps // 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
