"""Kimi Delta Attention (KDA) scan in pure MLX (spec §1.3, §1.4), differentiable.

The model calls ``kda_gated`` (raw projections in: it normalises q/k, computes beta and the decay gate, then scans);
on a Metal GPU that is one launch of ``metal_kernels/kda_recurrent.metal`` for short inputs, elsewhere the pure-MLX
functions below (``kda_forward`` picks recurrent or chunked).

Conventions shared by every function here (``B`` batch, ``T`` tokens, ``H`` heads):

- ``q``, ``k``: ``[B, T, H, Dk]``, already L2-normalised; ``q`` already carries the ``Dk**-0.5`` scale. Any float dtype.
- ``v``: ``[B, T, H, Dv]``.
- ``g``: ``[B, T, H, Dk]`` per-channel log-decay (``<= 0``; per-step values down to about -1000 are fine).
- ``beta``: ``[B, T, H]`` in ``(0, 1)``.
- ``state``: ``[B, H, Dv, Dk]`` float32 (mlx-lm / ``mx.fast.gated_delta_update`` orientation, i.e. the transpose of
  fla's ``S[K, V]``); ``None`` means zeros.
- ``mask``: optional ``[B, T]`` bool, True = real token. A masked step leaves the state untouched and writes a zero
  output (any positions, e.g. left padding of a ragged batch).
- Returns ``(o, final_state)``: ``o`` is ``[B, T, H, Dv]`` in ``v.dtype``; ``final_state`` is ``[B, H, Dv, Dk]``
  float32. All internal math is float32.

Recurrence per head, fla orientation ``S[Dk, Dv]``::

    S' = diag(exp(g_t)) S
    S  = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S^T q_t

Chunked form (``kda_chunked``), per chunk of C tokens with chunk-local cumulative log-decay ``G``::

    Akk[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)    j < i
    Aqk[i, j] =        sum_c q_ic k_jc exp(G_ic - G_jc)    j <= i
    L^-1 = (I + Akk)^-1,  W = L^-1 (beta * exp(G) * K),  U = L^-1 (beta * V)
    V_new = U - W S;  O = (Q * exp(G)) S + Aqk V_new;  S <- diag(exp(G_C)) S + (K * exp(G_C - G))^T V_new

Numerics. The pairwise decays ``exp(G_i - G_j)`` are never formed as ``exp(G_i) * exp(-G_j)`` over a long span, and
never as a difference of two large cumulative sums either. Instead the strictly-lower C x C matrix is split
hierarchically (like fla's secondary chunking, carried all the way down): at level ``s`` every aligned block of
``2s`` tokens contributes its bottom-left ``s x s`` block, computed as a matmul anchored at the last token ``n`` of
the first half::

    exp(G_i - G_j) = exp(sum_{n < t <= i} g_t) * exp(sum_{j < t <= n} g_t)     (both exponents <= 0)

Each factor is a segmented product of ``alpha = exp(g)`` inside the block (``mx.cumprod``: inclusive prefix over the
second half, exclusive suffix over the first half), so it cannot overflow, needs one ``exp`` per element, and does
not suffer the cancellation of ``G_i - G_j`` when a -1000 step sits earlier in the chunk. The diagonal is
``q_i . k_i`` (Aqk) / 0 (Akk). The unit-lower-triangular inverse uses the same block levels
(``[[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]``), i.e. blocked forward substitution with matmuls,
so everything is plain differentiable MLX ops (``mx.linalg.tri_inv`` / ``solve_triangular`` have no VJP in MLX 0.32)
and no exponent anywhere is positive, so gradients stay finite too (exp(-1000) = 0 just gives zero gradient).

Cost: O(T C Dk) for the intra-chunk matrices, O(T Dk Dv) matmuls, and a sequential loop over ``T / C`` chunks.
Peak memory is a few ``[T, H, D]``-sized float32 buffers (no ``[C, C, Dk]`` pairwise tensor); the intra-chunk part
runs in groups of chunks and is recomputed (``mx.checkpoint``) in the backward pass.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from .. import metal

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "RECURRENT_KERNEL_MAX_T",
    "RECURRENT_MAX_T",
    "SHORT_CHUNK_T",
    "kda_chunked",
    "kda_decay",
    "kda_forward",
    "kda_gated",
    "kda_recurrent",
    "kda_recurrent_metal",
    "l2_normalize",
]  # fmt: skip

# Chosen by measurement on the CPU backend (bench/bench_kda.py, B=1, H=32, Dk=Dv=128, 2-core x86, MLX 0.32.4):
# recurrent ~1.2 ms/token; chunked C=8 is already faster from T ~ 4 (less padding waste for short inputs),
# C=8 and C=16 are within noise of each other for long inputs (C=16 has half the sequential steps, slightly faster
# gradients), C=32/64 are slower (intra-chunk work grows with C while the netlib sgemm does not speed up).
RECURRENT_MAX_T = 4
SHORT_CHUNK_T = 32  # kda_forward uses chunk size 8 below this many tokens, DEFAULT_CHUNK_SIZE from here on
DEFAULT_CHUNK_SIZE = 16
# Elements per [tokens, B*H, D] buffer processed at once by the chunked path (2M floats = 8 MB).
GROUP_ELEMS = 1 << 21


def _prepare(q, k, v, g, beta, state, mask):
    """Validate shapes, cast everything to float32, default the state to zeros, validate the mask."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q/k/g shapes differ: {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"bad v/beta shapes {v.shape}, {beta.shape} for q {q.shape}")
    if state is None:
        state = mx.zeros((B, H, Dv, Dk), dtype=mx.float32)
    elif state.shape != (B, H, Dv, Dk):
        raise ValueError(f"state shape {state.shape} != {(B, H, Dv, Dk)}")
    if mask is not None:
        if mask.shape != (B, T):
            raise ValueError(f"mask shape {mask.shape} != {(B, T)}")
        mask = mask.astype(mx.bool_)
    q, k, v, g, beta, state = (x.astype(mx.float32) for x in (q, k, v, g, beta, state))
    return q, k, v, g, beta, state, mask


def _mask_gates(g, beta, mask):
    """Masked steps get g = 0 and beta = 0: an exact identity on the state (exp(0) = 1, update scaled by 0)."""
    if mask is None:
        return g, beta
    return mx.where(mask[:, :, None, None], g, 0.0), mx.where(mask[:, :, None], beta, 0.0)


def _finish(o, mask, out_dtype):
    if mask is not None:
        o = mx.where(mask[:, :, None, None], o, 0.0)
    return o.astype(out_dtype)


# --------------------------------------------------------------------------------------------------------------------
# Recurrent (token-by-token) path


# Steps per compiled block. Each block returns its stacked outputs, so at most one state per block (plus the K
# inside the block being evaluated) is alive at a time; one compiled call per step would keep all T states alive.
RECURRENT_BLOCK = 16


@mx.compile
def _recurrent_block(q, k, v, g, beta, state):
    """K = q.shape[1] steps. q, k, g: [B, K, H, Dk]; v: [B, K, H, Dv]; beta: [B, K, H]; state: [B, H, Dv, Dk]."""
    alpha = mx.exp(g)
    outs = []
    for t in range(q.shape[1]):
        k_t = k[:, t, :, None, :]
        state = state * alpha[:, t, :, None, :]
        kv = (state * k_t).sum(axis=-1)
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        state = state + delta[..., None] * k_t
        outs.append((state * q[:, t, :, None, :]).sum(axis=-1))
    return mx.stack(outs, axis=1), state


def kda_recurrent(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Token-by-token KDA scan (reference semantics of fla's ``naive_recurrent_kda``; best for decode / tiny T).

    Args:
        q, k: ``[B, T, H, Dk]`` L2-normalised (q pre-scaled by ``Dk**-0.5``), any float dtype.
        v: ``[B, T, H, Dv]``.
        g: ``[B, T, H, Dk]`` per-channel log-decay (<= 0).
        beta: ``[B, T, H]`` in (0, 1).
        state: ``[B, H, Dv, Dk]`` float32 initial state (mlx-lm orientation), or None for zeros.
        mask: optional ``[B, T]`` bool, True = real token; masked steps keep the state and output zeros.

    Returns:
        ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state, mask = _prepare(q, k, v, g, beta, state, mask)
    g, beta = _mask_gates(g, beta, mask)
    T = q.shape[1]
    if T == 0:
        return mx.zeros(v.shape, dtype=out_dtype), state
    outs = []
    for t0 in range(0, T, RECURRENT_BLOCK):
        sl = slice(t0, min(T, t0 + RECURRENT_BLOCK))
        if outs:
            # Make the next block wait for this block's outputs, so that their inputs (the per-step states) are
            # released early; otherwise the scheduler may run the whole state chain first and keep every state alive.
            state = mx.depends(state, outs[-1])
        o_blk, state = _recurrent_block(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state)
        outs.append(o_blk)
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return _finish(o, mask, out_dtype), state


# --------------------------------------------------------------------------------------------------------------------
# Chunked (WY / UT) path


def _intra_chunk(q, k, v, g, beta):
    """Everything that does not depend on the carried state, batched over all chunks.

    q, k, g: [M, C, Dk]; v: [M, C, Dv]; beta: [M, C]  (M = chunks * B * H, chunk-major).
    Returns (WQ [M, 2C, Dk] = [W; Q*exp(G) - Aqk W], UO [M, 2C, Dv] = [U; Aqk U], Kg [M, C, Dk], decay [M, Dk]).
    """
    M, C, Dk = q.shape

    # Decay factors are products of alpha = exp(g) (one exp per element; no exponent is ever positive and no large
    # cumulative sums are subtracted, so there is no overflow and no cancellation after a -1000 step).
    alpha = mx.exp(g)

    # Diagonal (level "size 1"): Aqk[i, i] = q_i . k_i, Akk[i, i] = 0; L^-1 diagonal blocks are 1.
    aqk = (q * k).sum(axis=-1).reshape(M, C, 1, 1)
    linv = mx.ones((M, C, 1, 1), dtype=mx.float32)
    s = 1
    while s < C:
        # Bottom-left s x s block of every aligned 2s block, anchored at the last token n of the first half:
        #   exp(G_i - G_j) = prod_{n < t <= i} alpha_t  *  prod_{j < t <= n} alpha_t
        # (inclusive prefix product over the second half, exclusive suffix product over the first half).
        P = C // (2 * s)
        ah = alpha.reshape(M, P, 2, s, Dk)
        kh = k.reshape(M, P, 2, s, Dk)
        qh = q.reshape(M, P, 2, s, Dk)
        if s == 1:
            e_row = ah[:, :, 1]
            kc = kh[:, :, 0]
        else:
            e_row = mx.cumprod(ah[:, :, 1], axis=-2)
            kc = kh[:, :, 0] * mx.cumprod(ah[:, :, 0], axis=-2, reverse=True, inclusive=False)
        qr = qh[:, :, 1] * e_row
        kr = kh[:, :, 1] * (e_row * beta.reshape(M, P, 2, s)[:, :, 1, :, None])  # beta-scaled rows of Akk
        if s <= 2:
            off_qk = (qr[..., :, None, :] * kc[..., None, :, :]).sum(axis=-1)
            off_kk = (kr[..., :, None, :] * kc[..., None, :, :]).sum(axis=-1)
        else:
            kct = kc.swapaxes(-1, -2)
            off_qk, off_kk = qr @ kct, kr @ kct  # [M, P, s, s]

        # Assemble Aqk at size 2s: [[top, 0], [off_qk, bottom]].
        a = aqk.reshape(M, P, 2, s, s)
        z = mx.zeros((M, P, s, s), dtype=mx.float32)
        aqk = mx.concatenate(
            [mx.concatenate([a[:, :, 0], z], axis=-1), mx.concatenate([off_qk, a[:, :, 1]], axis=-1)], axis=-2
        )
        # Blocked forward substitution: [[A, 0], [X, D]]^-1 = [[A^-1, 0], [-D^-1 X A^-1, D^-1]].
        li = linv.reshape(M, P, 2, s, s)
        ainv, dinv = li[:, :, 0], li[:, :, 1]
        if s == 1:
            x = -(dinv * off_kk * ainv)
        else:
            x = -(dinv @ off_kk @ ainv)
        linv = mx.concatenate([mx.concatenate([ainv, z], axis=-1), mx.concatenate([x, dinv], axis=-1)], axis=-2)
        s *= 2
    aqk = aqk.reshape(M, C, C)
    linv = linv.reshape(M, C, C)

    gam = mx.cumprod(alpha, axis=1)  # exp(G_i), chunk-local inclusive
    kg = k * mx.cumprod(alpha, axis=1, reverse=True, inclusive=False)  # k_j * exp(G_C - G_j)
    decay = gam[:, -1]
    # [L^-1 diag(beta); Aqk L^-1 diag(beta)] applied to (K * Gamma) and V gives [W; Aqk W] and [U; Aqk U].
    lb = linv * beta[:, None, :]
    lstack = mx.concatenate([lb, aqk @ lb], axis=1)  # [M, 2C, C]
    x = lstack @ (k * gam)
    uo = lstack @ v
    wq = mx.concatenate([x[:, :C], q * gam - x[:, C:]], axis=1)
    return wq, uo, kg, decay


# Under mx.grad, recompute the intra-chunk tensors in the backward pass instead of storing them.
_intra_chunk_ckpt = mx.checkpoint(_intra_chunk)


@mx.compile
def _chunk_step(S, wq, uo, kg, decay):
    """S: [B, H, Dk, Dv] (fla orientation); wq: [B, H, 2C, Dk]; uo: [B, H, 2C, Dv]; kg: [B, H, C, Dk]."""
    C = kg.shape[-2]
    ws = wq @ S
    vnew = uo[..., :C, :] - ws[..., :C, :]
    o = uo[..., C:, :] + ws[..., C:, :]
    S = decay[..., :, None] * S + kg.swapaxes(-1, -2) @ vnew
    return o, S


def kda_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[mx.array, mx.array]:
    """Chunked (WY/UT) KDA: matmuls inside chunks, sequential only across chunks. Same semantics as ``kda_recurrent``.

    Args:
        q, k: ``[B, T, H, Dk]`` L2-normalised (q pre-scaled by ``Dk**-0.5``), any float dtype.
        v: ``[B, T, H, Dv]``.
        g: ``[B, T, H, Dk]`` per-channel log-decay (<= 0; values down to ~-1000 per step are safe).
        beta: ``[B, T, H]`` in (0, 1).
        state: ``[B, H, Dv, Dk]`` float32 initial state (mlx-lm orientation), or None for zeros.
        mask: optional ``[B, T]`` bool, True = real token; masked steps keep the state and output zeros.
        chunk_size: tokens per chunk, a power of two. T need not be a multiple (the tail is padded with identity
            steps).

    Returns:
        ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.

    Work is done in groups of chunks (about ``GROUP_ELEMS`` elements per ``[tokens, H, D]`` buffer) so that peak
    memory stays a few times the input size and buffers stay small enough to be recycled by the allocator.
    """
    C = int(chunk_size)
    if C < 1 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    out_dtype = v.dtype
    q, k, v, g, beta, state, mask = _prepare(q, k, v, g, beta, state, mask)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if T == 0:
        return mx.zeros((B, 0, H, Dv), dtype=out_dtype), state
    per_group = max(1, GROUP_ELEMS // (B * H * max(Dk, Dv) * C)) * C  # tokens per group, multiple of C

    S = state.swapaxes(-1, -2)  # [B, H, Dk, Dv] (fla orientation)
    outs = []
    for t0 in range(0, T, per_group):
        t1 = min(T, t0 + per_group)
        qg, kg_, vg, gg, bg = (x[:, t0:t1] for x in (q, k, v, g, beta))
        if t0:
            # Schedule this group's intra-chunk work after the previous group's scan: peak memory ~ one group.
            qg, kg_, vg, gg, bg = mx.depends([qg, kg_, vg, gg, bg], [S])
        gg, bg = _mask_gates(gg, bg, None if mask is None else mask[:, t0:t1])
        Tg = t1 - t0
        N = -(-Tg // C)
        pad = N * C - Tg
        if pad:
            # Identity steps: g = 0 (no decay), beta = 0 (no update), zero q/k/v; their outputs are dropped.
            def padt(x):
                return mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

            qg, kg_, vg, gg, bg = (padt(x) for x in (qg, kg_, vg, gg, bg))

        def to_chunks(x):  # [B, N*C, H, D] -> [N * B * H, C, D], chunk-major
            D = x.shape[-1]
            return x.reshape(B, N, C, H, D).transpose(1, 0, 3, 2, 4).reshape(N * B * H, C, D)

        wq, uo, kgm, decay = _intra_chunk_ckpt(
            to_chunks(qg), to_chunks(kg_), to_chunks(vg), to_chunks(gg), to_chunks(bg[..., None])[..., 0]
        )
        wq = wq.reshape(N, B, H, 2 * C, Dk)
        uo = uo.reshape(N, B, H, 2 * C, Dv)
        kgm = kgm.reshape(N, B, H, C, Dk)
        decay = decay.reshape(N, B, H, Dk)
        gouts = []
        for n in range(N):
            if gouts:
                S = mx.depends(S, gouts[-1])  # compute each chunk's output before moving on (bounded memory)
            o_n, S = _chunk_step(S, wq[n], uo[n], kgm[n], decay[n])
            gouts.append(o_n)
        o = mx.stack(gouts, axis=0)  # [N, B, H, C, Dv]
        o = o.transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, Dv)
        outs.append(o[:, :Tg] if pad else o)
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return _finish(o, mask, out_dtype), S.swapaxes(-1, -2)


def kda_forward(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """KDA scan entry point used by the model: recurrent for ``T <= RECURRENT_MAX_T`` (decode), chunked otherwise
    (chunk size 8 below ``SHORT_CHUNK_T`` tokens, ``DEFAULT_CHUNK_SIZE`` above).

    When Metal kernels are enabled (``kimi_mlx.metal.enabled()``) and Dk, Dv are multiples of 32, the chunked path
    runs its inter-chunk scan in one kernel launch per group of chunks (``kda_chunked_metal``).
    Shapes/dtypes as in the module docstring: q, k ``[B, T, H, Dk]``; v ``[B, T, H, Dv]``; g ``[B, T, H, Dk]``;
    beta ``[B, T, H]``; state ``[B, H, Dv, Dk]`` float32 or None; mask ``[B, T]`` bool or None.
    Returns ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.
    """
    T = q.shape[1]
    if T <= RECURRENT_MAX_T:
        return kda_recurrent(q, k, v, g, beta, state=state, mask=mask)
    chunk_size = 8 if T < SHORT_CHUNK_T else DEFAULT_CHUNK_SIZE
    if metal.enabled() and q.shape[-1] % 32 == 0 and v.shape[-1] % 32 == 0:
        from .kda_chunked_metal import kda_chunked_metal  # imports this module, so bound at call time

        # Gradients (training) come from the pure chunked path: kda_chunked_metal wraps its launches in
        # metal.with_reference_vjp.
        return kda_chunked_metal(q, k, v, g, beta, state=state, mask=mask, chunk_size=chunk_size)
    return kda_chunked(q, k, v, g, beta, state=state, mask=mask, chunk_size=chunk_size)


# --------------------------------------------------------------------------------------------------------------------
# Gated entry point: raw projections in, decode prologue (normalisation, gates) fused into the Metal kernel


# On a Metal GPU, kda_gated runs the fused recurrent kernel up to this many tokens (one launch, T sequential steps
# inside); longer inputs take kda_forward. Not tuned on hardware yet: bench/kernels.py times both sides.
RECURRENT_KERNEL_MAX_T = 64

metal.register("kda_recurrent")
_KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def l2_normalize(x: mx.array, eps: float) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (fla's eps-inside-sqrt convention)."""
    x = x.astype(mx.float32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def kda_decay(f: mx.array, A_log: mx.array, dt_bias: mx.array, lower_bound: float | None) -> mx.array:
    """Per-channel log-decay from the raw f_b(f_a(x)) projection f: [B, T, H, D] -> [B, T, H, D] float32.

    Kimi Linear: g = -exp(A_log[h]) * softplus(f + dt_bias).
    K3 (``lower_bound`` lb < 0): g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)) (replaces softplus; not a clamp).
    A_log: [H]; dt_bias: [H*D].
    """
    H, D = f.shape[-2:]
    z = f.astype(mx.float32) + dt_bias.astype(mx.float32).reshape(H, D)
    rate = mx.exp(A_log.astype(mx.float32))[:, None]
    if lower_bound is None:
        return -rate * nn.softplus(z)
    return lower_bound * mx.sigmoid(rate * z)


def _check_gated(q, k, v, f, b, A_log, dt_bias, state, mask):
    """Shape checks shared by both paths of kda_gated (errors name the argument and the expected shape)."""
    if q.ndim != 4:
        raise ValueError(f"kda_gated: q must be [B, T, H, Dk], got shape {q.shape}")
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    expected = {
        "k": (k, (B, T, H, Dk)), "v": (v, (B, T, H, Dv)), "f": (f, (B, T, H, Dk)), "b": (b, (B, T, H)),
        "A_log": (A_log, (H,)), "dt_bias": (dt_bias, (H * Dk,)),
    }  # fmt: skip
    if state is not None:
        expected["state"] = (state, (B, H, Dv, Dk))
    if mask is not None:
        expected["mask"] = (mask, (B, T))
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"kda_gated: {name} has shape {tuple(x.shape)}, expected {shape}")


def kda_gated(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    f: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    *,
    lower_bound: float | None,
    l2_eps: float,
    state: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """KDA from the raw projections: normalise q/k, compute the gates, run the scan. The model's one entry point.

    Args:
        q, k: ``[B, T, H, Dk]`` raw (post short-conv), not normalised; v: ``[B, T, H, Dv]``. Any float dtype.
        f: ``[B, T, H, Dk]`` raw decay projection; b: ``[B, T, H]`` beta logits.
        A_log: ``[H]``; dt_bias: ``[H * Dk]``; lower_bound: None (softplus gate) or K3's lb < 0 (see ``kda_decay``).
        l2_eps: eps inside the sqrt of the q/k L2 norm; q is then scaled by ``Dk**-0.5``.
        state: ``[B, H, Dv, Dk]`` float32 or None (zeros); mask: ``[B, T]`` bool (True = real token) or None.

    Returns:
        ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.

    On a Metal GPU (``kimi_mlx.metal.enabled()``), ``T <= RECURRENT_KERNEL_MAX_T`` and Dk, Dv multiples of 32, this
    is one launch of ``kda_recurrent_metal``; otherwise the pure-MLX prologue and ``kda_forward``.
    """
    _check_gated(q, k, v, f, b, A_log, dt_bias, state, mask)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    kern = metal.kernel("kda_recurrent")
    if kern is None or not 0 < T <= RECURRENT_KERNEL_MAX_T or Dk % 32 or Dv % 32:
        return _kda_gated_pure(q, k, v, f, b, A_log, dt_bias, state, lower_bound=lower_bound, l2_eps=l2_eps, mask=mask)
    if state is None:
        state = mx.zeros((B, H, Dv, Dk), dtype=mx.float32)
    gates = {"lower_bound": lower_bound, "l2_eps": l2_eps, "mask": mask}

    def launch(*arrays):
        return kda_recurrent_metal(*arrays[:7], state=arrays[7], kernel=kern, **gates)

    # Gradients (training) come from the pure-MLX path: custom kernels have no VJP.
    op = metal.with_reference_vjp(launch, lambda *arrays: _kda_gated_pure(*arrays, **gates))
    return op(q, k, v, f, b, A_log, dt_bias, state)


def _kda_gated_pure(q, k, v, f, b, A_log, dt_bias, state, *, lower_bound, l2_eps, mask):
    """The pure-MLX path of ``kda_gated`` (same arguments, state positional)."""
    qn = l2_normalize(q, l2_eps) * (q.shape[-1] ** -0.5)
    kn = l2_normalize(k, l2_eps)
    g = kda_decay(f, A_log, dt_bias, lower_bound)
    beta = mx.sigmoid(b.astype(mx.float32))
    return kda_forward(qn, kn, v, g, beta, state=state, mask=mask)


def kda_recurrent_metal(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    f: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    *,
    lower_bound: float | None,
    l2_eps: float,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    kernel=None,
    rows_per_group: int = 4,
) -> tuple[mx.array, mx.array]:
    """One launch of ``metal_kernels/kda_recurrent.metal``; same arguments and result as ``kda_gated``.

    ``kernel`` defaults to ``kimi_mlx.metal.kernel("kda_recurrent")`` (an error if kernels are not enabled).
    ``rows_per_group``: state rows (SIMD-groups) per threadgroup; the grid is ``(32, Dv, B*H)``; more than
    ``kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP / 32`` (16) is a ValueError. Dk and Dv must be multiples of 32.
    """
    _check_gated(q, k, v, f, b, A_log, dt_bias, state, mask)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if Dk % 32 or Dv % 32:
        raise ValueError(f"kda_recurrent Metal kernel: Dk and Dv must be multiples of 32, got Dk={Dk}, Dv={Dv}")
    if rows_per_group < 1:
        raise ValueError(f"kda_recurrent Metal kernel: rows_per_group must be >= 1, got {rows_per_group}")
    most = metal.MAX_THREADS_PER_THREADGROUP // 32  # 16: fewer than the Dv rows of any grid, nothing to cap
    metal.check_threadgroup("kda_recurrent", f"rows_per_group={rows_per_group}", 32 * rows_per_group,
                            hint=f"at most {most} rows")  # fmt: skip
    for name, x in (("q", q), ("k", k), ("v", v), ("f", f), ("b", b)):
        if x.dtype not in _KERNEL_DTYPES:
            raise ValueError(
                f"kda_recurrent Metal kernel: {name} has dtype {x.dtype}, expected float32/float16/bfloat16"
            )
    if kernel is None:
        kernel = metal.kernel("kda_recurrent")
        if kernel is None:
            raise RuntimeError("kda_recurrent_metal: Metal kernels are not enabled (see kimi_mlx.metal.enabled)")
    out_dtype = v.dtype
    # q, k, v share one input type, f and b another; mixed inputs run in float32 (the pure path's precision).
    if not q.dtype == k.dtype == v.dtype:
        q, k, v = (x.astype(mx.float32) for x in (q, k, v))
    if f.dtype != b.dtype:
        f, b = f.astype(mx.float32), b.astype(mx.float32)
    if state is None:
        state = mx.zeros((B, H, Dv, Dk), dtype=mx.float32)
    mask = mx.ones((B, T), dtype=mx.bool_) if mask is None else mask.astype(mx.bool_)
    y, state_out = kernel(
        inputs=[
            q, k, v, f, b, A_log.astype(mx.float32), dt_bias.astype(mx.float32), state.astype(mx.float32), mask,
            T, Dk**-0.5, float(l2_eps), 0.0 if lower_bound is None else float(lower_bound),
        ],
        template=[("InT", v.dtype), ("GT", f.dtype), ("Dk", Dk), ("Dv", Dv), ("LOWER_BOUND", lower_bound is not None)],
        grid=(32, Dv, B * H),
        threadgroup=(32, rows_per_group, 1),
        output_shapes=[(B, T, H, Dv), (B, H, Dv, Dk)],
        output_dtypes=[v.dtype, mx.float32],
    )  # fmt: skip
    return y.astype(out_dtype), state_out
