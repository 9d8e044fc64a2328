"""Kimi Delta Attention layer (spec §1.3): projections, causal short conv, gates, delta-rule scan, gated RMSNorm.

Parameter names follow mlx-lm's ``kimi_linear`` (so LoRA adapters carry over), except the three depthwise convs,
which are fused into one ``qkv_conv.weight: [3*H*D, K]`` (column K-1 multiplies the current token).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache import KDACache
from ..config import KimiLinearConfig
from ..ops.kda import kda_forward


def short_conv(x: mx.array, weight: mx.array, state: Optional[mx.array]) -> tuple[mx.array, mx.array]:
    """Causal depthwise conv + SiLU.

    x: [B, T, C]; weight: [C, K]; state: [B, K-1, C] (previous inputs, oldest first) or None for zeros.
    Returns (silu(conv(x)) [B, T, C], new state [B, K-1, C]).
    """
    B, T, C = x.shape
    K = weight.shape[1]
    if state is None:
        state = mx.zeros((B, K - 1, C), dtype=x.dtype)
    u = mx.concatenate([state.astype(x.dtype), x], axis=1)
    w = weight.astype(mx.float32)
    y = u[:, K - 1 :].astype(mx.float32) * w[:, K - 1]
    for i in range(K - 1):
        y = y + u[:, i : i + T].astype(mx.float32) * w[:, i]
    return nn.silu(y).astype(x.dtype), u[:, T:]


def l2_normalize(x: mx.array, eps: float) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (fla's eps-inside-sqrt convention)."""
    x = x.astype(mx.float32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


class KimiDeltaAttention(nn.Module):
    """KDA mixer for one layer. Input/output ``[B, T, hidden]``; state in a ``KDACache``."""

    def __init__(self, cfg: KimiLinearConfig, fused_qkv: bool = False):
        super().__init__()
        self.num_heads = H = cfg.kda_num_heads
        self.head_dim = D = cfg.kda_head_dim
        self.conv_kernel = cfg.short_conv_kernel_size
        self.l2_eps = cfg.kda_l2_eps
        hidden, proj = cfg.hidden_size, H * D
        if fused_qkv:
            self.qkv_proj = nn.Linear(hidden, 3 * proj, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, proj, bias=False)
            self.k_proj = nn.Linear(hidden, proj, bias=False)
            self.v_proj = nn.Linear(hidden, proj, bias=False)
        self.qkv_conv = nn.Module()
        self.qkv_conv.weight = mx.zeros((3 * proj, self.conv_kernel))
        self.f_a_proj = nn.Linear(hidden, D, bias=False)
        self.f_b_proj = nn.Linear(D, proj, bias=False)
        self.b_proj = nn.Linear(hidden, H, bias=False)
        self.g_a_proj = nn.Linear(hidden, D, bias=False)
        self.g_b_proj = nn.Linear(D, proj, bias=False)
        self.A_log = mx.zeros((H,))
        self.dt_bias = mx.zeros((proj,))
        self.o_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(proj, hidden, bias=False)

    def _qkv(self, x: mx.array) -> mx.array:
        if "qkv_proj" in self:
            return self.qkv_proj(x)
        return mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)

    def decay(self, x: mx.array) -> mx.array:
        """Per-channel log-decay g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias): [B, T, H, D] float32."""
        B, T, _ = x.shape
        f = self.f_b_proj(self.f_a_proj(x)).astype(mx.float32) + self.dt_bias.astype(mx.float32)
        f = f.reshape(B, T, self.num_heads, self.head_dim)
        rate = mx.exp(self.A_log.astype(mx.float32))[:, None]
        return -rate * nn.softplus(f)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[KDACache] = None) -> mx.array:
        """x: [B, T, hidden]; mask: [B, T] bool (True = real token) or None."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        qkv = self._qkv(x)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_state = cache.conv_state if cache is not None else None
        state = cache.recurrent_state if cache is not None else None
        qkv, conv_state = short_conv(qkv, self.qkv_conv.weight, conv_state)
        q, k, v = (t.reshape(B, T, H, D) for t in mx.split(qkv, 3, axis=-1))
        q = l2_normalize(q, self.l2_eps) * (D**-0.5)
        k = l2_normalize(k, self.l2_eps)
        beta = mx.sigmoid(self.b_proj(x).astype(mx.float32))
        o, state = kda_forward(q, k, v, self.decay(x), beta, state=state, mask=mask)
        if cache is not None:
            cache.conv_state, cache.recurrent_state = conv_state, state
            cache.advance(T)
        gate = mx.sigmoid(self.g_b_proj(self.g_a_proj(x)).astype(mx.float32)).reshape(B, T, H, D)
        o = mx.fast.rms_norm(o.astype(mx.float32), self.o_norm.weight.astype(mx.float32), self.o_norm.eps) * gate
        return self.o_proj(o.reshape(B, T, H * D).astype(x.dtype))
