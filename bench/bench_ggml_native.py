"""GGML-native IQ2_XXS routed experts vs the same blocks requantized to MLX affine vs float, on the bench model.

The Kimi Linear bench model of ``bench_vs_mlx_lm.py`` (hidden 768, 12 layers, 16 experts of width 256, top-4) with
every routed expert (``switch_mlp.{gate,up,down}_proj``) replaced by random well-formed IQ2_XXS blocks (the format
of the public 2-bit Kimi GGUFs' experts; ``tests/ggml_random.py``), run four ways on the same blocks:

- ``native``: ``GGMLSwitchLinear`` keeps the blocks (2.06 bits per weight) and computes with them exactly (the
  default for a GGUF since issue 15): decode dequantizes only the selected experts, prefill one expert at a time;
- ``affine3`` / ``affine2``: ``load(..., requantize=True)``'s conversion to MLX affine g32, 3 bits (its default for
  IQ2_XXS) and 2 bits, run by MLX's ``gather_qmm`` / ``quantized_matmul`` (lossy: the max |weight error| is printed);
- ``float``: the blocks dequantized to float32 ``SwitchLinear`` (exact, 16x the bytes).

Measured (medians of ``--runs`` interleaved rounds after a warm-up, ratios against ``native`` in the same run): weight
bytes of the routed experts and of the whole model, prefill tok/s at ``--prompt`` tokens, decode tok/s over
``--steps`` greedy steps after it, and max |logit - float's| / max |logit| of the prompt.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/bench_ggml_native.py
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_vs_mlx_lm import (  # noqa: E402
    blas_in_use,
    checkpoint_dir,
    decode_once,
    interleaved,
    load_kimi,
    prefill_once,
)
from ggml_random import random_blocks  # noqa: E402
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear  # noqa: E402

from kimi_mlx.convert.gguf import quant  # noqa: E402
from kimi_mlx.layers.ggml import GGMLSwitchLinear  # noqa: E402
from kimi_mlx.ops.ggml import dequantize  # noqa: E402

TYPE = "IQ2_XXS"


def expert_blocks(model, seed: int = 0) -> dict[str, np.ndarray]:
    """Random IQ2_XXS blocks [E, out, row_bytes] for every routed-expert projection of ``model`` (by module path)."""
    rng = np.random.default_rng(seed)
    return {
        path: random_blocks(TYPE, tuple(m.weight.shape), rng, max_abs=0.08)
        for path, m in model.named_modules() if type(m) is SwitchLinear
    }


def expert_layer(path: str, b: np.ndarray, cols: int, variant: str) -> tuple[nn.Module, float]:
    """The routed-expert stack of ``variant`` made from blocks ``b`` [E, out, row_bytes] (``cols`` input columns),
    and its max |weight error| against the exact dequantization (0 for native and float)."""
    E, out, _ = b.shape
    if variant == "native":
        layer = GGMLSwitchLinear(cols, out, E, TYPE)
        layer.weight = mx.array(b)
        return layer, 0.0
    if variant == "float":
        layer = SwitchLinear(cols, out, E, bias=False)
        layer.weight = dequantize(mx.array(b), TYPE)
        return layer, 0.0
    quant.REQUANT_BITS[quant.T[TYPE]] = int(variant[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the requantization warning: its error is reported in the table
        q = quant.to_mlx(path, quant.T[TYPE], b, (E, out, cols), requantize=True)
    layer = QuantizedSwitchLinear(cols, out, E, bias=False, group_size=q["group_size"], bits=q["bits"])
    layer.update({"weight": q["weight"], "scales": q["scales"], "biases": q["biases"]})
    return layer, q["max_abs_error"]


def nbytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["native", "affine3", "affine2", "float"])
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get(
        "KIMI_BENCH_CACHE", "~/.cache/kimi_mlx_bench")).expanduser())
    a = ap.parse_args()
    print(f"BLAS: {blas_in_use()}; mlx {mx.__version__}; device {mx.default_device()}")
    path = checkpoint_dir(a.cache_dir)
    models, errors, blocks, cols = {}, {}, None, {}
    for v in a.variants:
        model = load_kimi(path, mx.float32)
        if blocks is None:
            blocks = expert_blocks(model)
            mods = dict(model.named_modules())
            cols = {p: mods[p].weight.shape[-1] for p in blocks}
        layers = [(p, *expert_layer(p, b, cols[p], v)) for p, b in blocks.items()]
        model.update_modules(tree_unflatten([(p, layer) for p, layer, _ in layers]))
        model.eval()
        mx.eval(model.parameters())
        models[v], errors[v] = model, max(e for _, _, e in layers)
    n_weights = sum(int(np.prod(b.shape[:-1])) * cols[p] for p, b in blocks.items())
    experts = {v: sum(nbytes(dict(m.named_modules())[p]) for p in blocks) for v, m in models.items()}
    vocab = models[a.variants[0]].args.vocab_size
    tokens = mx.random.randint(0, vocab, (1, a.prompt), key=mx.random.key(0))
    logits = {v: m(tokens).astype(mx.float32) for v, m in models.items()}
    ref = logits.get("float")
    prefill, _ = interleaved(models, lambda m: prefill_once(m, tokens), a.runs)
    decode, _ = interleaved(models, lambda m: decode_once(m, tokens, a.steps), a.runs)
    anchor = a.variants[0]
    med = {k: {v: float(np.median(r)) for v, r in d.items()} for k, d in (("prefill", prefill), ("decode", decode))}
    print(f"bench model, routed experts {TYPE} ({len(blocks)} stacks, {n_weights / 1e6:.1f} M weights), prompt "
          f"{a.prompt}, decode {a.steps} steps, medians of {a.runs}; ratios vs {anchor}")
    print("| variant | expert bytes | bits/weight | model bytes | prefill tok/s | decode tok/s | max weight error "
          "| logit error vs float |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for v, m in models.items():
        err = "" if ref is None else f"{(mx.abs(logits[v] - ref).max() / mx.abs(ref).max()).item():.2e}"
        print(f"| {v} | {experts[v] / 2**20:.1f} MiB ({experts[v] / experts[anchor]:.2f}x) | "
              f"{8 * experts[v] / n_weights:.2f} | {nbytes(m) / 2**20:.1f} MiB | "
              f"{med['prefill'][v]:.1f} ({med['prefill'][v] / med['prefill'][anchor]:.2f}x) | "
              f"{med['decode'][v]:.2f} ({med['decode'][v] / med['decode'][anchor]:.2f}x) | "
              f"{errors[v]:.3g} | {err} |")


if __name__ == "__main__":
    main()
