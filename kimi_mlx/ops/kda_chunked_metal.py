"""Chunked (WY/UT) KDA prefill with the inter-chunk scan in one Metal kernel (``metal_kernels/kda_chunked_scan.metal``).

Same semantics, shapes and numerics as ``kimi_mlx.ops.kda.kda_chunked`` (see that module's docstring):

- q, k, g: ``[B, T, H, Dk]``; v: ``[B, T, H, Dv]``; beta: ``[B, T, H]``; q/k/v in float32, float16 or bfloat16.
- state: ``[B, H, Dv, Dk]`` float32 or None (zeros); mask: ``[B, T]`` bool or None (True = real token).
- Returns ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.

Split of the work: the intra-chunk quantities (hierarchical cumulative-product decays, the unit-lower-triangular
inverse, ``[W; Q exp(G) - Aqk W]``, ``[U; Aqk U]``, ``K exp(G_C - G)``, ``exp(G_C)``) do not depend on the carried
state and are computed for all chunks at once by the pure-MLX ``_intra_chunk`` (so every decay is a product of
``exp(g <= 0)`` terms, safe at g = -1000). The part that is sequential across chunks (``S`` carried from chunk to
chunk and the outputs that read it) runs in a single kernel launch per group of chunks instead of one MLX step per
chunk. The kernel writes the outputs straight into ``[B, T, H, Dv]`` in the output dtype, zeros at masked tokens.

No VJP (custom kernels have none): training uses the pure path (``kimi_mlx.metal.disabled()``).
"""

from __future__ import annotations

import mlx.core as mx

from .. import metal
from . import kda as _kda

__all__ = ["KERNEL_NAME", "kda_chunked_metal"]

KERNEL_NAME = "kda_chunked_scan"
metal.register(KERNEL_NAME)

_OUT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _check(q: mx.array, v: mx.array, chunk_size: int, simdgroups: int) -> None:
    """Errors the kernel cannot handle, raised before any work (shapes themselves are checked by ``_prepare``)."""
    Dk, Dv = q.shape[-1], v.shape[-1]
    if Dk % 32 or Dv % 32 or Dk == 0 or Dv == 0:
        raise ValueError(
            f"kda_chunked_metal: head dims must be positive multiples of 32 (the kernel works on 8x8 tiles), "
            f"got Dk={Dk} (q {q.shape}) and Dv={Dv} (v {v.shape})"
        )
    if v.dtype not in _OUT_DTYPES:
        raise ValueError(f"kda_chunked_metal: v dtype {v.dtype} not supported (float32, float16 or bfloat16)")
    if chunk_size not in (8, 16, 32, 64):
        raise ValueError(f"kda_chunked_metal: chunk_size must be 8, 16, 32 or 64, got {chunk_size}")
    if not 1 <= simdgroups <= 32:
        raise ValueError(f"kda_chunked_metal: simdgroups (per threadgroup) must be in [1, 32], got {simdgroups}")


def _to_chunks(x: mx.array, n_chunks: int, chunk_size: int) -> mx.array:
    """``[B, N*C, H, D]`` -> ``[N * B * H, C, D]``, chunk-major (the layout ``_intra_chunk`` and the kernel use)."""
    B, _, H, D = x.shape
    return x.reshape(B, n_chunks, chunk_size, H, D).transpose(1, 0, 3, 2, 4).reshape(n_chunks * B * H, chunk_size, D)


def kda_chunked_metal(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    chunk_size: int = _kda.DEFAULT_CHUNK_SIZE,
    simdgroups: int = 4,
) -> tuple[mx.array, mx.array]:
    """Chunked KDA with the inter-chunk recurrence in a Metal kernel; falls back to ``kda_chunked`` when kernels are
    not enabled (``kimi_mlx.metal.enabled()``).

    Args:
        q, k, g, v, beta, state, mask: as ``kda_chunked`` (Dk and Dv multiples of 32).
        chunk_size: tokens per chunk, 8, 16, 32 or 64; T need not be a multiple.
        simdgroups: SIMD-groups per threadgroup, each one 8-column tile of Dv; need not divide Dv / 8.

    Returns:
        ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.
    """
    C = int(chunk_size)
    _check(q, v, C, simdgroups)
    kernel = metal.kernel(KERNEL_NAME)
    if kernel is None:
        return _kda.kda_chunked(q, k, v, g, beta, state=state, mask=mask, chunk_size=C)
    out_dtype = v.dtype
    q, k, v, g, beta, state, mask = _kda._prepare(q, k, v, g, beta, state, mask)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if T == 0:
        return mx.zeros((B, 0, H, Dv), dtype=out_dtype), state
    g, beta = _kda._mask_gates(g, beta, mask)
    if mask is None:
        mask = mx.ones((B, T), dtype=mx.bool_)
    # Tokens per kernel launch (a multiple of C): bounds the intra-chunk buffers like the pure path does.
    per_group = max(1, _kda.GROUP_ELEMS // (B * H * max(Dk, Dv) * C)) * C
    template = [("OutT", out_dtype), ("C", C), ("Dk", Dk), ("Dv", Dv), ("H", H)]
    outs = []
    for t0 in range(0, T, per_group):
        t1 = min(T, t0 + per_group)
        Tg = t1 - t0
        N = -(-Tg // C)
        pad = [(0, 0), (0, N * C - Tg)]
        # Padded tail steps are identities (g = 0, beta = 0, zero q/k/v); the kernel does not write their outputs.
        qg, kg, vg, gg = (mx.pad(x[:, t0:t1], pad + [(0, 0), (0, 0)]) for x in (q, k, v, g))
        bg = mx.pad(beta[:, t0:t1], pad + [(0, 0)])
        if t0:
            # Build this group's intra-chunk tensors only after the previous launch (peak memory ~ one group).
            qg, kg, vg, gg, bg = mx.depends([qg, kg, vg, gg, bg], [state])
        wq, uo, kgm, decay = _kda._intra_chunk(
            *(_to_chunks(x, N, C) for x in (qg, kg, vg, gg)), _to_chunks(bg[..., None], N, C)[..., 0]
        )
        o, state = kernel(
            inputs=[wq, uo, kgm, decay, state, mask[:, t0:t1], Tg],
            template=template,
            grid=(32, Dv // 8, B * H),
            threadgroup=(32, simdgroups, 1),
            output_shapes=[(B, Tg, H, Dv), (B, H, Dv, Dk)],
            output_dtypes=[out_dtype, mx.float32],
        )
        outs.append(o)
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return o, state
