"""MLA attention over a long cache: the fused path vs the blockwise forms (ops/mla_paths.py), and every path against
one plain full-attention call.

For T queries (decode T=1 up to a 2048-token prefill chunk) against S cached keys, prints the median time of
- fused:     one ``mx.fast.scaled_dot_product_attention`` over the whole cache (absorbed up to
             ``FUSED_ABSORBED_MAX_QUERIES`` = 32 queries, expanded per head beyond): memory O(H x T x S)
- absorbed:  blockwise in latent space (q W_kb against c_kv, output in latent space, then W_vb)
- expanded:  blockwise, each key block expanded per head, in tiles of ``QUERY_BLOCK`` queries
and each blockwise median as a ratio of the fused one (<1 = faster). float32, the default device.

    python bench/bench_mla_attention.py [--seq 8192] [--key-block 512] [--reps 5]
    python bench/bench_mla_attention.py --memory   # tiny Kimi Linear, float32, 2048-token chunks: 8K vs 64K
    python bench/bench_mla_attention.py --long     # decode after a 16K-token prefill (64-key blocks) vs full forward
    python bench/bench_mla_attention.py --pages --queries 1 128 2048 [--seqs ...] [--page-sizes ...]

    python bench/bench_mla_attention.py --vs-plain [--dims bench kimi-linear-48b k3] [--cases 2048:2048 512:4096]

--vs-plain times, for each (T queries, S keys) case (a causal chunk whose queries are the last T of the S positions;
T = S: a prefill on an empty cache, T < S: a chunk on a filled cache; T = 1: decode), interleaved in each round:
- plain:    one ``mx.fast.scaled_dot_product_attention`` call with a causal mask over the whole cache expanded per
            head (keys [c W_kb^T, k_pe], values c W_vb^T: ``fused(..., absorbed=False)``); memory O(H x T x S)
- vlm-form: mlx-vlm 0.7.10's K3 form of the same call: the rope part's scores computed first and passed, causal mask
            folded in, as an additive mask to an SDPA over the nope part only (dn = dv: MLX's fused kernel on Metal)
- ours:     ``mla_attention`` as the layers call it (its choice printed: absorbed / expanded)
- absorbed, expanded: each form forced (default key blocks; absorbed up to 4 x ``ABSORBED_MAX_QUERIES`` queries)
and prints each one's median ms, its ratio to plain (median of the per-round ratios, wall and process CPU time) and
its peak memory above the inputs. Cases whose plain scores would exceed ``--max-plain-gib`` run without plain and
vlm-form. On a loaded machine ``OPENBLAS_NUM_THREADS=1`` steadies the CPU-time ratios (every path's GEMMs then run on
one thread, as MLX's elementwise ops do).

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

from kimi_mlx.ops.mla_attention import ABSORBED_MAX_QUERIES, FUSED_ABSORBED_MAX_QUERIES, absorbs, mla_attention
from kimi_mlx.ops.mla_paths import fused as fused_call

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


VS_PLAIN_DIMS = {  # name: (heads, kv_lora_rank, qk_nope, qk_rope, v_head_dim)
    "bench": (6, 256, 64, 32, 64),  # bench_vs_mlx_lm.py's / bench_k3_vs_mlx_lm.py's model
    "kimi-linear-48b": (32, 512, 128, 64, 128),
    "k3": (96, 512, 128, 64, 128),
}


def vlm_form(q_nope, q_pe, c, kr, embed_q, unembed_out, scale: float) -> mx.array:
    """mlx-vlm 0.7.10's K3 MLA prefill attention (``KimiK3MLAAttention``, expanded branch) for a causal chunk whose
    queries are the last T of the S positions: rope scores (causal mask folded in) as an additive mask of one SDPA
    over the per-head expanded nope keys and values -> [B, H, T, dv]."""
    T, S = q_nope.shape[2], c.shape[2]
    pe_scores = (q_pe * scale) @ kr.swapaxes(-1, -2)  # [B, H, T, S]
    visible = mx.arange(S)[None, :] <= (S - T + mx.arange(T))[:, None]
    pe_scores = mx.where(visible, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
    k, v = embed_q(c, transpose=False), unembed_out(c)  # [B, H, S, dn], [B, H, S, dv]
    return mx.fast.scaled_dot_product_attention(q_nope, k, v, scale=scale, mask=pe_scores)


def peak_mib(fn) -> float:
    """Peak memory of one evaluated call above what was allocated before it (MiB)."""
    mx.eval(fn())
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    return (mx.get_peak_memory() - base) / 2**20


def vs_plain(dims: list[str], cases: list[tuple[int, int]], rounds: int, max_plain_gib: float) -> None:
    """Every path against the plain full-attention call (see the module doc)."""
    print(f"device {mx.default_device()}, float32, causal, {rounds} rounds (paths interleaved in each); ratio = "
          f"median of per-round (path / plain), wall and CPU; peak = memory above the inputs")
    for name in dims:
        H, r, dn, dr, dv = VS_PLAIN_DIMS[name]
        embed_q, unembed_out = MultiLinear(dn, r, H), MultiLinear(r, dv, H)
        scale = (dn + dr) ** -0.5
        print(f"\n{name}: H={H} r={r} qk_nope={dn} qk_rope={dr} v={dv}")
        others = ("ours", "vlm-form", "absorbed", "expanded")
        print("| T | S | ours runs | plain ms | plain MiB | " + " | ".join(f"{p} wall | {p} CPU | {p} MiB" for p in others)
              + " |")
        print("|---" * (5 + 3 * len(others)) + "|")
        for T, S in cases:
            mx.random.seed(T * 100003 + S)
            c, kr = mx.random.normal((1, 1, S, r)), mx.random.normal((1, 1, S, dr))
            qn, qp = mx.random.normal((1, H, T, dn)), mx.random.normal((1, H, T, dr))
            mx.eval(c, kr, qn, qp, embed_q.parameters(), unembed_out.parameters())
            mask = "causal" if T > 1 else None
            args = (qn, qp, c, kr, embed_q, unembed_out, scale, mask)
            paths = {
                "plain": lambda: fused_call(*args, absorbed=False),
                "vlm-form": lambda: vlm_form(*args[:7]),
                "ours": lambda: mla_attention(*args),
                "absorbed": lambda: mla_attention(*args, absorbed=True),
                "expanded": lambda: mla_attention(*args, absorbed=False),
            }
            if 3 * 4 * H * T * S > max_plain_gib * 2**30:
                del paths["plain"], paths["vlm-form"]
            if T > 4 * ABSORBED_MAX_QUERIES:  # far past the crossover: absorbed blocks hold H x T x block scores
                del paths["absorbed"]
            ref = next(iter(paths.values()))()
            errs = {p: mx.abs(fn() - ref).max().item() for p, fn in paths.items()}
            peaks = {p: peak_mib(fn) for p, fn in paths.items()}
            wall, cpu = {p: [] for p in paths}, {p: [] for p in paths}
            for _ in range(rounds):
                for p, fn in paths.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    mx.eval(fn())
                    wall[p].append(time.perf_counter() - t0)
                    cpu[p].append(time.process_time() - c0)
            base = "plain" if "plain" in paths else "expanded"

            def ratio(p, xs):
                return statistics.median(a / b for a, b in zip(xs[p], xs[base]))

            choice = "absorbed" if absorbs(T, S, r, dn, dv) else "expanded"
            cells = [str(T), str(S), choice]
            cells += ([f"{statistics.median(wall['plain']) * 1e3:.1f}", f"{peaks['plain']:.0f}"] if "plain" in paths
                      else ["skipped", "-"])
            for p in others:
                if p not in paths:
                    cells += ["-"] * 3
                    continue
                bad = f" (err {errs[p]:.0e})" if errs[p] > 1e-4 else ""
                cells += [f"{ratio(p, wall):.2f}", f"{ratio(p, cpu):.2f}{bad}", f"{peaks[p]:.0f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
        if any(3 * 4 * H * T * S > max_plain_gib * 2**30 for T, S in cases):
            print("(skipped: plain's scores over --max-plain-gib; those rows' ratios are to the expanded form)")


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
    ap.add_argument("--vs-plain", action="store_true", help="every path vs one plain full-attention call")
    ap.add_argument("--dims", nargs="+", choices=sorted(VS_PLAIN_DIMS), default=["bench", "kimi-linear-48b"])
    ap.add_argument("--cases", nargs="+", default=["1:4096", "64:1024", "128:4096", "128:128", "512:512",
                                                   "2048:2048", "4096:4096", "512:4096", "2048:8192"],
                    help="T:S pairs for --vs-plain")
    ap.add_argument("--rounds", type=int, default=5, help="--vs-plain rounds")
    ap.add_argument("--max-plain-gib", type=float, default=4.0, help="--vs-plain: skip plain above this many GiB")
    args = ap.parse_args()
    if args.vs_plain:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.cases]
        return vs_plain(args.dims, cases, args.rounds, args.max_plain_gib)
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

            one_call = (qn, qp, c, kr, embed_q, unembed_out, dn ** -0.5, mask, T <= FUSED_ABSORBED_MAX_QUERIES)
            fused = median_s(lambda: fused_call(*one_call), args.reps)
            absorbed = median_s(run(key_block=kb, absorbed=True), args.reps)
            expanded = median_s(run(key_block=kb, absorbed=False), args.reps)
            print(f"{T:>6} {fused * 1e3:>10.2f} {absorbed * 1e3:>12.2f} {expanded * 1e3:>12.2f} "
                  f"{absorbed / fused:>10.2f} {expanded / fused:>10.2f}")


if __name__ == "__main__":
    main()
