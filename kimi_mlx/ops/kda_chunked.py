"""Chunked (WY / UT) KDA scan in pure, differentiable MLX (spec §1.4): matmuls inside chunks, sequential only across
chunks. Same arguments, semantics and shape conventions as ``kda_recurrent`` (see ``kimi_mlx.ops.kda_recurrent``):
q, k, g ``[B, T, H, Dk]``; v ``[B, T, H, Dv]``; beta ``[B, T, H]``; state ``[B, H, Dv, Dk]`` float32 or None;
mask ``[B, T]`` bool or None; returns ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.

Per chunk of C tokens with chunk-local cumulative log-decay ``G``::

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
so everything is plain differentiable MLX ops (``mx.linalg.tri_inv`` / ``solve_triangular`` have no VJP in MLX)
and no exponent anywhere is positive, so gradients stay finite too (exp(-1000) = 0 just gives zero gradient).

Cost: O(T C Dk) for the intra-chunk matrices, O(T Dk Dv) matmuls, and a sequential loop over ``T / C`` chunks.
Peak memory is a few ``[T, H, D]``-sized float32 buffers (no ``[C, C, Dk]`` pairwise tensor): the work runs in
groups of chunks (``group_tokens``) and the intra-chunk part is recomputed (``mx.checkpoint``) in the backward pass.
"""

from __future__ import annotations

import mlx.core as mx

from .kda_recurrent import mask_gates, mask_output, prepare_scan

__all__ = ["GROUP_ELEMS", "group_tokens", "intra_chunk", "kda_chunked"]

# Elements per [tokens, B*H, D] buffer processed at once by the chunked paths (2M floats = 8 MB).
GROUP_ELEMS = 1 << 21


def group_tokens(B: int, H: int, Dk: int, Dv: int, C: int) -> int:
    """Tokens per group of chunks (a multiple of C, at least C): about ``GROUP_ELEMS`` elements per intra-chunk
    buffer, so peak memory stays a few times the input size and buffers stay small enough to be recycled."""
    return max(1, GROUP_ELEMS // (B * H * max(Dk, Dv) * C)) * C


def _block_levels(q, k, alpha, beta):
    """Aqk and L^-1 = (I + Akk)^-1 of every chunk, built level by level (block sizes 1, 2, 4, ..., C).

    q, k, alpha = exp(g): [M, C, Dk]; beta: [M, C]. Returns (aqk [M, C, C], linv [M, C, C]).
    """
    M, C, Dk = q.shape
    # Diagonal (level "size 1"): Aqk[i, i] = q_i . k_i, Akk[i, i] = 0; L^-1 diagonal blocks are 1.
    aqk = (q * k).sum(axis=-1).reshape(M, C, 1, 1)
    linv = mx.ones((M, C, 1, 1), dtype=mx.float32)
    s = 1
    while s < C:
        # Bottom-left s x s block of every aligned 2s block, anchored at the last token n of the first half:
        #   exp(G_i - G_j) = prod_{n < t <= i} alpha_t  *  prod_{j < t <= n} alpha_t
        # (inclusive prefix product over the second half, exclusive suffix product over the first half).
        P = C // (2 * s)
        ah, kh, qh = (x.reshape(M, P, 2, s, Dk) for x in (alpha, k, q))
        if s == 1:
            e_row, kc = ah[:, :, 1], kh[:, :, 0]
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
        x = -(dinv * off_kk * ainv) if s == 1 else -(dinv @ off_kk @ ainv)
        linv = mx.concatenate([mx.concatenate([ainv, z], axis=-1), mx.concatenate([x, dinv], axis=-1)], axis=-2)
        s *= 2
    return aqk.reshape(M, C, C), linv.reshape(M, C, C)


def intra_chunk(q, k, v, g, beta):
    """Everything that does not depend on the carried state, batched over all chunks.

    q, k, g: [M, C, Dk]; v: [M, C, Dv]; beta: [M, C]  (M = chunks * B * H, chunk-major), float32.
    Returns (WQ [M, 2C, Dk] = [W; Q*exp(G) - Aqk W], UO [M, 2C, Dv] = [U; Aqk U], Kg [M, C, Dk], decay [M, Dk]).
    """
    C = q.shape[1]
    # Decay factors are products of alpha = exp(g) (one exp per element; no exponent is ever positive and no large
    # cumulative sums are subtracted, so there is no overflow and no cancellation after a -1000 step).
    alpha = mx.exp(g)
    aqk, linv = _block_levels(q, k, alpha, beta)
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
_intra_chunk_ckpt = mx.checkpoint(intra_chunk)


@mx.compile
def _chunk_step(S, wq, uo, kg, decay):
    """S: [B, H, Dk, Dv] (fla orientation); wq: [B, H, 2C, Dk]; uo: [B, H, 2C, Dv]; kg: [B, H, C, Dk]."""
    C = kg.shape[-2]
    ws = wq @ S
    vnew = uo[..., :C, :] - ws[..., :C, :]
    o = uo[..., C:, :] + ws[..., C:, :]
    S = decay[..., :, None] * S + kg.swapaxes(-1, -2) @ vnew
    return o, S


def _scan_group(S, q, k, v, g, beta, C: int):
    """One group of tokens: q, k, g [B, Tg, H, Dk], v [B, Tg, H, Dv], beta [B, Tg, H] float32 with masked steps
    already made identities; S [B, H, Dk, Dv] (fla orientation). Returns (o [B, Tg, H, Dv] float32, S)."""
    B, Tg, H, Dk = q.shape
    Dv = v.shape[-1]
    N = -(-Tg // C)
    pad = N * C - Tg
    if pad:
        # Identity steps: g = 0 (no decay), beta = 0 (no update), zero q/k/v; their outputs are dropped.
        q, k, v, g, beta = (mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))

    def to_chunks(x):  # [B, N*C, H, D] -> [N * B * H, C, D], chunk-major
        D = x.shape[-1]
        return x.reshape(B, N, C, H, D).transpose(1, 0, 3, 2, 4).reshape(N * B * H, C, D)

    wq, uo, kg, decay = _intra_chunk_ckpt(
        to_chunks(q), to_chunks(k), to_chunks(v), to_chunks(g), to_chunks(beta[..., None])[..., 0]
    )
    wq, uo = wq.reshape(N, B, H, 2 * C, Dk), uo.reshape(N, B, H, 2 * C, Dv)
    kg, decay = kg.reshape(N, B, H, C, Dk), decay.reshape(N, B, H, Dk)
    outs = []
    for n in range(N):
        if outs:
            S = mx.depends(S, outs[-1])  # compute each chunk's output before moving on (bounded memory)
        o_n, S = _chunk_step(S, wq[n], uo[n], kg[n], decay[n])
        outs.append(o_n)
    o = mx.stack(outs, axis=0).transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, Dv)  # from [N, B, H, C, Dv]
    return (o[:, :Tg] if pad else o), S


def kda_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    chunk_size: int,
) -> tuple[mx.array, mx.array]:
    """Chunked (WY/UT) KDA scan. Same semantics as ``kda_recurrent``.

    Args:
        q, k: ``[B, T, H, Dk]`` L2-normalised (q pre-scaled by ``Dk**-0.5``), any float dtype.
        v: ``[B, T, H, Dv]``.
        g: ``[B, T, H, Dk]`` per-channel log-decay (<= 0; values down to ~-1000 per step are safe).
        beta: ``[B, T, H]`` in (0, 1).
        state: ``[B, H, Dv, Dk]`` float32 initial state (mlx-lm orientation), or None for zeros.
        mask: optional ``[B, T]`` bool, True = real token; masked steps keep the state and output zeros.
        chunk_size: tokens per chunk, a power of two (``kimi_mlx.ops.kda`` picks it by length). T need not be a
            multiple (the tail is padded with identity steps).

    Returns:
        ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.
    """
    C = int(chunk_size)
    if C < 1 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    out_dtype = v.dtype
    q, k, v, g, beta, state, mask = prepare_scan(q, k, v, g, beta, state, mask)
    B, T, H, Dk = q.shape
    if T == 0:
        return mx.zeros((B, 0, H, v.shape[-1]), dtype=out_dtype), state
    per_group = group_tokens(B, H, Dk, v.shape[-1], C)
    S = state.swapaxes(-1, -2)  # [B, H, Dk, Dv] (fla orientation)
    outs = []
    for t0 in range(0, T, per_group):
        t1 = min(T, t0 + per_group)
        xs = [x[:, t0:t1] for x in (q, k, v, g, beta)]
        if t0:
            # Schedule this group's intra-chunk work after the previous group's scan: peak memory ~ one group.
            xs = mx.depends(xs, [S])
        qg, kg, vg, gg, bg = xs
        gg, bg = mask_gates(gg, bg, None if mask is None else mask[:, t0:t1])
        o, S = _scan_group(S, qg, kg, vg, gg, bg, C)
        outs.append(o)
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return mask_output(o, mask, out_dtype), S.swapaxes(-1, -2)
