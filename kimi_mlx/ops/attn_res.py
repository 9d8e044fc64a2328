"""Kimi-K3 cross-layer attention residuals (AttnRes): a softmax over depth of earlier block snapshots (spec §2.3).

    keys_i   = values_i * inv_rms_i                 (weightless RMSNorm; inv_rms of a snapshot is computed once)
    logits_i = keys_i . (norm_weight * proj_weight)  (the two weights folded into one score vector w_eff)
    out      = sum_i softmax_i(logits) * values_i    (the RAW values), float32 accumulation

``attn_res_mix`` is the single function boundary where the Metal kernel will slot in.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx


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


def attn_res_mix(
    blocks: list[mx.array], block_inv_rms: list[mx.array], partial: mx.array, w_eff: mx.array, eps: float
) -> mx.array:
    """Mix the completed block snapshots and the running partial sum.

    blocks: K snapshots [B, T, d] (stream dtype); block_inv_rms: their ``inv_rms`` [B, T, 1] float32;
    partial: [B, T, d]; w_eff: [d] float32 = norm_weight * proj_weight. Returns [B, T, d] in partial's dtype.
    """
    values = blocks + [partial]
    return _combine(values, _scores(values, block_inv_rms + [inv_rms(partial, eps)], w_eff))


def attn_res_mix_scored(
    blocks: list[mx.array], block_inv_rms: list[mx.array], partial: mx.array,
    score: Callable[[mx.array], mx.array], eps: float,
) -> mx.array:
    """Same mix with the score computed by a callable on the RMS-normalised values ``[B, T, d] -> [B, T, 1]``
    (for a projection that must be called rather than read, e.g. a LoRA-wrapped one)."""
    values = blocks + [partial]
    scales = block_inv_rms + [inv_rms(partial, eps)]
    return _combine(values, [score(v.astype(mx.float32) * r).astype(mx.float32) for v, r in zip(values, scales)])
