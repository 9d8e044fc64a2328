"""The prefix cache's memory over a long conversation on the serving engine: its bytes (what ``/health`` reports)
against each latent page held once.

A 4-turn conversation re-sent whole every turn to ``kimi_mlx.server.scheduler.Scheduler`` (the engine behind
``kimi-mlx serve``, in this process so the client has the reply's token ids; greedy): the first prompt has
``--first`` tokens (8192), each later turn appends the reply (``--max-tokens``, 16) and ``--grow`` new tokens (8192),
so the last prompt holds ~32K tokens; the tiny Kimi Linear fixture (../shared/fixtures/llamacpp/kimi_linear/hf),
float32, random ids (fixed seed). The engine snapshots every ``--checkpoint-interval`` tokens (4096, serve's
default), the prompt but its last token, and the prompt + reply but its last token. After the last turn
``scheduler.stats["prefix_cache"]["bytes"]`` (``/health`` returns ``scheduler.stats``; a page several snapshots
share counts once) is compared with:

- **pages once**: the formula for that chain of snapshots holding each full latent page once, plus each snapshot's
  own partial last page and KDA state (``kimi_mlx.parallel.accounting.cache_bytes``, tested equal to real caches);
- **copies**: every snapshot holding its whole cache (the prefix cache before the latent cache was paged).

    python bench/bench_prefix_cache.py [--first 8192] [--grow 8192] [--turns 4] [--max-tokens 16] [--concurrent]

``--concurrent`` runs two such conversations at once (their rows share the decode batch, so replies are
snapshotted from a merged batch). Prints each turn's prompt length, cached tokens and time, then the byte counts;
exits 1 when the bytes are not the pages-once formula.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
TINY = Path(os.environ.get("KIMI_MLX_SHARED", HERE.parents[1] / "shared")) / "fixtures/llamacpp/kimi_linear/hf"


def snapshot_points(prompt_len: int, cached: int, reply: int, interval: int) -> list[int]:
    """Where the engine snapshots a request without message boundaries (``Scheduler._start`` / ``_retire``)."""
    stops = set(range(interval, prompt_len, interval)) if interval else set()
    stops.add(prompt_len - 1)
    return sorted(p for p in stops if cached < p < prompt_len) + [prompt_len + reply - 1]


def expected_bytes(cfg, lengths: list[int], page_size: int) -> tuple[int, int]:
    """(pages once, copies) for snapshots of one sequence at ``lengths`` tokens (see the module doc)."""
    from kimi_mlx.parallel.accounting import cache_bytes

    mla = [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i)]
    kda = [i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i)]
    state = cache_bytes(cfg, 0, kda, act_bytes=4)
    once = sum(state + cache_bytes(cfg, n % page_size, mla, act_bytes=4) for n in lengths)
    once += cache_bytes(cfg, max(lengths) // page_size * page_size, mla, act_bytes=4)
    return once, sum(cache_bytes(cfg, n, act_bytes=4) for n in lengths)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=TINY)
    p.add_argument("--first", type=int, default=8192)
    p.add_argument("--grow", type=int, default=8192)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--checkpoint-interval", type=int, default=4096)
    p.add_argument("--concurrent", action="store_true", help="two conversations at once")
    args = p.parse_args(argv)

    from kimi_mlx.cache import PAGE_SIZE
    from kimi_mlx.loading import load_model
    from kimi_mlx.server.scheduler import GenerationRequest, Scheduler

    model, _ = load_model(args.model, dtype=mx.float32)
    cfg = model.args
    rng = np.random.default_rng(0)
    engine = Scheduler(model, checkpoint_interval=args.checkpoint_interval, prefill_chunk=2048).start()
    print(f"{args.model}: latent pages of {PAGE_SIZE} positions, snapshots every {args.checkpoint_interval} tokens")
    prompts = [rng.integers(0, cfg.vocab_size, args.first).tolist() for _ in range(2 if args.concurrent else 1)]
    lengths: list[list[int]] = [[] for _ in prompts]
    try:
        for turn in range(args.turns):
            t0 = time.perf_counter()
            streams = [engine.submit(GenerationRequest(q, args.max_tokens)) for q in prompts]
            for i, stream in enumerate(streams):
                events = list(stream)
                fin, reply = events[-1], [e.token for e in events[:-1]]
                if fin.reason not in ("stop", "length"):
                    raise RuntimeError(f"turn {turn + 1}: {fin.reason} {fin.error or ''}")
                lengths[i] += snapshot_points(len(prompts[i]), fin.cached_tokens, len(reply),
                                              args.checkpoint_interval)
                print(f"turn {turn + 1}, conversation {i + 1}: prompt {len(prompts[i])} tokens, {fin.cached_tokens} "
                      f"from the prefix cache, {len(reply)} generated", flush=True)
                prompts[i] = prompts[i] + reply + rng.integers(0, cfg.vocab_size, args.grow).tolist()
            print(f"turn {turn + 1}: {time.perf_counter() - t0:.1f} s", flush=True)
        stats = engine.stats["prefix_cache"]
    finally:
        engine.stop()
    once = sum(expected_bytes(cfg, ls, PAGE_SIZE)[0] for ls in lengths)
    copies = sum(expected_bytes(cfg, ls, PAGE_SIZE)[1] for ls in lengths)
    mib = 2**20
    print(f"{stats['entries']} snapshots at {lengths}")
    print(f"prefix_cache.bytes {stats['bytes'] / mib:.2f} MiB; pages once {once / mib:.2f} MiB "
          f"({'equal' if stats['bytes'] == once else 'DIFFERENT'}); copies {copies / mib:.2f} MiB "
          f"({copies / stats['bytes']:.1f}x the bytes held)")
    return 0 if stats["bytes"] == once and stats["entries"] == sum(map(len, lengths)) else 1


if __name__ == "__main__":
    sys.exit(main())
