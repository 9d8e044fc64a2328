"""Time the Metal kernels against their pure-MLX paths and mlx-lm's kernels on the same inputs (Apple GPU only).

    python bench/kernels.py                          # decode step, 2K and 8K prefill; bf16
    python bench/kernels.py --T 1,64,2048 --dtype float32 --reps 20
    python bench/kernels.py --emulator ../shared/tools/metal_emu   # Linux: smoke-run every path, tiny shapes

KDA (B=1, H=32, Dk=Dv=128, raw q/k/v/f/b in, output and state out; the gates and q/k normalisation are part of
every timed path):
- ``kimi-mlx kernels``: ``kda_gated`` as the model calls it (fused recurrent kernel up to RECURRENT_KERNEL_MAX_T
  tokens, else ``kda_forward`` with the chunked-scan kernel);
- ``recurrent kernel``: ``kda_recurrent_metal`` at every T (shows the crossover with the chunked path);
- ``pure MLX``: ``kda_gated`` inside ``kimi_mlx.metal.disabled()``;
- ``mlx-lm``: ``normalize_qk`` + ``gated_delta_update`` (vector gate, its Metal kernel).
KDA chunked prefill (T > RECURRENT_MAX_T) on prepared inputs: ``kda_chunked_metal`` vs ``kda_chunked`` vs mlx-lm's
``gated_delta_kernel``.
KDA chunked prep kernel alone (T > RECURRENT_MAX_T, chunk 16, one launch over T tokens, prepared inputs): this
checkout's ``kda_chunked_prep`` (chunk rows staged in threadgroup memory; 4 SIMD-groups and the widest slab by
default, plus 2 / 8 SIMD-groups and slabs of 64 channels) vs the one-SIMD-group kernel it replaced
(``bench/baselines/kda_chunked_prep_one_simdgroup.metal``) vs pure MLX ``kda_chunked.intra_chunk``; the header
prints each kernel's device reads / writes per chunk, counted from its source (``prep_device_traffic``).
AttnRes (K snapshots of [T, d], default K=8, d=4096): ``attn_res_mix`` with the kernel, without (pure MLX), and
mlx-lm's ``kimi_k3._attn_res_mix`` (its own kernel).
MLA attention (B=1, ``--mla-heads`` heads, r=512, dr=64, dn=dv=128: a T-query causal chunk, T=1 a decode step,
against a latent cache of ``--mla-context`` keys; T <= 512): ``mla_attention_metal`` (``mla_decode`` / ``mla_prefill``), the
pure blockwise absorbed and expanded paths (``mla_attention`` with 2048-key blocks).
MLA decode (B = ``--mla-batch``, one query per row, against each of ``--mla-decode-contexts`` cached keys, in
4096-key pages as the paged cache holds them): the split-K decode (``mla_decode_split`` + ``mla_decode_reduce``, the
splits ``decode_splits`` picks for ``--gpu-cores``, shown in the row label), the one-pass ``mla_decode``, MLX's
``mx.fast.scaled_dot_product_attention`` on the same absorbed op (``mla_paths.fused``: latent queries against the
latent as one shared key/value head of dim r, rope scores as an additive mask; MLX's fused vector kernels take head
dims up to 256, so at r = 512 this is its unfused fallback), and a yardstick: MLX's own decode kernel (sdpa_vector,
2-pass for long keys) on a GQA decode of the same heads over 2 KV heads of dim 128 (K + V = S x 512 elements, about
the latent's S x 576). Under each row the split-K kernel's effective rate (latent + rope bytes read once / time).
GGML blocks (``--ggml-type``, default IQ2_XXS, weight ``--ggml-rows`` x ``--ggml-cols``, x [T, cols]): ``ggml_matmul``
with the kernels (``ggml_matvec`` up to MATVEC_MAX_ROWS rows, else ``ggml_dequant`` chunks + MLX's GEMM), without
(pure MLX), and MLX's ``quantized_matmul`` on the same weights requantized to affine 3-bit g32 (the lossy
alternative). Every kernel runs with its op's default launch settings, which stay within ``kimi_mlx.metal``'s launch
limits (``MAX_THREADS_PER_THREADGROUP``, ``MAX_THREADGROUP_MEMORY``) at any size. Times are medians over ``--reps``
runs after warm-up, in ms, the paths of a row interleaved (one run of each per round);
under each row, every path's max |output - pure MLX| (the paths compute the same op).
Without Metal (and without ``--emulator``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from kimi_mlx import metal
from kimi_mlx.ops.attn_res import attn_res_mix, inv_rms
from kimi_mlx.ops.kda import DEFAULT_CHUNK_SIZE, RECURRENT_MAX_T, kda_gated
from kimi_mlx.ops.kda_chunked import intra_chunk, kda_chunked
from kimi_mlx.ops.kda_chunked_metal import (
    PREP_KERNEL,
    PREP_SIMDGROUPS,
    kda_chunked_metal,
    prep_slabs,
    prep_threadgroup_bytes,
)
from kimi_mlx.ops.kda_recurrent_metal import kda_recurrent_metal
from kimi_mlx.ops.mla_attention import mla_attention
from kimi_mlx.ops.mla_attention_metal import DEFAULT_GPU_CORES, decode_splits, mla_attention_metal
from kimi_mlx.ops.mla_paths import fused


BASELINE_PREP = Path(__file__).resolve().parent / "baselines" / "kda_chunked_prep_one_simdgroup.metal"


def timeit(fns, reps: int) -> list[float]:
    """Median wall time of ``mx.eval(fn())`` in ms for each of ``fns``, after two warm-up calls of each; the
    functions run interleaved (one call of each per round), so a slow phase of the machine hits all of them."""
    for fn in fns:
        mx.eval(fn())
        mx.eval(fn())
    ts = [[] for _ in fns]
    for _ in range(reps):
        for fn, t_fn in zip(fns, ts):
            t = time.perf_counter()
            mx.eval(fn())
            t_fn.append(time.perf_counter() - t)
    return [statistics.median(t) * 1e3 for t in ts]


def max_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


def kda_inputs(B, T, H, D, dtype, seed=0):
    mx.random.seed(seed)
    q, k, f = (mx.random.normal((B, T, H, D)).astype(dtype) for _ in range(3))
    v = mx.random.normal((B, T, H, D)).astype(dtype)
    b = mx.random.normal((B, T, H)).astype(dtype)
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (H,)))
    dt_bias = mx.random.normal((H * D,))
    state = 0.1 * mx.random.normal((B, H, D, D))
    mx.eval(q, k, v, f, b, A_log, dt_bias, state)
    return q, k, v, f, b, A_log, dt_bias, state


def bench_kda(T, args, dtype):
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    B, H, D = 1, args.H, args.D
    q, k, v, f, b, A_log, dt_bias, state = kda_inputs(B, T, H, D, dtype)
    kw = {"lower_bound": None, "l2_eps": 1e-6, "state": state}

    def ours():
        return kda_gated(q, k, v, f, b, A_log, dt_bias, **kw)

    def recurrent():
        return kda_recurrent_metal(q, k, v, f, b, A_log, dt_bias, **kw)

    def pure():
        with metal.disabled():
            return kda_gated(q, k, v, f, b, A_log, dt_bias, **kw)

    def mlx_lm():
        qn, kn = normalize_qk(q, k, inv_scale=D**-0.5, eps=1e-6)
        return gated_delta_update(qn, kn, v, f, b, A_log[:, None], dt_bias.reshape(H, D), state)

    return {"kimi-mlx kernels": ours, "recurrent kernel": recurrent, "pure MLX": pure, "mlx-lm": mlx_lm}


def kda_prepared_inputs(T, args, dtype):
    """(q, k, v, g, beta, state) as ``kda_forward`` takes them: q / k L2-normalised (q scaled by D^-0.5) in ``dtype``,
    log-decay g and beta float32; B = 1, ``args.H`` heads of ``args.D``."""
    B, H, D = 1, args.H, args.D
    q, k, v, f, b, A_log, dt_bias, state = kda_inputs(B, T, H, D, dtype)
    q = (q * mx.rsqrt((q.astype(mx.float32) ** 2).sum(-1, keepdims=True) + 1e-6) * D**-0.5).astype(dtype)
    k = (k * mx.rsqrt((k.astype(mx.float32) ** 2).sum(-1, keepdims=True) + 1e-6)).astype(dtype)
    g = -mx.exp(A_log)[:, None] * mx.logaddexp(f.astype(mx.float32).reshape(B, T, H, D) + dt_bias.reshape(H, D), 0.0)
    beta = mx.sigmoid(b.astype(mx.float32))
    mx.eval(q, k, g, beta)
    return q, k, v, g, beta, state


def prep_device_traffic(C: int, Dk: int, Dv: int, BK: int | None = None) -> dict[str, int]:
    """Device-memory elements one chunk's prep threadgroup loads and stores (q / k / g / v / wq / uo / kg / decay;
    mask and beta scalars left out), counted from the kernels' sources for a full chunk. ``BK=None``: the
    one-SIMD-group baseline, which re-reads q, k, g for every (i, j) pair, v for every (i, m <= i), and the wq rows it
    wrote; else this checkout's kernel with slabs of BK channels (q, k, g read once when BK = Dk, twice otherwise)."""
    pairs, tri = C * (C - 1) // 2, C * (C + 1) // 2
    if BK is None:
        inputs = 2 * C * Dk + 3 * Dk * pairs + 5 * C * Dk + Dv * tri  # step 1, step 4 (fwd + bwd), step 5
        return {"input reads": inputs, "output reads": Dk * (C + 2 * tri), "writes": 5 * C * Dk + Dk + 2 * C * Dv}
    passes = 1 if BK == Dk else 2
    return {"input reads": 3 * C * Dk * passes + C * Dv, "output reads": 0, "writes": 3 * C * Dk + Dk + 2 * C * Dv}


def bench_kda_prep(T, args, dtype):
    """The prep kernel alone over T tokens (chunk DEFAULT_CHUNK_SIZE, one launch, B = 1): this checkout's kernel at
    several launch settings vs the one-SIMD-group baseline vs pure MLX ``intra_chunk``; the first output (wq) is
    what the parity line compares."""
    C, H, D = DEFAULT_CHUNK_SIZE, args.H, args.D
    q, k, v, g, beta, _ = kda_prepared_inputs(T, args, dtype)
    mask = mx.ones((1, T), dtype=mx.bool_)
    N = -(-T // C)
    shapes = [(N, 1, H, 2 * C, D), (N, 1, H, 2 * C, D), (N, 1, H, C, D), (N, 1, H, D)]
    base_template = [("QT", dtype), ("KT", dtype), ("VT", dtype), ("C", C), ("Dk", D), ("Dv", D), ("H", H)]
    kf = metal.parse_kernel_file("kda_chunked_prep_one_simdgroup", BASELINE_PREP.read_text(), str(BASELINE_PREP))
    old = args.factory(name="kda_chunked_prep_one_simdgroup", input_names=list(kf.input_names),
                       output_names=list(kf.output_names), source=kf.source, header=kf.header,
                       ensure_row_contiguous=True)  # fmt: skip
    new = metal.kernel(PREP_KERNEL)

    def launch(kern, sg, template):
        return kern(inputs=[q, k, v, g, beta, mask, T, 0, T], template=template, grid=(32 * sg, N, H),
                    threadgroup=(32 * sg, 1, 1), output_shapes=shapes, output_dtypes=[mx.float32] * 4)  # fmt: skip

    def staged(sg, slab=None):
        BK, BV = prep_slabs(C, D, D, slab)
        return lambda: launch(new, sg, [*base_template, ("SG", sg), ("BK", BK), ("BV", BV)])

    def pure():
        pad = N * C - T

        def chunks(x):  # [1, T, H, D] -> [N * H, C, D], chunk-major, zero-padded
            x = mx.pad(x.astype(mx.float32), [(0, 0), (0, pad), (0, 0), (0, 0)])
            return x.reshape(1, N, C, H, -1).transpose(1, 0, 3, 2, 4).reshape(N * H, C, -1)

        out = intra_chunk(chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta[..., None])[..., 0])
        return [o.reshape(s) for o, s in zip(out, shapes)]

    fns = {"one SIMD-group": lambda: launch(old, 1, base_template)}
    fns[f"staged sg{PREP_SIMDGROUPS}"] = staged(PREP_SIMDGROUPS)
    for sg in (2, 8):
        fns[f"staged sg{sg}"] = staged(sg)
    if D % 64 == 0 and D > 64:
        fns["staged sg4 BK64"] = staged(4, 64)
    fns["pure MLX"] = pure
    return fns


def prep_header(args) -> str:
    """Device traffic and threadgroup memory per chunk of the kernels ``bench_kda_prep`` times (float32 elements)."""
    C, D = DEFAULT_CHUNK_SIZE, args.D
    lines = [f"per chunk of {C} tokens, Dk = Dv = {D} (elements; x4 bytes in float32):"]
    rows = [("one SIMD-group", None, 4 * 3 * C * C)]
    for slab in sorted({prep_slabs(C, D, D)[0], *([64] if D % 64 == 0 and D > 64 else [])}, reverse=True):
        rows.append((f"staged BK {slab}", slab, prep_threadgroup_bytes(C, slab)))
    for name, slab, tg_bytes in rows:
        t = prep_device_traffic(C, D, D, slab)
        lines.append(f"  {name:>16}: input reads {t['input reads']}, reads of its own outputs {t['output reads']}, "
                     f"writes {t['writes']}; threadgroup memory {tg_bytes} bytes")  # fmt: skip
    return "\n".join(lines)


def bench_kda_chunked(T, args, dtype):
    """The chunked prefill alone on prepared inputs (normalised q/k, log-decay g, beta): prep + scan kernels vs the
    pure-MLX chunked path (``kda_chunked``, chunk 16) vs mlx-lm's gated_delta_kernel (vector gate exp(g), token by
    token; its ops fallback where mlx-lm built no kernel, i.e. in the emulator smoke run)."""
    from mlx_lm.models.gated_delta import gated_delta_kernel, gated_delta_ops

    lm_scan = gated_delta_kernel if mx.metal.is_available() else gated_delta_ops
    q, k, v, g, beta, state = kda_prepared_inputs(T, args, dtype)
    alpha = mx.exp(g)
    mx.eval(alpha)

    def kernels():
        return kda_chunked_metal(q, k, v, g, beta, state, chunk_size=DEFAULT_CHUNK_SIZE)

    def pure():
        with metal.disabled():
            return kda_chunked(q, k, v, g, beta, state, chunk_size=DEFAULT_CHUNK_SIZE)

    def mlx_lm():
        return lm_scan(q, k, v, alpha, beta, state)

    return {"chunked kernels": kernels, "pure MLX": pure, "mlx-lm": mlx_lm}


def bench_attn_res(T, args, dtype):
    from mlx_lm.models import kimi_k3 as lm_k3

    mx.random.seed(0)
    K, d = args.K, args.d
    blocks = mx.stack([mx.random.normal((1, T, d)).astype(dtype) for _ in range(K)])
    scales = mx.stack([inv_rms(x, 1e-6) for x in blocks])
    partial = mx.random.normal((1, T, d)).astype(dtype)
    w_eff = mx.random.normal((d,)) * d**-0.5
    lm_blocks = lm_k3.ResidualBlocks(1e-6)
    for x in blocks:
        lm_blocks.append(x)
    mx.eval(blocks, scales, partial, w_eff, lm_blocks.raw, lm_blocks.inv_rms)

    def ours():
        return (attn_res_mix(blocks, scales, partial, w_eff, 1e-6),)

    def pure():
        with metal.disabled():
            return (attn_res_mix(blocks, scales, partial, w_eff, 1e-6),)

    def mlx_lm():
        return (lm_k3._attn_res_mix(lm_blocks, partial, w_eff, 1e-6),)

    return {"kimi-mlx kernel": ours, "pure MLX": pure, "mlx-lm": mlx_lm}


def bench_mla(T, args, dtype):
    from mlx_lm.models.mla import MultiLinear

    mx.random.seed(0)
    H, S, r, dr, dn, dv = (
        args.mla_heads,
        args.mla_context + T,
        args.mla_rank,
        args.mla_rope,
        args.mla_nope,
        args.mla_nope,
    )
    q_nope, q_pe = mx.random.normal((1, H, T, dn)).astype(dtype), mx.random.normal((1, H, T, dr)).astype(dtype)
    c, kr = mx.random.normal((1, 1, S, r)).astype(dtype), mx.random.normal((1, 1, S, dr)).astype(dtype)
    embed_q, unembed_out = MultiLinear(dn, r, H), MultiLinear(r, dv, H)
    embed_q.set_dtype(dtype)
    unembed_out.set_dtype(dtype)
    mask = None if T == 1 else "causal"
    args_ = (q_nope, q_pe, c, kr, embed_q, unembed_out, (dn + dr) ** -0.5, mask)
    mx.eval(q_nope, q_pe, c, kr, embed_q.parameters(), unembed_out.parameters())

    def ours():
        return (mla_attention_metal(*args_),)

    def pure(absorbed):
        with metal.disabled():
            return (mla_attention(*args_, absorbed=absorbed),)

    return {"kimi-mlx kernel": ours, "pure MLX": lambda: pure(None), "pure absorbed": lambda: pure(True),
            "pure expanded": lambda: pure(False)}  # fmt: skip


def bench_mla_decode(S, args, dtype):
    """One decode step against S cached keys in pages of ``args.mla_page`` (see the module docstring)."""
    from mlx_lm.models.mla import MultiLinear

    mx.random.seed(0)
    B, H, r, dr, dn = args.mla_batch, args.mla_heads, args.mla_rank, args.mla_rope, args.mla_nope
    q_nope, q_pe = mx.random.normal((B, H, 1, dn)).astype(dtype), mx.random.normal((B, H, 1, dr)).astype(dtype)
    c, kr = mx.random.normal((B, 1, S, r)).astype(dtype), mx.random.normal((B, 1, S, dr)).astype(dtype)
    cuts = list(range(0, S, args.mla_page)) + [S]
    pages = [mx.contiguous(c[:, :, a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    rope_pages = [mx.contiguous(kr[:, :, a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    embed_q, unembed_out = MultiLinear(dn, r, H), MultiLinear(r, dv := dn, H)
    embed_q.set_dtype(dtype)
    unembed_out.set_dtype(dtype)
    scale = (dn + dr) ** -0.5
    kv_heads = 2  # the yardstick's GQA: K + V = 2 x 2 x 128 = 512 elements per key
    q_g = mx.random.normal((B, H, 1, 128)).astype(dtype)
    k_g, v_g = (mx.random.normal((B, kv_heads, S, 128)).astype(dtype) for _ in range(2))
    mx.eval(q_nope, q_pe, pages, rope_pages, c, kr, q_g, k_g, v_g, embed_q.parameters(), unembed_out.parameters())
    paged = (q_nope, q_pe, pages, rope_pages, embed_q, unembed_out, scale, None)
    n = decode_splits(B, H, S, gpu_cores=args.gpu_cores)
    gb = (S * (r + dr) * B * dtype.size) / 1e9  # latent + rope, read once per step
    gb_gqa = (S * 2 * kv_heads * 128 * B * dtype.size) / 1e9  # the yardstick's K + V
    picks = f"{n} splits" if n else "one-pass mla_decode"
    args.mla_decode_note = (gb, gb_gqa, f"split-K ran {max(n, 2)} splits (mla_attention picks {picks}); "
                                        f"{gb:.3g} GB of latent + rope per step")  # fmt: skip

    def split_k():
        return (mla_attention_metal(*paged, splits=max(n, 2), gpu_cores=args.gpu_cores),)

    def one_pass():
        return (mla_attention_metal(*paged, splits=0),)

    def mlx_sdpa():
        return (fused(q_nope, q_pe, c, kr, embed_q, unembed_out, scale, None, absorbed=True),)

    def pure():
        with metal.disabled():
            return (mla_attention(*paged),)

    def yardstick():
        return (mx.fast.scaled_dot_product_attention(q_g, k_g, v_g, scale=128**-0.5)[..., :dv],)

    return {"split-K kernels": split_k, "one-pass mla_decode": one_pass, "mx.fast sdpa": mlx_sdpa,
            "pure MLX": pure, "MLX GQA-128 yardstick": yardstick}  # fmt: skip


def bench_ggml(T, args, dtype):
    import warnings
    from pathlib import Path

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ggml_random import random_blocks

    from kimi_mlx.convert.gguf import quant
    from kimi_mlx.ops.ggml import ggml_matmul

    name, N, K = args.ggml_type, args.ggml_rows, args.ggml_cols
    raw = random_blocks(name, (N, K), np.random.default_rng(0))
    blocks = mx.array(raw)
    x = mx.random.normal((T, K), key=mx.random.key(0)).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quant.to_mlx("w", quant.T[name], raw, (N, K), requantize=True)
    w, scales, biases = (q[k] for k in ("weight", "scales", "biases"))
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    mx.eval(blocks, x, w, scales, biases)

    def pure():
        with metal.disabled():
            return (ggml_matmul(x, blocks, name),)

    def affine():
        return (mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=q["group_size"], bits=q["bits"]),)

    return {"kimi-mlx kernel": lambda: (ggml_matmul(x, blocks, name),), "pure MLX": pure,
            f"affine {q['bits']}-bit": affine}  # fmt: skip


def run(args) -> None:
    dtype = getattr(mx, args.dtype)
    sections = (
        ("KDA", bench_kda, args.T),
        ("KDA chunked prefill, prepared inputs", bench_kda_chunked, [T for T in args.T if T > RECURRENT_MAX_T]),
        ("KDA chunked prep kernel alone, prepared inputs", bench_kda_prep, [T for T in args.T if T > RECURRENT_MAX_T]),
        ("AttnRes mix", bench_attn_res, args.T),
        (f"MLA attention against {args.mla_context} cached keys", bench_mla, [T for T in args.T if T <= 512]),
        (f"MLA decode, batch {args.mla_batch}, {args.mla_heads} heads (rows: cached keys S)", bench_mla_decode,
         args.mla_decode_contexts),
        (f"GGML {args.ggml_type} matmul, weight {args.ggml_rows} x {args.ggml_cols}", bench_ggml, args.T),
    )
    for title, make, Ts in sections:
        print(f"\n== {title} ({args.dtype}; ms, median of {args.reps})")
        if make is bench_kda_prep:
            print(prep_header(args))
        header = None
        for T in Ts:
            fns = make(T, args, dtype)
            if header is None:
                header = ["S" if make is bench_mla_decode else "T"] + list(fns)
                print(" | ".join(f"{h:>16}" for h in header))
            times = timeit(list(fns.values()), args.reps)
            print(" | ".join([f"{T:>16}"] + [f"{t:16.3f}" for t in times]))
            ref = fns["pure MLX"]()[0]
            diffs = ", ".join(f"{name} {max_diff(fn()[0], ref):.2g}" for name, fn in fns.items()
                              if name not in ("pure MLX", "MLX GQA-128 yardstick"))  # fmt: skip
            print(f"{'':>16}   max |output - pure MLX|: {diffs}")
            if make is bench_mla_decode:
                gb, gb_gqa, note = args.mla_decode_note
                print(f"{'':>16}   {note}: {gb / (times[0] * 1e-3):.1f} GB/s (yardstick's K + V: "
                      f"{gb_gqa / (times[-1] * 1e-3):.1f} GB/s)")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="1,2048,8192", help="comma-separated token counts (1 = decode step)")
    ap.add_argument("--H", type=int, default=32, help="KDA heads")
    ap.add_argument("--D", type=int, default=128, help="KDA head dim (Dk = Dv)")
    ap.add_argument("--K", type=int, default=8, help="AttnRes snapshots")
    ap.add_argument("--d", type=int, default=4096, help="AttnRes hidden size")
    ap.add_argument("--mla-heads", type=int, default=32, help="MLA heads")
    ap.add_argument("--mla-context", type=int, default=32768, help="MLA cached keys before the chunk")
    ap.add_argument("--mla-rank", type=int, default=512, help="MLA kv_lora_rank (latent dims)")
    ap.add_argument("--mla-rope", type=int, default=64, help="MLA qk_rope_head_dim")
    ap.add_argument("--mla-nope", type=int, default=128, help="MLA qk_nope_head_dim (= v_head_dim here)")
    ap.add_argument("--mla-batch", type=int, default=1, help="MLA decode: sequences per step")
    ap.add_argument("--mla-decode-contexts", default="1024,4096,16384,32768,131072",
                    help="MLA decode: comma-separated cached key counts")
    ap.add_argument("--mla-page", type=int, default=4096, help="MLA decode: keys per cache page (segment)")
    ap.add_argument("--gpu-cores", type=int, default=DEFAULT_GPU_CORES,
                    help="GPU cores for the split-K decode's split count (decode_splits)")
    ap.add_argument("--ggml-type", default="IQ2_XXS", help="GGML block type of the GGML matmul section")
    ap.add_argument("--ggml-rows", type=int, default=4096, help="GGML weight rows (outputs)")
    ap.add_argument("--ggml-cols", type=int, default=7168, help="GGML weight columns (inputs; a multiple of 256)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--emulator", help="path to metal_emu: run every path once on tiny shapes (no real timings)")
    args = ap.parse_args(argv)
    args.T = [int(t) for t in args.T.split(",")]
    args.mla_decode_contexts = [int(s) for s in args.mla_decode_contexts.split(",")]

    if args.emulator:
        sys.path.insert(0, args.emulator)
        import metal_emu

        print("metal_emu: smoke run on tiny shapes, timings are of the CPU emulator and mean nothing")
        # few heads, tokens and keys, but the real head dims and latent rank (they size the launches), every launch
        # held to the launch limits
        args.T, args.H, args.D, args.K, args.d, args.reps = [1, 70], 1, 128, 2, 64, 1
        args.mla_heads, args.mla_context, args.mla_rank, args.mla_rope, args.mla_nope = 2, 40, 512, 64, 128
        args.mla_decode_contexts, args.mla_page = [600], 256  # 2 splits over 3 pages
        args.ggml_rows, args.ggml_cols = 40, 512
        limits = {"max_threads_per_threadgroup": metal.MAX_THREADS_PER_THREADGROUP,
                  "max_threadgroup_memory": metal.MAX_THREADGROUP_MEMORY}  # fmt: skip
        args.factory = functools.partial(metal_emu.metal_kernel, **limits)
        ctx = metal.emulated(args.factory)
    elif not (mx.metal.is_available() and mx.default_device() == mx.gpu):
        print("bench/kernels.py: no Metal GPU here (the kernels only run on Apple silicon); nothing to time.")
        return 0
    else:
        args.factory = mx.fast.metal_kernel
        ctx = contextlib.nullcontext()
    with ctx:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
