"""Kimi-K3 cross-layer attention residuals (AttnRes): a softmax over depth of earlier block snapshots (spec §2.3).

    keys_i   = values_i * inv_rms_i                 (weightless RMSNorm; inv_rms of a snapshot is computed once)
    logits_i = keys_i . (norm_weight * proj_weight)  (the two weights folded into one score vector w_eff)
    out      = sum_i softmax_i(logits) * values_i    (the RAW values), float32 accumulation

``attn_res_mix`` is the one dispatch point: on a Metal GPU (``kimi_mlx.metal.enabled()``) it launches
``metal_kernels/attn_res_mix.metal`` (``attn_res_mix_metal``), elsewhere it runs the compiled pure-MLX ops below.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .. import metal

metal.register("attn_res_mix")

Blocks = list | mx.array  # K snapshots: a list of [B, T, d] arrays, or one stacked [K, B, T, d] array


def inv_rms(x: mx.array, eps: float) -> mx.array:
    """1 / sqrt(mean(x^2) + eps) over the last axis: [B, T, d] -> [B, T, 1] float32."""
    x = x.astype(mx.float32)
    return mx.rsqrt((x * x).mean(axis=-1, keepdims=True) + eps)


@mx.compile
def _combine(values: list[mx.array], logits: list[mx.array]) -> mx.array:
    """sum_i softmax_i(logits) * values_i; values [B, T, d], logits [B, T, 1] float32."""
    p = mx.softmax(mx.concatenate(logits, axis=-1), axis=-1)
    out = p[..., 0:1] * values[0].astype(mx.float32)
    for i in range(1, len(values)):
        out = out + p[..., i : i + 1] * values[i].astype(mx.float32)
    return out.astype(values[-1].dtype)


@mx.compile
def _scores(values: list[mx.array], scales: list[mx.array], w_eff: mx.array) -> list[mx.array]:
    return [(v.astype(mx.float32) @ w_eff)[..., None] * r for v, r in zip(values, scales)]


def _as_list(x: Blocks) -> list[mx.array]:
    return list(x) if isinstance(x, (list, tuple)) else [x[i] for i in range(x.shape[0])]


def _as_stacked(x: Blocks) -> mx.array:
    return mx.stack(list(x)) if isinstance(x, (list, tuple)) else x


def _check_mix(blocks: Blocks, block_inv_rms: Blocks, partial: mx.array, w_eff: mx.array) -> None:
    """Shape checks naming the argument: K snapshots shaped like ``partial``, inv_rms ``[..., 1]``, w_eff [d]."""
    K = len(blocks) if isinstance(blocks, (list, tuple)) else blocks.shape[0]
    shapes = [tuple(b.shape) for b in _as_list(blocks)]
    if any(sh != tuple(partial.shape) for sh in shapes):
        raise ValueError(f"attn_res_mix: block shapes {shapes} differ from partial {tuple(partial.shape)}")
    rms_shapes = [tuple(r.shape) for r in _as_list(block_inv_rms)]
    want = (*partial.shape[:-1], 1)
    if len(rms_shapes) != K or any(sh != want for sh in rms_shapes):
        raise ValueError(f"attn_res_mix: block_inv_rms shapes {rms_shapes}, expected {K} x {want}")
    if tuple(w_eff.shape) != (partial.shape[-1],):
        raise ValueError(f"attn_res_mix: w_eff shape {tuple(w_eff.shape)}, expected ({partial.shape[-1]},)")


def attn_res_mix(blocks: Blocks, block_inv_rms: Blocks, partial: mx.array, w_eff: mx.array, eps: float) -> mx.array:
    """Mix the completed block snapshots and the running partial sum.

    blocks: K snapshots [B, T, d] (stream dtype), as a list or stacked [K, B, T, d]; block_inv_rms: their
    ``inv_rms`` [B, T, 1] float32 (list, or stacked [K, B, T, 1]); partial: [B, T, d]; w_eff: [d] float32 =
    norm_weight * proj_weight. Returns [B, T, d] in partial's dtype.
    """
    _check_mix(blocks, block_inv_rms, partial, w_eff)
    kern = metal.kernel("attn_res_mix")
    if kern is None or not len(blocks):
        return _mix_pure(blocks, block_inv_rms, partial, w_eff, eps)
    # Gradients (training) come from the pure-MLX path: custom kernels have no VJP.
    op = metal.with_reference_vjp(
        lambda *a: [attn_res_mix_metal(*a, eps, kernel=kern)], lambda *a: [_mix_pure(*a, eps)]
    )
    return op(_as_stacked(blocks), _as_stacked(block_inv_rms), partial, w_eff)[0]


def _mix_pure(blocks: Blocks, block_inv_rms: Blocks, partial: mx.array, w_eff: mx.array, eps: float) -> mx.array:
    values = _as_list(blocks) + [partial]
    return _combine(values, _scores(values, _as_list(block_inv_rms) + [inv_rms(partial, eps)], w_eff))


def attn_res_mix_metal(
    blocks: Blocks,
    block_inv_rms: Blocks,
    partial: mx.array,
    w_eff: mx.array,
    eps: float,
    *,
    kernel=None,
    threads: int | None = None,
    rows_per_group: int = 1,
) -> mx.array:
    """One launch of ``metal_kernels/attn_res_mix.metal``; same arguments and result as ``attn_res_mix``.

    ``kernel`` defaults to ``kimi_mlx.metal.kernel("attn_res_mix")`` (an error if kernels are not enabled).
    ``threads``: threads per row, a multiple of 32 (default: 32 per 256 elements of d, at most 256), capped at d
    rounded up to 32; ``rows_per_group``: rows per threadgroup, capped at B*T (the grid is ``(threads, B*T, 1)``).
    A threadgroup of more than ``kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP`` threads (512) or more than 32 KB of
    reduction buffer (``threadgroup_bytes``) is a ValueError.
    """
    _check_mix(blocks, block_inv_rms, partial, w_eff)
    if not len(blocks):
        raise ValueError("attn_res_mix_metal: needs at least one block snapshot (K >= 1)")
    if kernel is None:
        kernel = metal.kernel("attn_res_mix")
        if kernel is None:
            raise RuntimeError("attn_res_mix_metal: Metal kernels are not enabled (see kimi_mlx.metal.enabled)")
    if partial.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise ValueError(f"attn_res_mix_metal: partial has dtype {partial.dtype}, expected float32/float16/bfloat16")
    d = partial.shape[-1]
    threads = min(256, 32 * -(-d // 256)) if threads is None else threads
    setting = f"threads={threads}, rows_per_group={rows_per_group}"
    if threads < 32 or threads % 32 or rows_per_group < 1:
        raise ValueError(f"attn_res_mix_metal: threads must be a positive multiple of 32 and rows_per_group >= 1, got "
                         f"{setting}")  # fmt: skip
    raw = _as_stacked(blocks).astype(partial.dtype)
    K = raw.shape[0]
    N = partial.size // d
    # No more threads than elements of a row, nor rows than there are (more would only idle: MLX checks the
    # uncapped threadgroup).
    threads, rows = min(threads, 32 * -(-d // 32)), max(1, min(rows_per_group, N))
    hint = f"the reduction buffer takes 4 * rows_per_group * (K + 2) * threads / 32 bytes, K={K}"
    metal.check_threadgroup("attn_res_mix", setting, threads * rows, threadgroup_bytes(K, threads, rows), hint)
    rms = _as_stacked(block_inv_rms).astype(mx.float32).reshape(K, N)
    (out,) = kernel(
        inputs=[raw.reshape(K, N, d), rms, partial.reshape(N, d), w_eff.astype(mx.float32), float(eps)],
        template=[("InT", partial.dtype), ("K", K), ("D", d), ("THREADS", threads), ("ROWS", rows)],
        grid=(threads, N, 1),
        threadgroup=(threads, rows, 1),
        output_shapes=[(N, d)],
        output_dtypes=[partial.dtype],
    )
    return out.reshape(partial.shape)


def threadgroup_bytes(K: int, threads: int, rows: int) -> int:
    """Threadgroup memory of ``attn_res_mix.metal`` for K snapshots, ``threads`` per row and ``rows`` per
    threadgroup: the reduction buffer float red[rows][K + 2][threads / 32]."""
    return 4 * rows * (K + 2) * (threads // 32)


def attn_res_mix_scored(
    blocks: Blocks,
    block_inv_rms: Blocks,
    partial: mx.array,
    score: Callable[[mx.array], mx.array],
    eps: float,
) -> mx.array:
    """Same mix with the score computed by a callable on the RMS-normalised values ``[B, T, d] -> [B, T, 1]``
    (for a projection that must be called rather than read, e.g. a LoRA-wrapped one). Always pure MLX."""
    values = _as_list(blocks) + [partial]
    scales = _as_list(block_inv_rms) + [inv_rms(partial, eps)]
    return _combine(values, [score(v.astype(mx.float32) * r).astype(mx.float32) for v, r in zip(values, scales)])
