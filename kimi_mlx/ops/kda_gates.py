"""The KDA prologue in pure MLX (spec §1.3): from the layer's raw projections to the scan's inputs.

Shapes (``B`` batch, ``T`` tokens, ``H`` heads): raw ``q``, ``k``: ``[B, T, H, Dk]`` (post short-conv, not
normalised); ``v``: ``[B, T, H, Dv]``; ``f``: ``[B, T, H, Dk]`` raw decay projection ``f_b(f_a(x))``; ``b``:
``[B, T, H]`` beta logits; ``A_log``: ``[H]``; ``dt_bias``: ``[H * Dk]``; ``state``: ``[B, H, Dv, Dk]``;
``mask``: ``[B, T]``. The scan's inputs (``kimi_mlx.ops.kda_recurrent``) come out in float32: q/k L2-normalised with
the eps inside the sqrt (fla's convention) and q scaled by ``Dk**-0.5``, the per-channel log-decay ``g <= 0`` and
``beta = sigmoid(b)``.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

__all__ = ["check_gated_shapes", "kda_decay", "kda_prologue", "l2_normalize"]


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


def kda_prologue(q, k, f, b, A_log, dt_bias, *, lower_bound: float | None, l2_eps: float):
    """Raw projections -> the scan's ``(q, k, g, beta)``, all float32: ``q`` L2-normalised and scaled by
    ``Dk**-0.5``, ``k`` L2-normalised, ``g = kda_decay(f, ...)``, ``beta = sigmoid(b)``."""
    qn = l2_normalize(q, l2_eps) * (q.shape[-1] ** -0.5)
    kn = l2_normalize(k, l2_eps)
    return qn, kn, kda_decay(f, A_log, dt_bias, lower_bound), mx.sigmoid(b.astype(mx.float32))


def check_gated_shapes(q, k, v, f, b, A_log, dt_bias, state, mask) -> None:
    """ValueError naming the first argument whose shape is not the one above (``state``/``mask`` may be None)."""
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
