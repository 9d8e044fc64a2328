"""MLA attention over a long cache: the fused path vs the blockwise forms (ops/mla_paths.py).

For T queries (decode T=1 up to a 2048-token prefill chunk) against S cached keys, prints the median time of
- fused:     one ``mx.fast.scaled_dot_product_attention`` over the whole cache (absorbed up to
             ``FUSED_ABSORBED_MAX_QUERIES`` = 32 queries, expanded per head beyond): memory O(H x T x S)
- absorbed:  blockwise in latent space (q W_kb against c_kv, output in latent space, then W_vb)
- expanded:  blockwise, each key block expanded per head
and each blockwise median as a ratio of the fused one (<1 = faster). float32, the default device.

    python bench/bench_mla_attention.py [--seq 8192] [--key-block 512] [--reps 5]
    python bench/bench_mla_attention.py --memory   # tiny Kimi Linear, float32, 2048-token chunks: 8K vs 64K
    python bench/bench_mla_attention.py --long     # decode after a 16K-token prefill (64-key blocks) vs full forward
    python bench/bench_mla_attention.py --pages --queries 1 128 2048 [--seqs ...] [--page-sizes ...]

--pages times attention over keys stored as pages (the paged latent cache: one key segment per page, never
concatenated; the layers' default key blocks) against the same keys in one array (the cache before paging), e.g.
for decode (T=1), a short absorbed chunk (T=128) and an expanded prefill chunk (T=2048): the page-size choice.
--memory and --long use the helpers of tests/test_mla_blockwise.py (which checks scaled-down versions of both).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.mla import MultiLinear

from kimi_mlx.ops.mla_attention import mla_attention

CONFIGS = {  # name: (heads, kv_lora_rank, qk_nope, qk_rope, v_head_dim)
    "tiny fixture": (2, 128, 64, 32, 64),
    "Kimi-Linear-48B dims, 4 of 32 heads": (4, 512, 128, 64, 128),
}


def median_s(fn, reps: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def long_context(memory: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_mla_blockwise as t
    from conftest import KL_FIXTURE

    from kimi_mlx.loading import load_model

    model, _ = load_model(KL_FIXTURE / "hf", dtype=mx.float32)
    if memory:
        t.set_key_block(model, None)
        for kv in ({}, {"kv_bits": 8, "kv_group_size": 64}):
            mib = [t.chunk_transient_memory(model, n, 2048, **kv) / 2**20 for n in (8192, 65536)]
            print(f"{'8-bit' if kv else 'float'} latent cache (fresh make_cache, default key blocks): 2048-token chunk "
                  f"after 8K {mib[0]:.1f} MiB, after 64K {mib[1]:.1f} MiB (ratio {mib[1] / mib[0]:.2f})")
    else:
        t0 = time.perf_counter()
        err = t.decode_vs_full(model, 16381, 2048, 64)
        print(f"16K prefill (2048-token chunks, 64-key blocks) + 3 decode steps vs full forward: "
              f"max |diff| / max |logit| {err:.2e}, {time.perf_counter() - t0:.1f} s")


def pages(seqs: list[int], page_sizes: list[int], queries: list[int], reps: int) -> None:
    """Paged keys (one segment per page) vs the same keys in one array, default key blocks (see the module doc)."""
    mx.random.seed(0)
    print(f"device {mx.default_device()}, float32, median of {reps}; time with pages / time with one array")
    for name, (H, r, dn, dr, dv) in CONFIGS.items():
        embed_q, unembed_out = MultiLinear(dn, r, H), MultiLinear(r, dv, H)
        print(f"\n{name}: H={H} r={r}")
        print(f"{'S':>7} {'T':>5} {'one array ms':>13} " + " ".join(f"{'P=' + str(p):>8}" for p in page_sizes))
        for S in seqs:
            c, kr = mx.random.normal((1, 1, S, r)), mx.random.normal((1, 1, S, dr))
            paged = {p: ([mx.contiguous(c[:, :, i : i + p]) for i in range(0, S, p)],
                         [mx.contiguous(kr[:, :, i : i + p]) for i in range(0, S, p)]) for p in page_sizes}
            mx.eval(c, kr, paged)
            for T in queries:
                qn, qp = mx.random.normal((1, H, T, dn)), mx.random.normal((1, H, T, dr))
                mask = None if T == 1 else "causal"
                mx.eval(qn, qp)

                def run(keys, pes):
                    return lambda: mla_attention(qn, qp, keys, pes, embed_q, unembed_out, dn ** -0.5, mask)

                whole = median_s(run(c, kr), reps)
                ratios = [median_s(run(*paged[p]), reps) / whole for p in page_sizes]
                print(f"{S:>7} {T:>5} {whole * 1e3:>13.2f} " + " ".join(f"{x:>8.2f}" for x in ratios), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--key-block", type=int, default=512)
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--memory", action="store_true", help="prefill chunk memory at 8K vs 64K tokens")
    ap.add_argument("--long", action="store_true", help="decode after a 16K-token prefill vs a full forward")
    ap.add_argument("--pages", action="store_true", help="paged keys vs one array, per page size")
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    args = ap.parse_args()
    if args.memory or args.long:
        return long_context(args.memory)
    if args.pages:
        return pages(args.seqs, args.page_sizes, args.queries, args.reps)
    S, kb = args.seq, args.key_block
    mx.random.seed(0)
    print(f"device {mx.default_device()}, S={S} cached keys, key_block={kb}, float32, median of {args.reps}")
    for name, (H, r, dn, dr, dv) in CONFIGS.items():
        embed_q, unembed_out = MultiLinear(dn, r, H), MultiLinear(r, dv, H)
        c, kr = mx.random.normal((1, 1, S, r)), mx.random.normal((1, 1, S, dr))
        print(f"\n{name}: H={H} r={r} qk_nope={dn} qk_rope={dr} v={dv}")
        print(f"{'T':>6} {'fused ms':>10} {'absorbed ms':>12} {'expanded ms':>12} {'abs/fused':>10} {'exp/fused':>10}")
        for T in args.queries:
            qn, qp = mx.random.normal((1, H, T, dn)), mx.random.normal((1, H, T, dr))
            mask = None if T == 1 else "causal"
            mx.eval(c, kr, qn, qp)

            def run(**kw):
                return lambda: mla_attention(qn, qp, c, kr, embed_q, unembed_out, dn ** -0.5, mask, **kw)

            fused = median_s(run(key_block=S), args.reps)
            absorbed = median_s(run(key_block=kb, absorbed=True), args.reps)
            expanded = median_s(run(key_block=kb, absorbed=False), args.reps)
            print(f"{T:>6} {fused * 1e3:>10.2f} {absorbed * 1e3:>12.2f} {expanded * 1e3:>12.2f} "
                  f"{absorbed / fused:>10.2f} {expanded / fused:>10.2f}")


if __name__ == "__main__":
    main()
