"""Routed experts of a short multi-token pass (a speculative verify pass of 2..17 tokens, a small batch): the sorted
dense-per-expert path (``sorted_switch_glu``: each used expert's weights read once) vs mlx-lm's ``SwitchGLU``
(``gather_mm`` / ``gather_qmm``, one row at a time), around ``SORTED_MIN_PAIRS`` (``kimi_mlx/layers/moe.py``).

On the benchmark model of ``bench_vs_mlx_lm.py`` (hidden 768, 16 experts x 256, top-4; 11 MoE layers; float32, or
its experts quantized with ``--bits``, MLX affine, group 64): for each token count, random hidden states go through
every MoE layer's experts with that layer's own routing (so each layer's weights come in cold, as in a forward),
evaluated per layer; both paths alternate within each round. Prints ms per pass (all MoE layers' routed experts),
medians over ``--runs`` rounds, and the median per-round ratio gather / sorted (> 1: the sorted path is faster).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/bench_switch_threshold.py
    LD_PRELOAD=... python bench/bench_switch_threshold.py --bits 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_vs_mlx_lm import CONFIG, blas_in_use, checkpoint_dir, load_kimi  # noqa: E402

from kimi_mlx.layers.moe import SORTED_MIN_PAIRS, SparseMoE, sorted_switch_glu  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    ap.add_argument("--bits", type=int, default=0, choices=[0, 4, 8], help="quantize the routed experts (0: float32)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("KIMI_BENCH_CACHE", Path.home() / ".cache" / "kimi_mlx_bench")))
    args = ap.parse_args()

    model = load_kimi(checkpoint_dir(args.cache_dir), mx.float32)
    if args.bits:
        nn.quantize(model, group_size=64, bits=args.bits,
                    class_predicate=lambda p, m: ".switch_mlp." in p and hasattr(m, "to_quantized"))
        mx.eval(model.parameters())
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    k = CONFIG["num_experts_per_token"]
    print(f"BLAS: {blas_in_use()}")
    print(f"bench model: {len(moes)} MoE layers, {CONFIG['num_experts']} experts x {CONFIG['moe_intermediate_size']}, "
          f"top-{k}, hidden {CONFIG['hidden_size']}; experts {f'{args.bits}-bit' if args.bits else 'float32'}; "
          f"SORTED_MIN_PAIRS = {SORTED_MIN_PAIRS}; medians of {args.runs} rounds")
    print()
    print("| tokens | pairs | gather ms/pass | sorted ms/pass | gather / sorted (min-max) |")
    print("|---:|---:|---:|---:|---:|")
    paths = {"gather": lambda s, x, i: s(x, i), "sorted": sorted_switch_glu}
    for T in args.tokens:
        inputs = []
        for j, moe in enumerate(moes):
            x = mx.random.normal((1, T, CONFIG["hidden_size"]), key=mx.random.key(100 * T + j))  # [1, T, hidden]
            inds, _ = moe.routing(x)  # [1, T, k]
            inputs.append((moe.switch_mlp, x, inds))
        mx.eval(inputs[-1][1:], [i[1:] for i in inputs])
        times = {name: [] for name in paths}
        for r in range(args.runs + 1):  # round 0 warms up
            for name in (list(paths) if r % 2 else list(paths)[::-1]):
                tic = time.perf_counter()
                for switch, x, inds in inputs:
                    mx.eval(paths[name](switch, x, inds))
                if r:
                    times[name].append(time.perf_counter() - tic)
        ratios = [g / s for g, s in zip(times["gather"], times["sorted"])]
        g, s = (statistics.median(times[n]) * 1e3 for n in paths)
        print(f"| {T} | {T * k} | {g:.2f} | {s:.2f} | {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
