"""``kimi-mlx bench``: prompt-processing and generation speed and peak memory of a model (flags as ``mlx_lm.benchmark``).

Each trial feeds a fresh cache a random prompt (fixed seed, ids below the vocabulary size) and generates exactly
``--generation-tokens`` greedy tokens (EOS is ignored); one warm-up trial, then medians over ``--num-trials``.

Each row also gives the cache bytes at the prompt length (``parallel.accounting.cache_bytes``: MLA latent + KDA state of
the whole model, float cache in the model's dtype).

With ``--draft lookup|PATH`` each trial also decodes the same prompt with speculative decoding (the same greedy
tokens): the row gives its generation tok/s, its ratio to plain decoding, and the acceptance rate (accepted / drafted
tokens; "-" when nothing was drafted: the adaptive length switched speculation off). Random prompts repeat nothing,
so prompt lookup finds few drafts there: they measure its overhead, not its gain.

With ``--parallel`` (under ``mlx.launch``) every rank runs the same trials; rank 0's timings are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from ..parallel.accounting import cache_bytes
from . import ranks
from .flags import (add_draft_args, add_kv_args, add_model_args, check_draft_args, draft_from_args, draft_stats,
                    kv_from_args, load_from_args)


def add_parser(commands) -> None:
    p = commands.add_parser(
        "bench",
        description="Measure prompt-processing and generation speed (tokens/s) and peak memory of a Kimi Linear / "
        "Kimi-K3 model on random prompts: medians over trials after a warm-up, each trial with a fresh cache.",
    )
    add_model_args(p)
    p.add_argument("--prompt-tokens", "-p", type=int, nargs="+", default=[512], metavar="N",
                   help="prompt lengths to measure (default 512)")
    p.add_argument("--generation-tokens", "-g", type=int, default=128, metavar="N",
                   help="tokens generated per trial (default 128)")
    p.add_argument("--num-trials", "-n", type=int, default=3, metavar="N", help="timed trials per prompt length")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill chunk")
    add_kv_args(p)
    add_draft_args(p)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(run=run)


def trial(model, prompt: mx.array, generation_tokens: int, prefill_step_size: int, kv: dict) -> dict:
    """One timed run: ``prompt`` [T] int ids -> prompt tok/s (prefill + first token), generation tok/s, peak GB,
    and the bytes its cache holds at the end; ``kv``: ``kv_from_args``."""
    from mlx_lm.generate import generate_step

    mx.clear_cache()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prefill = 0.0
    cache = model.make_cache()
    steps = generate_step(prompt, model, max_tokens=generation_tokens, prompt_cache=cache,
                          prefill_step_size=prefill_step_size, **kv)
    for n, _ in enumerate(steps, start=1):
        if n == 1:
            prefill = time.perf_counter() - tic
            tic = time.perf_counter()
    decode = time.perf_counter() - tic
    return {
        "prompt_tps": prompt.size / prefill,
        "generation_tps": (generation_tokens - 1) / decode if generation_tokens > 1 else 0.0,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "measured_cache_bytes": cache.nbytes,
    }


def speculative_trial(model, prompt: mx.array, generation_tokens: int, prefill_step_size: int, kv: dict, draft,
                      num_draft_tokens: int) -> dict:
    """``trial`` with speculative decoding (``draft``: "lookup" or a draft model; a fresh drafter per trial): prompt
    and generation tok/s, and ``drafted_tokens`` / ``accepted_tokens`` / ``acceptance_rate``."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    from ..sampling import SamplingParams
    from ..speculative import make_drafter, speculative_steps

    mx.clear_cache()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prefill, spec = 0.0, None
    cache = model.make_cache()

    def quantize(c):
        maybe_quantize_kv_cache(c, kv.get("quantized_kv_start", 0), kv["kv_group_size"], kv["kv_bits"])

    steps = speculative_steps(model, prompt.tolist(), cache, make_drafter(draft, num_draft_tokens, **kv),
                              params=SamplingParams(), max_tokens=generation_tokens, num_draft_tokens=num_draft_tokens,
                              prefill_step_size=prefill_step_size, after_forward=quantize,
                              rank0=getattr(model, "rank0_ids", None))
    for n, (_, _, spec) in enumerate(steps, start=1):
        if n == 1:
            prefill = time.perf_counter() - tic
            tic = time.perf_counter()
        if n == generation_tokens:
            break
    decode = time.perf_counter() - tic
    return {
        "prompt_tps": prompt.size / prefill,
        "generation_tps": (generation_tokens - 1) / decode if generation_tokens > 1 else 0.0,
        **draft_stats(spec.drafted, spec.accepted),
    }


def _check(args: argparse.Namespace) -> None:
    for flag, values in (("--prompt-tokens", args.prompt_tokens), ("--generation-tokens", [args.generation_tokens]),
                         ("--num-trials", [args.num_trials]), ("--prefill-step-size", [args.prefill_step_size])):
        bad = [v for v in values if v < 1]
        if bad:
            raise ValueError(f"{flag} must be >= 1, got {bad[0]}")
    check_draft_args(args)


def run(args: argparse.Namespace) -> int:
    return ranks.run_command(args, lambda: _check(args), lambda group: _run(args, group))


def _run(args: argparse.Namespace, group) -> int:
    from ..parallel.health import RankError

    try:
        model, tokenizer = load_from_args(args, progress=not args.json, group=group)
        draft = draft_from_args(args, tokenizer, group)
    except RankError:  # rank 0 printed it; every rank ends with it
        return 2
    except (OSError, ValueError) as e:
        return ranks.report_error(e, group)
    mx.random.seed(0)
    rows = []
    for length in args.prompt_tokens:
        prompt = mx.random.randint(0, tokenizer.vocab_size, (length,))
        kv = kv_from_args(args)
        trial(model, prompt, args.generation_tokens, args.prefill_step_size, kv)  # warm-up (compiles, allocations)
        runs = [trial(model, prompt, args.generation_tokens, args.prefill_step_size, kv) for _ in range(args.num_trials)]
        act_bytes = model.layers[0].input_layernorm.weight.dtype.size  # the model's float dtype (norms stay in it)
        rows.append({"prompt_tokens": length, "generation_tokens": args.generation_tokens,
                     "cache_bytes": cache_bytes(model.args, length, act_bytes=act_bytes, kv_bits=args.kv_bits,
                                                kv_group_size=args.kv_group_size),
                     **{k: statistics.median(r[k] for r in runs) for k in runs[0]}})
        if draft is not None:
            rows[-1]["speculative"] = _speculative_row(model, prompt, args, kv, draft)
    info = {"model": str(args.model), "device": str(mx.default_device()), "trials": args.num_trials,
            "kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size, "draft": args.draft,
            "num_draft_tokens": args.num_draft_tokens if args.draft else None, "results": rows}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{args.model} on {info['device']}: medians of {args.num_trials} trials after a warm-up, fresh cache each")
    spec = f" {'spec tok/s':>10} {'speedup':>7} {'accepted':>8}" if args.draft else ""
    print(f"{'prompt':>7} {'generate':>8} {'prompt tok/s':>13} {'gen tok/s':>10} {'peak GB':>8} {'cache MB':>9}{spec}")
    for r in rows:
        line = (f"{r['prompt_tokens']:>7} {r['generation_tokens']:>8} {r['prompt_tps']:>13.1f} "
                f"{r['generation_tps']:>10.1f} {r['peak_memory_gb']:>8.3f} {r['cache_bytes'] / 1e6:>9.3f}")
        if "speculative" in r:
            s = r["speculative"]
            rate = "-" if s["acceptance_rate"] is None else f"{100 * s['acceptance_rate']:.0f}%"
            speedup = s["generation_tps"] / r["generation_tps"] if r["generation_tps"] else 0.0
            line += f" {s['generation_tps']:>10.1f} {speedup:>6.2f}x {rate:>8}"
        print(line)
    if args.draft:
        print(f"speculative: --draft {args.draft}, up to {args.num_draft_tokens} drafts per verify pass; accepted: "
              "accepted / drafted tokens")
    return 0


def _speculative_row(model, prompt: mx.array, args: argparse.Namespace, kv: dict, draft) -> dict:
    """Medians over ``--num-trials`` speculative trials (after a warm-up) of one prompt: generation tok/s and the
    drafted / accepted counts (the same in every trial: greedy)."""
    def run() -> dict:
        return speculative_trial(model, prompt, args.generation_tokens, args.prefill_step_size, kv, draft,
                                 args.num_draft_tokens)

    run()  # warm-up
    runs = [run() for _ in range(args.num_trials)]
    return {"generation_tps": statistics.median(r["generation_tps"] for r in runs),
            **{k: runs[-1][k] for k in ("drafted_tokens", "accepted_tokens", "acceptance_rate")}}
