"""Chunked (WY/UT) KDA prefill as two Metal kernels per group of chunks (``metal_kernels/kda_chunked_*.metal``).

Same semantics, shapes and numerics as ``kimi_mlx.ops.kda_chunked.kda_chunked`` (see that module's docstring):

- q, k, g: ``[B, T, H, Dk]``; v: ``[B, T, H, Dv]``; beta: ``[B, T, H]``; q/k/v in float32, float16 or bfloat16.
- state: ``[B, H, Dv, Dk]`` float32 or None (zeros); mask: ``[B, T]`` bool or None (True = real token).
- Returns ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.

Split of the work, per group of chunks (``kda_chunked.group_tokens``: about ``GROUP_ELEMS`` elements per intra-chunk
buffer):

- ``kda_chunked_prep``: one threadgroup of ``prep_simdgroups`` SIMD-groups per chunk computes what does not depend on
  the carried state (the quantities of ``kda_chunked.intra_chunk``: ``[W; Q exp(G) - Aqk W]``, ``[U; Aqk U]``,
  ``K exp(G_C - G)``, ``exp(G_C)``) straight from the ``[B, T, H, D]`` inputs in their own dtype, with padding and
  masking (g = 0, beta = 0) applied in place. The chunk's rows are staged in threadgroup memory, ``BK`` channels of
  Dk at a time (``prep_slabs``; ``prep_threadgroup_bytes`` bytes), and each output element is written once. Every
  decay is a running product of ``exp(g <= 0)`` factors (never a difference of cumulative sums), safe at g = -1000.
- ``kda_chunked_scan``: the part that is sequential across chunks (``S`` carried from chunk to chunk and the outputs
  that read it) on 8x8 SIMD-group matrices, writing ``o`` straight into ``[B, T, H, Dv]`` in v's dtype (zeros at
  masked tokens) and the final state.

So a prompt costs two launches per group instead of one MLX step per chunk. Custom kernels have no VJP: the launch is
wrapped in ``kimi_mlx.metal.with_reference_vjp``, so gradients through the op are those of ``kda_chunked`` at the same
inputs and chunk size (the backward recomputes the pure forward; for training, ``kimi_mlx.metal.disabled()`` avoids
that recomputation).
"""

from __future__ import annotations

import mlx.core as mx

from .. import metal
from .kda_chunked import group_tokens, kda_chunked
from .kda_recurrent import prepare_scan

__all__ = ["PREP_KERNEL", "PREP_SIMDGROUPS", "SCAN_KERNEL", "kda_chunked_metal", "prep_slabs", "prep_threadgroup_bytes"]

PREP_KERNEL = "kda_chunked_prep"  # intra-chunk quantities, one threadgroup per chunk
SCAN_KERNEL = "kda_chunked_scan"  # the recurrence across chunks and the outputs
metal.register(PREP_KERNEL)
metal.register(SCAN_KERNEL)

_IO_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
PREP_SIMDGROUPS = 4  # SIMD-groups per prep threadgroup (rows of Aqk / Akk and 8x8 output tiles are spread over them)


def prep_threadgroup_bytes(C: int, BK: int) -> int:
    """Threadgroup memory of one prep threadgroup, in bytes: ``aqk``, ``akk_m``, ``lb`` (C rows of C + 4 floats each),
    ``bet`` (C floats) and the staged slab (q, k and alpha rows of BK + 4 floats: 3 C (BK + 4) floats). Rows are
    padded by 4 floats so that an 8x8 SIMD-group matrix load spreads over all 32 banks."""
    return 4 * (3 * C * (C + 4) + C + 3 * C * (BK + 4))


def prep_slabs(C: int, Dk: int, Dv: int, slab: int | None = None) -> tuple[int, int]:
    """``(BK, BV)``: channels of Dk per staged slab of the prep kernel (a multiple of 32 dividing Dk; by default the
    widest whose ``prep_threadgroup_bytes`` fit in ``MAX_THREADGROUP_MEMORY``, e.g. 128 at C = 16, Dk = 128, so the
    inputs are read once; 32 at C = 32) and channels of Dv per slab of v (a multiple of 32 dividing Dv, at most 3 BK:
    it reuses the q / k / alpha buffer). ``slab`` forces BK (ValueError if it is not a multiple of 32 dividing Dk)."""
    if slab is None:
        fits = [w for w in range(32, Dk + 1, 32) if Dk % w == 0]
        fits = [w for w in fits if prep_threadgroup_bytes(C, w) <= metal.MAX_THREADGROUP_MEMORY] or [32]
        BK = fits[-1]
    elif slab % 32 or slab <= 0 or Dk % slab:
        raise ValueError(f"kda_chunked_metal: prep_slab must be a multiple of 32 dividing Dk={Dk}, got {slab}")
    else:
        BK = slab
    BV = max(w for w in range(32, Dv + 1, 32) if Dv % w == 0 and w <= 3 * BK)
    return BK, BV


def _check(
    q: mx.array, k: mx.array, v: mx.array, chunk_size: int, simdgroups: int, prep_simdgroups: int, prep_slab: int | None
) -> tuple[int, int, int, int]:
    """Errors the kernels cannot handle, raised before any work (shapes themselves are checked by ``prepare_scan``);
    returns the scan's SIMD-groups per threadgroup (capped at the Dv / 8 tiles there are), the prep kernel's (capped
    at the C rows of a chunk) and its slabs ``(BK, BV)``."""
    Dk, Dv = q.shape[-1], v.shape[-1]
    if Dk % 32 or Dv % 32 or Dk == 0 or Dv == 0:
        raise ValueError(
            f"kda_chunked_metal: head dims must be positive multiples of 32 (the kernel works on 8x8 tiles), "
            f"got Dk={Dk} (q {q.shape}) and Dv={Dv} (v {v.shape})"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in _IO_DTYPES:
            raise ValueError(f"kda_chunked_metal: {name} dtype {x.dtype} not supported (float32, float16 or bfloat16)")
    if chunk_size not in (8, 16, 32):  # 8x8 tiles; the C x C matrices and a slab in threadgroup memory
        raise ValueError(f"kda_chunked_metal: chunk_size must be 8, 16 or 32, got {chunk_size}")
    for name, n in (("simdgroups", simdgroups), ("prep_simdgroups", prep_simdgroups)):
        if n < 1:
            raise ValueError(f"kda_chunked_metal: {name} (per threadgroup) must be >= 1, got {n}")
    sg = min(simdgroups, Dv // 8)  # more would only be idle threads (MLX checks the uncapped threadgroup)
    most = metal.MAX_THREADS_PER_THREADGROUP // 32
    metal.check_threadgroup(SCAN_KERNEL, f"simdgroups={simdgroups}", 32 * sg, hint=f"at most {most} SIMD-groups")
    prep_sg = min(prep_simdgroups, chunk_size)  # step 1 gives each SIMD-group whole rows of the chunk
    BK, BV = prep_slabs(chunk_size, Dk, Dv, prep_slab)
    metal.check_threadgroup(
        PREP_KERNEL, f"prep_simdgroups={prep_simdgroups}, prep_slab={BK}", 32 * prep_sg,
        prep_threadgroup_bytes(chunk_size, BK), hint=f"at most {most} SIMD-groups; a narrower prep_slab",
    )  # fmt: skip
    return sg, prep_sg, BK, BV


def kda_chunked_metal(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    chunk_size: int,
    simdgroups: int = 4,
    prep_simdgroups: int = PREP_SIMDGROUPS,
    prep_slab: int | None = None,
) -> tuple[mx.array, mx.array]:
    """Chunked KDA on two Metal kernels per group of chunks (intra-chunk prep, inter-chunk scan); falls back to
    ``kda_chunked`` when kernels are not enabled (``kimi_mlx.metal.enabled()``).

    Args:
        q, k, g, v, beta, state, mask: as ``kda_chunked`` (Dk and Dv multiples of 32).
        chunk_size: tokens per chunk, 8, 16 or 32; T need not be a multiple.
        simdgroups: SIMD-groups per threadgroup of the scan, each one 8-column tile of Dv; need not divide Dv / 8;
            more than Dv / 8 are capped to it; more than ``MAX_THREADS_PER_THREADGROUP / 32`` (16) is a ValueError.
        prep_simdgroups: SIMD-groups per threadgroup of the prep kernel; more than C are capped to C, more than 16 is
            a ValueError.
        prep_slab: channels of Dk the prep kernel stages at a time (``prep_slabs``; default: the widest that fits).

    Returns:
        ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.
    """
    C = int(chunk_size)
    launch_sizes = _check(q, k, v, C, simdgroups, prep_simdgroups, prep_slab)
    prep, scan = metal.kernel(PREP_KERNEL), metal.kernel(SCAN_KERNEL)
    if scan is None:
        return kda_chunked(q, k, v, g, beta, state=state, mask=mask, chunk_size=C)
    # Validation, zero default state, bool mask (the float32 copies of q/k/v it also returns are never evaluated).
    state, mask = prepare_scan(q, k, v, g, beta, state, mask)[5:]
    B, T, H, _ = q.shape
    if T == 0:
        return mx.zeros((B, 0, H, v.shape[-1]), dtype=v.dtype), state

    def launch(q, k, v, g, beta, state):
        return _launch(prep, scan, q, k, v, g, beta, state, mask, C, *launch_sizes)

    def pure(q, k, v, g, beta, state):
        return kda_chunked(q, k, v, g, beta, state=state, mask=mask, chunk_size=C)

    # Kernels have no VJP of their own: the gradient is the pure path's, taken at the same inputs (its forward is
    # recomputed in the backward pass), so training through this op is correct, just not accelerated.
    return metal.with_reference_vjp(launch, pure)(q, k, v, g, beta, state)


def _launch(
    prep, scan, q, k, v, g, beta, state, mask, C: int, simdgroups: int, prep_sg: int, BK: int, BV: int
) -> tuple[mx.array, mx.array]:
    """Prep + scan launches per group of chunks. Arguments validated by ``kda_chunked_metal`` (``_check``'s launch
    sizes); state float32, mask ``[B, T]`` bool or None, T > 0."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    # Row-contiguous once here; a strided view (e.g. a slice of a fused qkv projection) would otherwise be copied by
    # every prep launch.
    q, k, v = (mx.contiguous(x) for x in (q, k, v))
    g, beta = (mx.contiguous(x.astype(mx.float32)) for x in (g, beta))
    if mask is None:
        mask = mx.ones((B, T), dtype=mx.bool_)
    # Tokens per pair of launches (a multiple of C): bounds the intra-chunk buffers like the pure path does.
    per_group = group_tokens(B, H, Dk, Dv, C)
    prep_template = [("QT", q.dtype), ("KT", k.dtype), ("VT", v.dtype), ("C", C), ("Dk", Dk), ("Dv", Dv), ("H", H),
                     ("SG", prep_sg), ("BK", BK), ("BV", BV)]  # fmt: skip
    scan_template = [("OutT", v.dtype), ("C", C), ("Dk", Dk), ("Dv", Dv), ("H", H)]
    outs = []
    for t0 in range(0, T, per_group):
        t1 = min(T, t0 + per_group)
        N = -(-(t1 - t0) // C)
        ins = [q, k, v, g, beta]
        if t0:
            # Build this group's intra-chunk tensors only after the previous scan (peak memory ~ one group).
            ins = mx.depends(ins, [state])
        wq, uo, kg, decay = prep(
            inputs=[*ins, mask, T, t0, t1],
            template=prep_template,
            grid=(32 * prep_sg, N, B * H),
            threadgroup=(32 * prep_sg, 1, 1),
            output_shapes=[(N, B, H, 2 * C, Dk), (N, B, H, 2 * C, Dv), (N, B, H, C, Dk), (N, B, H, Dk)],
            output_dtypes=[mx.float32] * 4,
        )
        o, state = scan(
            inputs=[wq, uo, kg, decay, state, mask[:, t0:t1], t1 - t0],
            template=scan_template,
            grid=(32, Dv // 8, B * H),
            threadgroup=(32, simdgroups, 1),
            output_shapes=[(B, t1 - t0, H, Dv), (B, H, Dv, Dk)],
            output_dtypes=[v.dtype, mx.float32],
        )
        outs.append(o)
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return o, state
