"""MLA attention over a long cache: today's fused path vs the blockwise forms (ops/mla_attention.py).

For T queries (decode T=1 up to a 2048-token prefill chunk) against S cached keys, prints the median time of
- fused:     one ``mx.fast.scaled_dot_product_attention`` over the whole cache (absorbed for T=1, expanded per head
             otherwise): the path before blockwise attention, memory O(H x T x S)
- absorbed:  blockwise in latent space (q W_kb against c_kv, output in latent space, then W_vb)
- expanded:  blockwise, each key block expanded per head
and each blockwise median as a ratio of the fused one (<1 = faster). float32, the default device.

    python bench/bench_mla_attention.py [--seq 8192] [--key-block 2048] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--key-block", type=int, default=512)
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 2048])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
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
