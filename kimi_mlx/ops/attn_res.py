"""Kimi-K3 cross-layer attention residuals (AttnRes): a softmax over depth of earlier block snapshots (spec §2.3).

This is the single function boundary where the Metal kernel will slot in.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx


def attn_res_mix(sources: list[mx.array], score: Callable[[mx.array], mx.array], eps: float) -> mx.array:
    """Weighted sum over depth of the RAW sources, weights from their RMS-normalised copies.

    sources: the completed block snapshots then the running partial sum, each ``[B, T, d]`` (stream dtype).
    score: maps the weightless-RMSNorm'd sources ``[S, B, T, d]`` (float32) to logits ``[S, B, T, 1]``; the model
    passes ``proj(k * norm_weight)``, i.e. ``k . (norm_weight * proj_weight)``, through the projection module so a
    LoRA-wrapped projection works too.
    Returns ``sum_i softmax_i(logits) * sources[i]``: ``[B, T, d]`` in the sources' dtype, accumulated in float32.
    """
    values = mx.stack(sources).astype(mx.float32)  # [S, B, T, d]
    keys = mx.fast.rms_norm(values, None, eps)
    weights = mx.softmax(score(keys).astype(mx.float32), axis=0)  # [S, B, T, 1]
    return (weights * values).sum(axis=0).astype(sources[-1].dtype)
