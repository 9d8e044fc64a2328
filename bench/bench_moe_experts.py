"""Routed experts of one MoE layer at prefill, alone: ``switch_glu``'s sorted path as it is vs earlier or other
ways to run the same experts, interleaved in every round.

Shapes (float32, one layer, ``--tokens`` tokens, uniform random top-k routing, random hidden states):
``--model real`` Kimi-Linear-48B's expert width (64 experts x 1024, hidden 2304, top-8, as profile_prefill.py's
slice; the real model has 256 experts, ``--experts 256``: at 2048 tokens ~64 rows each instead of ~256) or
``--model narrow`` (bench_vs_mlx_lm.py's 16 x 256, hidden 768, top-4). ``--ggml TYPE``: the experts as random
well-formed GGML blocks of that type (``GGMLSwitchLinear``, ``tests/ggml_random.py``'s scale fields; the bytes are
random) instead of float weights. On a Mac (Metal) the same variants time the GPU: ``gather`` is then what
``switch_glu`` runs for float and MLX-quantized experts.

Variants (``--variants``, first one is the reference the others are compared with):
- ``sorted``: ``sorted_switch_glu`` as it is (each expert's weights read as a view of the stack);
- ``sorted-copied``: the same with each expert's weights read by integer indexing (``stack[e]``: a copy of the
  expert's weights, float or blocks, at every call);
- ``gather``: mlx-lm's ``SwitchGLU`` (one row gather, then ``gather_mm`` / ``gather_qmm`` with sorted indices per
  projection: one segmented matmul on MLX's GPU backends; MLX's CPU backend runs it one row at a time).

Prints per variant the median wall and process CPU time of one layer's routed experts (evaluated), the min-max
spread, the median per-round ratio against the first variant, and the max |difference| of its output.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/bench_moe_experts.py
    LD_PRELOAD=... python bench/bench_moe_experts.py --model narrow --variants sorted gather
    LD_PRELOAD=... python bench/bench_moe_experts.py --ggml Q6_K --tokens 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_vs_mlx_lm import blas_in_use  # noqa: E402

from kimi_mlx.layers import moe  # noqa: E402
from kimi_mlx.layers.ggml import to_ggml  # noqa: E402
from kimi_mlx.ops.ggml import get_format, matmul as ggml_mm, row_bytes  # noqa: E402

SHAPES = {"real": (64, 1024, 2304, 8), "narrow": (16, 256, 768, 4)}  # experts, width, hidden, top-k


def _eval(y: mx.array) -> mx.array:
    mx.eval(y)
    return y


def _copied(stack: mx.array, e: int) -> mx.array:
    return stack[e]


def patched(fn):
    """``fn`` run with integer-indexed expert weights (the float path's and the GGML path's ``expert_view``)."""

    def run(*a):
        saved = moe.expert_view, ggml_mm.expert_view
        moe.expert_view = ggml_mm.expert_view = _copied
        try:
            return _eval(fn(*a))
        finally:
            moe.expert_view, ggml_mm.expert_view = saved

    return run


VARIANTS = {
    "sorted": lambda s, x, i: _eval(moe.sorted_switch_glu(s, x, i)),
    "sorted-copied": patched(moe.sorted_switch_glu),
    "gather": lambda s, x, i: _eval(s(x, i)),
}


def ggml_switch(switch: SwitchGLU, name: str, seed: int) -> SwitchGLU:
    """``switch`` with its three projections swapped for random GGML blocks of type ``name``."""
    from ggml_random import set_scale

    rng = np.random.default_rng(seed)
    to_ggml(switch, {p: name for p in ("gate_proj", "up_proj", "down_proj")})
    fmt = get_format(name)
    for p in ("gate_proj", "up_proj", "down_proj"):
        layer = switch[p]
        E, N, _ = layer["weight"].shape
        K = layer.input_dims
        blocks = rng.integers(0, 256, (E * N * K // fmt.block_elems, fmt.type_bytes), dtype=np.uint8)
        set_scale(blocks, name, np.full(blocks.shape[0], 2.0**-14))
        layer.weight = mx.array(blocks.reshape(E, N, row_bytes(name, K)))
    return switch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="real")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=None, help="number of experts (default: the model's; 256 is "
                    "Kimi-Linear-48B's)")
    ap.add_argument("--ggml", default=None, help="GGML type of the experts' blocks (default: float32 weights)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["sorted", "sorted-copied"])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    E, I, H, k = SHAPES[args.model]
    E = args.experts or E
    T = args.tokens
    mx.random.seed(0)
    switch = SwitchGLU(H, I, E)
    if args.ggml:
        switch = ggml_switch(switch, args.ggml, 0)
    x = mx.random.normal((T, H))  # [T, H]
    inds = mx.argpartition(mx.random.uniform(shape=(T, E)), kth=k - 1, axis=-1)[:, :k].astype(mx.uint32)  # [T, k]
    mx.eval(switch.parameters(), x, inds)
    print(f"BLAS: {blas_in_use()}")
    print(f"{args.model}: {E} experts x {I}, hidden {H}, top-{k}, {T} tokens ({T * k} pairs, ~{T * k // E} rows an "
          f"expert); experts {args.ggml or 'float32'}; medians of {args.runs} interleaved rounds after a warm-up")
    wall, cpu, outs = ({n: [] for n in args.variants} for _ in range(3))
    for r in range(args.runs + 1):
        for n in (args.variants if r % 2 else args.variants[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            y = VARIANTS[n](switch, x, inds)
            if r:
                wall[n].append(time.perf_counter() - t0)
                cpu[n].append(time.process_time() - c0)
            else:
                outs[n] = y
    ref = args.variants[0]
    print(f"\n| variant | wall ms (min-max) | CPU ms (min-max) | wall / {ref} | CPU / {ref} | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in args.variants:
        w, c = wall[n], cpu[n]
        rw = statistics.median(a / b for a, b in zip(w, wall[ref]))
        rc = statistics.median(a / b for a, b in zip(c, cpu[ref]))
        d = mx.abs(outs[n] - outs[ref]).max().item()
        print(f"| {n} | {statistics.median(w) * 1e3:.0f} ({min(w) * 1e3:.0f}-{max(w) * 1e3:.0f}) | "
              f"{statistics.median(c) * 1e3:.0f} ({min(c) * 1e3:.0f}-{max(c) * 1e3:.0f}) | {rw:.2f}x | {rc:.2f}x | "
              f"{d:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
