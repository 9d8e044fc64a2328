"""Benchmark the KDA scan paths: kda_recurrent vs kda_chunked (several chunk sizes) vs mlx-lm's token loop.

    python bench/bench_kda.py                       # T = 512, 2048; B=1, H=32, Dk=Dv=128
    python bench/bench_kda.py --T 1,4,16,32,64 --chunks 16,32 --no-mlx-lm
    python bench/bench_kda.py --grad --T 512
    python bench/bench_kda.py --layer real --grad --T 512 --reps 9   # one KDA layer vs the uncompiled output norm

After one warm-up of each, the paths run interleaved in every round (order reversed on alternate rounds), so a
machine whose load changes compares them under the same load. Reports per path the median wall and process CPU time
(``time.process_time``: all threads, steadier than wall time on shared cores) with the min-max spread, and the median
of the per-round CPU-time ratios against the first path listed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from kimi_mlx.ops.kda_chunked import kda_chunked
from kimi_mlx.ops.kda_recurrent import kda_recurrent


def make_inputs(B, T, H, D, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, H, D))
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * D**-0.5
    k = mx.random.normal((B, T, H, D))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, H, D))
    g = -mx.exp(mx.random.uniform(-3, 1, (B, T, H, D)))
    beta = mx.sigmoid(mx.random.normal((B, T, H)))
    mx.eval(q, k, v, g, beta)
    return q, k, v, g, beta


def timeit(fns: dict, reps: int) -> dict:
    """Interleaved timing: {name: (wall seconds per round, CPU seconds per round)} after one warm-up each."""
    for fn in fns.values():
        fn()
    res = {name: ([], []) for name in fns}
    for r in range(reps):
        for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            t, c = time.perf_counter(), time.process_time()
            fns[name]()
            res[name][0].append(time.perf_counter() - t)
            res[name][1].append(time.process_time() - c)
    return res


def spread(xs) -> str:
    """'median (min-max)' in ms."""
    return f"{statistics.median(xs) * 1e3:.1f} ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})"


def layer_rounds(args) -> None:
    """``--layer``: one ``KimiDeltaAttention`` layer (projections, short conv, gates, scan, output norm * gate,
    o_proj) at the real (hidden 2304, 32 heads) or narrow (hidden 768, 6 heads) width, random weights in
    ``profile_prefill.randomize``'s scales, forward or (``--grad``) value_and_grad of sum(y^2) over its parameters;
    current code vs ``profile_prefill``'s ``kda-uncompiled-output-norm`` baseline, interleaved."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from profile_prefill import BASELINES, REAL_WIDTH, randomize

    from bench_vs_mlx_lm import CONFIG
    from kimi_mlx.config import KimiConfig
    from kimi_mlx.layers.kda import KimiDeltaAttention

    layer = KimiDeltaAttention(KimiConfig.from_hf(REAL_WIDTH if args.layer == "real" else CONFIG))
    randomize(layer)
    print(f"device={mx.default_device()} KDA layer {args.layer}: hidden {layer.o_proj.weight.shape[0]}, "
          f"{layer.num_heads} heads x {layer.head_dim}, grad={args.grad}")
    patches = [BASELINES["kda-uncompiled-output-norm"]()]
    for T in (int(t) for t in args.T.split(",")):
        x = mx.random.normal((args.B, T, layer.o_proj.weight.shape[0]), key=mx.random.key(1))
        if args.grad:
            vg = nn.value_and_grad(layer, lambda x: (layer(x) ** 2).sum())
            run = lambda: mx.eval(vg(x))  # noqa: E731
        else:
            run = lambda: mx.eval(layer(x))  # noqa: E731

        def baseline():
            undo = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
            for obj, attr, repl in patches:
                setattr(obj, attr, repl)
            try:
                run()
            finally:
                for u in undo:
                    setattr(*u)

        res = timeit({"current": run, "baseline kda-uncompiled-output-norm": baseline}, args.reps)
        print(f"T={T} ({args.reps} interleaved rounds; ms: median (min-max)):")
        for name, (wall, cpu) in res.items():
            print(f"  {name}: wall {spread(wall)}, CPU {spread(cpu)}")
        ratio = statistics.median(c / b for c, b in zip(*(r[1] for r in res.values())))
        print(f"  current / baseline CPU: {ratio:.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--T", default="512,2048")
    ap.add_argument("--chunks", default="16,32,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-recurrent", action="store_true")
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--grad", action="store_true", help="time value_and_grad of a scalar loss instead of forward")
    ap.add_argument("--layer", choices=["real", "narrow"],
                    help="time one KDA layer at this width against the uncompiled-output-norm baseline instead")
    args = ap.parse_args()
    if args.layer:
        return layer_rounds(args)

    try:
        from mlx_lm.models.gated_delta import gated_delta_ops
    except ImportError:  # pragma: no cover
        gated_delta_ops = None

    print(f"device={mx.default_device()} B={args.B} H={args.H} Dk=Dv={args.D} grad={args.grad}")
    for T in (int(t) for t in args.T.split(",")):
        inputs = make_inputs(args.B, T, args.H, args.D)
        fns = {}
        for c in args.chunks.split(","):
            fns[f"chunked C={c}"] = (lambda c: lambda *a: kda_chunked(*a, chunk_size=c))(int(c))
        if not args.no_recurrent:
            fns["recurrent"] = kda_recurrent
        if not args.no_mlx_lm and gated_delta_ops is not None and not args.grad:
            fns["mlx-lm gated_delta_ops"] = gated_delta_ops
        runs = {}
        for name, fn in fns.items():
            if args.grad:
                def loss(*a, fn=fn):
                    o, s = fn(*a)
                    return (o * o).sum() + s.sum()

                vg = mx.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
                runs[name] = lambda vg=vg: mx.eval(vg(*inputs))  # noqa: E731
            else:
                runs[name] = lambda fn=fn: mx.eval(fn(*inputs))  # noqa: E731
        if T > 512:  # the token-by-token paths take seconds here: one timed run each
            slow = {n: runs.pop(n) for n in list(runs) if "chunked" not in n}
            res = {**timeit(runs, args.reps), **timeit(slow, 1)} if slow else timeit(runs, args.reps)
        else:
            res = timeit(runs, args.reps)
        first = next(iter(res))
        print(f"T={T} ({args.reps} interleaved rounds; ms: median (min-max); CPU ratio vs {first}):")
        for name, (wall, cpu) in res.items():
            same_rounds = len(cpu) == len(res[first][1])
            ratio = statistics.median(c / c0 for c, c0 in zip(cpu, res[first][1])) if same_rounds else float("nan")
            print(f"  {name}: wall {spread(wall)}, CPU {spread(cpu)}, CPU ratio {ratio:.2f}, "
                  f"{statistics.median(wall) * 1e3 / T:.2f} ms/tok", flush=True)


if __name__ == "__main__":
    main()
