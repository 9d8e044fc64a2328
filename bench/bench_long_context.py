"""Long context: prefill tok/s, transient and total memory, and decode tok/s at growing prompt lengths, kimi-mlx
(float latent cache, and 8-bit / 4-bit when ``make_cache(kv_bits=...)`` exists) against mlx-lm on the same weights.

Models: ``tiny`` (the transformers-made Kimi Linear fixture, ../shared/fixtures/llamacpp/kimi_linear/hf) and
``bench`` (the Kimi Linear bench checkpoint of ``bench_vs_mlx_lm.py``: hidden 768, 12 layers, 16 experts). Float32
weights (the CPU backend's fastest), random prompt ids (fixed seed).

Every measurement runs in a fresh process (so peaks do not mix and a failure, e.g. running out of memory, is
recorded as the length where that implementation fails): the prompt is prefilled in chunks of ``--chunk`` (2048,
mlx-lm's ``prefill_step_size``) into a fresh cache, timed; then ``--decode-steps`` greedy steps, timed.

- total: peak memory of the prefill (``mx.get_peak_memory``; weights included);
- transient: total minus the weights and minus the cache after the prefill (what the prefill needs beyond what it
  keeps): the quantity that must not grow with the context;
- cache: bytes held by the cache after the prefill.

``--fill`` (kimi-mlx only) prefills just the last chunk, after standing in for the rest with zero latents
(``fill_latent``: attention's cost and memory depend only on the context's length): decode tok/s and the last
chunk's prefill at long contexts in seconds; it also runs on checkouts from before the paged latent cache (for
before/after comparisons: ``PYTHONPATH`` at that checkout's package).

Both start from a fresh cache with nothing set aside, as any caller's: kimi-mlx's latent cache grows by pages
(``kimi_mlx.cache``, nothing copied); mlx-lm's caches grow by copying (its own behaviour).

    python bench/bench_long_context.py --models tiny --sizes 8192 32768 131072 262144
    python bench/bench_long_context.py --models tiny --impls kimi-mlx --page-size 16384   # another latent page size
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/bench_long_context.py --models bench --sizes 8192 32768

Prints the BLAS in use, one line per measurement, and a table per model with the kimi-mlx / mlx-lm ratios (float
caches on both sides).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TINY = Path(os.environ.get("KIMI_MLX_SHARED", HERE.parents[1] / "shared")) / "fixtures/llamacpp/kimi_linear/hf"
IMPLS = ("kimi-mlx", "kimi-mlx kv8", "kimi-mlx kv4", "mlx-lm")
WARMUP_STEPS = 4  # untimed decode steps first (one-time costs of the first steps)


def model_dir(name: str, cache_dir: Path) -> Path:
    if name == "tiny":
        return TINY
    from bench_vs_mlx_lm import checkpoint_dir

    return checkpoint_dir(cache_dir)


def load(impl: str, path: Path):
    """(model, vocab size, make_cache) for an implementation; make_cache None: this one has no such cache."""
    if impl.startswith("kimi-mlx"):
        from kimi_mlx.loading import load_model

        model, _ = load_model(path, dtype=mx.float32)
        vocab = model.args.vocab_size
        if impl == "kimi-mlx":
            return model, vocab, model.make_cache
        bits = int(impl[-1])
        if "kv_bits" not in inspect.signature(model.make_cache).parameters:
            return model, vocab, None
        return model, vocab, lambda: model.make_cache(kv_bits=bits, kv_group_size=64)
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, config = load_model(path)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, config["vocab_size"], lambda: make_prompt_cache(model)


def cache_nbytes(cache) -> int:
    """Bytes the per-layer caches hold (both implementations' caches report ``nbytes``)."""
    return sum(c.nbytes for c in cache)


def fill_latent(model, cache, n: int, room: int) -> None:
    """Stand in for a prefill of n tokens: kimi-mlx's MLA latent caches get n zero latents (attention's cost and
    memory depend only on the length; random ones would make most softmax weights denormal, which the CPU computes
    many times slower), its KDA layers' offsets advance by n. On a checkout from before the paged cache, its caches
    first set aside ``room`` positions, as its generators did."""
    import kimi_mlx.cache as kc

    if hasattr(kc, "reserve_cache"):
        kc.reserve_cache(cache, room)
    for layer, c in zip(model.layers, cache):
        if layer.is_linear:
            c.advance(n)
        else:
            c.update_and_fetch(*(mx.zeros((1, 1, n, d)) for d in (model.args.kv_lora_rank, model.args.qk_rope_head_dim)))
    mx.eval([c.state for c in cache])


def measure(impl: str, path: Path, size: int, chunk: int, decode_steps: int, page_size: int = 0,
            fill: bool = False) -> dict:
    """One measurement in this process (see the module doc); ``page_size`` > 0: kimi-mlx's latent page size;
    ``fill``: only the last chunk is prefilled, after ``fill_latent`` (kimi-mlx only; prefill tok/s is then that
    chunk's)."""
    from mlx.utils import tree_flatten

    if page_size and impl.startswith("kimi-mlx"):
        from kimi_mlx.cache import MLALatentCache

        MLALatentCache.page_size = page_size
    model, vocab, make_cache = load(impl, path)
    if make_cache is None:
        return {"error": "no quantized cache (make_cache has no kv_bits)"}
    if fill and not impl.startswith("kimi-mlx"):
        return {"error": "--fill is for kimi-mlx's caches"}
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    tokens = mx.array(np.random.default_rng(0).integers(0, vocab, (1, size)))
    cache = make_cache()
    start = size - chunk if fill else 0
    if start:
        fill_latent(model, cache, start, size + decode_steps + 1)
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for s in range(start, size, chunk):
        logits = model(tokens[:, s : s + chunk], cache=cache)
        mx.eval(logits[:, -1], [c.state for c in cache])
    prefill_s = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    held = cache_nbytes(cache)
    tok = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(tok)
    for step in range(-WARMUP_STEPS, decode_steps):
        if step == 0:
            t0 = time.perf_counter()
        tok = mx.argmax(model(tok[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(tok)
    decode_s = time.perf_counter() - t0
    return {"prefill_tps": (size - start) / prefill_s, "decode_tps": decode_steps / decode_s, "total": peak,
            "cache": held, "transient": peak - weights - held, "weights": weights}


def run_one(impl: str, path: Path, size: int, args) -> dict:
    """``measure`` in a fresh process; a failure (exit, timeout) is recorded with its last words."""
    cmd = [sys.executable, __file__, "--one", impl, str(path), str(size), "--chunk", str(args.chunk),
           "--decode-steps", str(args.decode_steps), "--page-size", str(args.page_size)] + ["--fill"] * args.fill
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {args.timeout} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {proc.returncode}: {last[:120]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "bench"], choices=["tiny", "bench"])
    p.add_argument("--sizes", nargs="+", type=int, default=[8192, 32768, 131072, 262144])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--page-size", type=int, default=0, help="kimi-mlx's latent page size (0: the library's)")
    p.add_argument("--fill", action="store_true",
                   help="prefill only the last chunk after random latents (kimi-mlx: decode at long contexts, fast)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per measurement")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("KIMI_BENCH_CACHE",
                                                                       Path.home() / ".cache/kimi_mlx_bench")))
    p.add_argument("--one", nargs=3, metavar=("IMPL", "PATH", "SIZE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        impl, path, size = args.one
        print(json.dumps(measure(impl, Path(path), int(size), args.chunk, args.decode_steps, args.page_size,
                                 args.fill)))
        return 0
    from bench_vs_mlx_lm import blas_in_use

    from kimi_mlx.cache import PAGE_SIZE

    print(f"BLAS: {blas_in_use()}; mlx {mx.__version__}; chunk {args.chunk}, {args.decode_steps} decode steps; "
          f"kimi-mlx latent pages of {args.page_size or PAGE_SIZE} positions")
    for name in args.models:
        path = model_dir(name, args.cache_dir)
        rows = {}
        for size in args.sizes:
            for impl in args.impls:
                r = rows[size, impl] = run_one(impl, path, size, args)
                if "error" in r:
                    print(f"{name} {size:>7} {impl:<13} FAILED: {r['error']}", flush=True)
                else:
                    print(f"{name} {size:>7} {impl:<13} prefill {r['prefill_tps']:8.1f} tok/s | transient "
                          f"{mib(r['transient']):>6} MiB | cache {mib(r['cache']):>6} MiB | total {mib(r['total']):>6} "
                          f"MiB | decode {r['decode_tps']:6.2f} tok/s", flush=True)
        print(f"\n{name}: {path}")
        print("| tokens | impl | prefill tok/s | transient MiB | cache MiB | total MiB | decode tok/s |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for (size, impl), r in rows.items():
            if "error" in r:
                print(f"| {size} | {impl} | fails: {r['error']} | | | | |")
            else:
                print(f"| {size} | {impl} | {r['prefill_tps']:.1f} | {mib(r['transient'])} | {mib(r['cache'])} | "
                      f"{mib(r['total'])} | {r['decode_tps']:.2f} |")
        for size in args.sizes:
            a, b = rows.get((size, "kimi-mlx")), rows.get((size, "mlx-lm"))
            if a and b and "error" not in a and "error" not in b:
                print(f"{size}: kimi-mlx / mlx-lm prefill {a['prefill_tps'] / b['prefill_tps']:.2f}x, decode "
                      f"{a['decode_tps'] / b['decode_tps']:.2f}x, transient memory "
                      f"{a['transient'] / max(b['transient'], 1):.2f}x")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
