"""Kimi Delta Attention (KDA) scan, token by token, in pure MLX (spec §1.3): the definition every other path matches.

Conventions shared by every KDA scan (``kda_recurrent``, ``kda_chunked``, ``kda_chunked_metal``; ``B`` batch,
``T`` tokens, ``H`` heads):

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

``prepare_scan``, ``mask_gates`` and ``mask_output`` are the input validation and masking every scan shares.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["RECURRENT_BLOCK", "kda_recurrent", "mask_gates", "mask_output", "prepare_scan"]

# Steps per compiled block. Each block returns its stacked outputs, so at most one state per block (plus the K
# inside the block being evaluated) is alive at a time; one compiled call per step would keep all T states alive.
RECURRENT_BLOCK = 16


def prepare_scan(q, k, v, g, beta, state, mask):
    """Validate the shapes above, cast q/k/v/g/beta/state to float32, default the state to zeros and the mask to
    bool. Returns ``(q, k, v, g, beta, state, mask)``; ``mask`` stays None when None."""
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


def mask_gates(g, beta, mask):
    """g: ``[B, T, H, Dk]``, beta: ``[B, T, H]``, mask: ``[B, T]`` bool or None. Masked steps get g = 0 and
    beta = 0: an exact identity on the state (exp(0) = 1, update scaled by 0)."""
    if mask is None:
        return g, beta
    return mx.where(mask[:, :, None, None], g, 0.0), mx.where(mask[:, :, None], beta, 0.0)


def mask_output(o, mask, out_dtype):
    """o: ``[B, T, H, Dv]`` float32 -> ``out_dtype``, zero at masked steps (mask ``[B, T]`` bool or None)."""
    if mask is not None:
        o = mx.where(mask[:, :, None, None], o, 0.0)
    return o.astype(out_dtype)


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
    """Token-by-token KDA scan (reference semantics of fla's ``naive_recurrent_kda``).

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
    q, k, v, g, beta, state, mask = prepare_scan(q, k, v, g, beta, state, mask)
    g, beta = mask_gates(g, beta, mask)
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
    return mask_output(o, mask, out_dtype), state
