"""Speculative decoding costs on one model: the verify pass against a decode step (k = 1..16), the rollback's
re-feed, decode tok/s at forced acceptance rates (drafts built from the target's own greedy continuation) next to what
the cost model predicts, and the low-acceptance case (random prompts, ``draft="lookup"``, the adaptive length).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/bench_speculative.py --model bench
    python bench/bench_speculative.py                    # the demo model
    python bench/bench_speculative.py --model bench --only low --low-runs 7   # the low-acceptance check only

Prints, as medians of ``--reps`` runs after a warm-up (ms), which BLAS ran, and:
- ``decode``: one decode step (1 token, evaluated);
- ``verify k``: one verify pass of 1 + k tokens (checkpoint + forward, evaluated), for every k in ``--ks``
  (default 1-16): the cost of drafting k tokens, in decode steps;
- ``refeed n``: what the chosen rollback adds after a pass that accepted n < k drafts (trim back to the checkpoint,
  re-feed n + 1 tokens, evaluated), n = k // 2; a re-feed of n + 1 tokens costs about a verify pass of n drafts;
- the cost model: at per-draft acceptance a, a pass of k drafts yields E = (1 - a^(k+1)) / (1 - a) tokens and costs
  verify(k) + sum_{n<k} a^n (1 - a) verify(n) decode steps (verify(0) = a decode step: the re-feed of n + 1 tokens);
  the table gives E / cost (the speed-up over plain decoding) for a = 0 .. 1 and k = 1, 2, 4, 8, 16 on the measured
  curve, and on a weight-bound one (a pass of 1 + k tokens = 1 + 0.05 k decode steps: what a Mac's GPU should show);
  the line fitted to the measured curve gives ``DraftLength(draft_cost=..., refeed_cost=...)`` for this machine;
- tok/s of plain decoding and of speculation with every draft accepted, half, none, at a fixed k (``--curve-ks``),
  each with the cost model's prediction from the measured passes; and none with the adaptive length;
- low acceptance (``--low-runs`` rounds, each a fresh random prompt, interleaved): decode tok/s of plain decoding
  (mlx-lm's ``generate_step``, which ``stream_generate`` runs without ``draft=``) and of ``draft="lookup"`` with the
  adaptive length (``speculative_steps`` with ``PromptLookup``, which ``stream_generate(draft="lookup")`` runs), the
  median and range of the per-round ratios, drafting passes and acceptance. Must be >= 0.95x.
Decode time runs from the first forward pass after the prompt's prefill to the last token (``DecodeClock``): a
speculative run's first verify pass and re-feed are inside it.
Every speculative run's tokens are checked against plain greedy decoding.
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
from kimi_mlx.speculative import DraftLength, PromptLookup, speculative_steps, verify_pass

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_mlx_lm import blas_in_use  # noqa: E402


def load(which: str):
    if which == "demo":
        from kimi_mlx import load as load_named

        return load_named("demo")[0]
    from bench_vs_mlx_lm import checkpoint_dir, load_kimi

    return load_kimi(checkpoint_dir(Path.home() / ".cache" / "kimi_mlx_bench"), mx.float32)


def pass_costs(model, prompt: list[int], ks: list[int], reps: int) -> dict[int, float]:
    """Prints and returns {k: verify pass of 1 + k tokens in decode steps} (k = 0: the decode step itself)."""
    cache = model.make_cache()
    model(mx.array([prompt]), cache=cache)
    mx.eval([c.state for c in cache])

    def forward(n):
        mx.eval(model(mx.array([[7] * n]), cache=cache), [c.state for c in cache])

    def verify(k):
        mx.eval(verify_pass(model, cache, 7, [7] * k), [c.state for c in cache])

    def once(setup, work, teardown):
        setup()
        tic = time.perf_counter()
        work()
        t = time.perf_counter() - tic
        teardown()
        return t * 1e3

    def decode():
        return once(cache.checkpoint, lambda: forward(1), lambda: cache.trim(1))

    def pass_k(k):
        return once(lambda: None, lambda: verify(k), lambda: cache.trim(k + 1))

    def refeed(k):
        return once(lambda: verify(k), lambda: (cache.trim(k + 1), forward(k // 2 + 1)), lambda: _undo(cache, k // 2))

    for k in ks:  # warm-up: every shape once
        pass_k(k), refeed(k)
    base, t, r = [], {k: [] for k in ks}, {k: [] for k in ks}
    for _ in range(reps):  # interleaved rounds: a slow phase of the machine hits every k alike
        for k in ks:
            base.append(decode())
            t[k].append(pass_k(k) / base[-1])
            r[k].append(refeed(k) / base[-1])
    med = statistics.median
    print(f"decode (1 token): {med(base):.2f} ms (rounds {min(base):.2f}-{max(base):.2f}); each ratio below is the "
          f"median over {reps} rounds of the pass / the decode step timed just before it")
    costs = {0: 1.0}
    for k in ks:
        costs[k] = med(t[k])
        print(f"verify k={k:2d}: {med(t[k]):5.2f} x decode (rounds {min(t[k]):5.2f}-{max(t[k]):5.2f})   "
              f"refeed n={k // 2:2d}: {med(r[k]):5.2f} x decode   (pass with a rejection: "
              f"{med(t[k]) + med(r[k]):5.2f} x decode)")
    return costs


def expected_tokens(a: float, k: int) -> float:
    return k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def pass_cost(costs: dict[int, float], a: float, k: int) -> float:
    """Decode steps one pass of k drafts costs at per-draft acceptance a: the verify pass, and after a rejection at
    draft n + 1 (probability a^n (1 - a)) the re-feed of n + 1 tokens (costed as a verify pass of n drafts)."""
    return costs[k] + sum(a**n * (1 - a) * costs[n] for n in range(k))


def cost_model(costs: dict[int, float]) -> None:
    ks = [k for k in (1, 2, 4, 8, 16) if k in costs and all(n in costs for n in range(k))]
    rates = (0.0, 0.25, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0)
    weight_bound = {n: 1 + 0.05 * n for n in range(17)}
    for label, curve in (("measured", costs), ("weight-bound (1 + 0.05 k)", weight_bound)):
        print(f"speed-up E / cost, {label} pass costs:")
        print("   a     " + "".join(f"   k={k:<3d}" for k in ks))
        for a in rates:
            print(f"  {a:4.2f}  " + "".join(f"  {expected_tokens(a, k) / pass_cost(curve, a, k):6.2f}" for k in ks))
    fit = [k for k in costs if k > 0]
    draft_cost = sum(k * (costs[k] - 1) for k in fit) / sum(k * k for k in fit)  # least squares of 1 + d k
    print(f"fit: verify(k) ~ 1 + {draft_cost:.2f} k decode steps -> this machine's "
          f"DraftLength(draft_cost={draft_cost:.2f}, refeed_cost=1.0) (the defaults: 0.25, 1.0)")
    for k in ks:
        pays = next((a for a in np.arange(0, 1.0001, 0.01) if expected_tokens(a, k) / pass_cost(costs, a, k) >= 1),
                    None)
        print(f"  k={k:2d}: speculation pays from a = {pays:.2f}" if pays is not None else
              f"  k={k:2d}: speculation does not pay at any acceptance")


def _undo(cache, n):
    """Back to the prompt after a re-feed of n + 1 tokens (the checkpoint the verify pass took is still kept)."""
    cache.trim(n + 1)


class DecodeClock:
    """The model, noting when its first forward pass after the prompt's prefill starts (a call of fewer than
    ``prefill`` tokens): decode time is measured from there, so a speculative run's first verify pass and re-feed are
    inside it, as plain decoding's first step is."""

    def __init__(self, model, prefill: int):
        self.model, self.prefill, self.start = model, prefill, None

    def __call__(self, x, cache=None):
        if self.start is None and x.shape[1] < self.prefill:
            self.start = time.perf_counter()
        return self.model(x, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def rate(self, it) -> tuple[list[int], float]:
        """Drain ``it`` (token ids); (tokens, seconds per token from the first decode forward to the end)."""
        self.start = None
        out = [int(t) for t in it]
        return out, (time.perf_counter() - self.start) / len(out)


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


class Fixed:
    """A draft length held at k (forced speculation: the cost curve's runs)."""

    def __init__(self, k):
        self.k = k

    def next_length(self):
        return self.k

    def observe(self, accepted, proposed):
        pass


def throughput(model, prompt, tokens, k, reps, costs):
    """Decode tok/s (from the first forward after the prefill: ``DecodeClock``) of plain decoding (mlx-lm's
    ``generate_step``, as ``stream_generate`` without ``draft=``) and of speculation at forced acceptance rates with
    k fixed, interleaved; every run's tokens are checked against the greedy continuation."""
    from mlx_lm.generate import generate_step

    vocab = model.args.vocab_size

    def steps(drafter, length, n):
        return speculative_steps(model, prompt, model.make_cache(), drafter, params=SamplingParams(), max_tokens=n,
                                 num_draft_tokens=max(k, 1), length=length)

    cont = [t for t, _, _ in steps(Forced(0, [], 0, vocab), Fixed(0), tokens + k + 1)][: tokens + k + 1]

    clock = DecodeClock(model, min(len(prompt) - 1, 64))

    def run(rate, mode):
        if mode == "plain":  # what stream_generate runs without draft=
            it = (t for t, _ in generate_step(mx.array(prompt), clock, max_tokens=tokens,
                                              sampler=lambda lp: mx.argmax(lp, axis=-1),
                                              prompt_cache=model.make_cache()))
        else:
            length = Fixed(k) if mode == "forced" else None
            it = (t for t, _, _ in speculative_steps(clock, prompt, model.make_cache(),
                                                     Forced(len(prompt), cont, rate, vocab), params=SamplingParams(),
                                                     max_tokens=tokens, num_draft_tokens=max(k, 1), length=length))
        out, seconds = clock.rate(it)
        assert out[:tokens] == cont[:tokens], "speculation changed the greedy tokens"
        return seconds

    cases = (("100%", 1.0, "forced"), ("50%", 0.5, "forced"), ("0%", 0.0, "forced"), ("0% adaptive", 0.0, "adaptive"))
    times = {"plain": []} | {label: [] for label, _, _ in cases}
    for _ in range(reps):  # interleaved: every case once per round
        times["plain"].append(run(0, "plain"))
        for label, rate, mode in cases:
            times[label].append(run(rate, mode))
    plain = statistics.median(times["plain"])
    print(f"k={k}: plain {1 / plain:7.1f} tok/s")
    for label, rate, mode in cases:
        ratios = [p / t for p, t in zip(times["plain"], times[label])]
        n = round(rate * k)
        predicted = "" if mode != "forced" else \
            f"   model: {(n + 1) / (costs[k] + (costs[n] if n < k else 0)):5.2f} x"
        print(f"k={k}: accept {label:12s} {1 / statistics.median(times[label]):7.1f} tok/s = "
              f"{statistics.median(ratios):5.2f} x plain (rounds {min(ratios):.2f}-{max(ratios):.2f}){predicted}")


def low_acceptance(model, prompt_len: int, tokens: int, k: int, runs: int) -> None:
    """Random prompts, plain decoding vs ``draft="lookup"`` with the adaptive length, interleaved per round."""
    from mlx_lm.generate import generate_step

    vocab = model.args.vocab_size
    ratios, passes, drafted, accepted, plain_tps = [], [], 0, 0, []
    for r in range(runs + 1):  # round 0 warms up
        prompt = np.random.default_rng(1000 + r).integers(0, vocab, prompt_len).tolist()

        clock = DecodeClock(model, min(prompt_len - 1, 64))
        plain, t_plain = clock.rate(t for t, _ in generate_step(
            mx.array(prompt), clock, max_tokens=tokens, sampler=lambda lp: mx.argmax(lp, axis=-1),
            prompt_cache=model.make_cache()))
        counts = []

        class Counted(DraftLength):
            def observe(self, a, p):
                if p:
                    counts.append((a, p))
                super().observe(a, p)

        spec, t_spec = clock.rate(t for t, _, _ in speculative_steps(
            clock, prompt, model.make_cache(), PromptLookup(max_draft=k), params=SamplingParams(), max_tokens=tokens,
            num_draft_tokens=k, length=Counted(k)))
        assert spec == plain, "speculation changed the greedy tokens"
        if r == 0:
            continue
        ratios.append(t_plain / t_spec)
        plain_tps.append(1 / t_plain)
        passes.append(len(counts))
        drafted, accepted = drafted + sum(p for _, p in counts), accepted + sum(a for a, _ in counts)
    print(f"low acceptance: {runs} random prompts of {prompt_len} tokens, {tokens} tokens each, lookup k={k}, "
          f"adaptive length: plain {statistics.median(plain_tps):.1f} tok/s; lookup / plain "
          f"{statistics.median(ratios):.3f} x (rounds {min(ratios):.2f}-{max(ratios):.2f}); drafting passes per run "
          f"{statistics.median(passes)} (max {max(passes)}), accepted {accepted} of {drafted} drafted")


def parse_ks(text: str) -> list[int]:
    """"1-16" or "1,2,4" -> ks."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["demo", "bench"], default="demo")
    ap.add_argument("--ks", default="1-16", help="verify pass lengths to time (e.g. 1-16 or 1,2,4)")
    ap.add_argument("--curve-ks", default="4,8", help="fixed draft lengths of the forced-acceptance runs")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--low-runs", type=int, default=5, help="rounds of the low-acceptance check")
    ap.add_argument("--low-tokens", type=int, default=128)
    ap.add_argument("--only", choices=["costs", "forced", "low"], default=None)
    args = ap.parse_args(argv)
    model = load(args.model)
    prompt = np.random.default_rng(0).integers(0, model.args.vocab_size, args.prompt).tolist()
    print(f"model {args.model}, prompt {args.prompt} tokens, {mx.default_device()}, BLAS: {blas_in_use()}")
    ks = parse_ks(args.ks)
    curve = [int(k) for k in args.curve_ks.split(",")]
    costs = {}
    if args.only in (None, "costs", "forced"):
        costs = pass_costs(model, prompt, sorted(set(ks) | set(range(1, max(curve) + 1))), args.reps)
        cost_model(costs)
    if args.only in (None, "forced"):
        for k in curve:
            throughput(model, prompt, args.tokens, k, max(1, args.reps // 2), costs)
    if args.only in (None, "low"):
        low_acceptance(model, args.prompt, args.low_tokens, 8, args.low_runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
