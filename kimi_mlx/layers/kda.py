"""Kimi Delta Attention layer (spec §1.3): projections, causal short conv, gates, delta-rule scan, gated RMSNorm.

Parameter names follow mlx-lm's ``kimi_linear`` (so LoRA adapters carry over), except the three depthwise convs,
which are fused into one ``qkv_conv.weight: [3*H*D, K]`` (column K-1 multiplies the current token).
Kimi-K3 variants: a full-rank output gate ``g_proj`` instead of ``g_a_proj``/``g_b_proj``, and the lower-bound decay
gate (``kimi_mlx.ops.kda_gates.kda_decay``).

Shapes: ``B`` batch, ``T`` tokens, ``H`` heads of size ``D`` (Dk = Dv = D), ``K`` the short-conv width.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache import KDACache
from ..config import KimiConfig
from ..ops.kda import kda_gated

__all__ = ["KDACoreParams", "KDAProjections", "KimiDeltaAttention", "gated_rms_norm", "short_conv"]


@mx.compile  # fuses the K shifted multiply-adds into one kernel
def short_conv(x: mx.array, weight: mx.array, state: mx.array) -> tuple[mx.array, mx.array]:
    """Causal depthwise conv + SiLU.

    x: [B, T, C]; weight: [C, K]; state: [B, K-1, C] (previous inputs, oldest first; zeros at the start).
    Returns (silu(conv(x)) [B, T, C], new state [B, K-1, C]).
    """
    B, T, C = x.shape
    K = weight.shape[1]
    u = mx.concatenate([state.astype(x.dtype), x], axis=1)
    w = weight.astype(mx.float32)
    y = u[:, K - 1 :].astype(mx.float32) * w[:, K - 1]
    for i in range(K - 1):
        y = y + u[:, i : i + T].astype(mx.float32) * w[:, i]
    return nn.silu(y).astype(x.dtype), u[:, T:]


class KDACoreParams(NamedTuple):
    """A KDA layer's weights and sizes as ``_kda_core`` reads them: arrays and Python constants, a tree that
    ``mx.compile`` takes (a frozen dataclass is not; the constants become part of the compiled graph's key)."""

    conv_weight: mx.array  # [3*H*D, K] fused q|k|v depthwise conv, column K-1 multiplies the current token
    A_log: mx.array  # [H]
    dt_bias: mx.array  # [H*D]
    norm_weight: mx.array  # [D] gated RMSNorm weight
    num_heads: int  # H
    l2_eps: float  # eps inside the sqrt of the q/k L2 norm
    norm_eps: float  # RMSNorm eps
    lower_bound: Optional[float]  # None: softplus decay gate; K3: lb < 0 (``kda_decay``)


class KDAProjections(NamedTuple):
    """One call's input projections, ``x`` -> what ``_kda_core`` reads."""

    qkv: mx.array  # [B, T, 3*H*D] projected q|k|v, zeroed at masked steps
    f: mx.array  # [B, T, H*D] decay projection f_b(f_a(x))
    b: mx.array  # [B, T, H] beta logits
    gate: mx.array  # [B, T, H*D] output-gate logits


class KimiDeltaAttention(nn.Module):
    """KDA mixer for one layer. Input/output ``[B, T, hidden]``; state in a ``KDACache``."""

    def __init__(self, cfg: KimiConfig, fused_qkv: bool = False):
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
        if cfg.kda_full_rank_gate:  # K3: one full-rank output-gate projection
            self.g_proj = nn.Linear(hidden, proj, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, D, bias=False)
            self.g_b_proj = nn.Linear(D, proj, bias=False)
        self.lower_bound = cfg.kda_gate_lower_bound
        self.A_log = mx.zeros((H,))
        self.dt_bias = mx.zeros((proj,))
        self.o_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(proj, hidden, bias=False)

    def _qkv(self, x: mx.array) -> mx.array:
        if "qkv_proj" in self:
            return self.qkv_proj(x)
        return mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)

    def _core_params(self) -> KDACoreParams:
        """This layer's weights and sizes as ``_kda_core`` reads them (read at each call: adapters may change them)."""
        return KDACoreParams(
            self.qkv_conv.weight, self.A_log, self.dt_bias, self.o_norm.weight,
            self.num_heads, self.l2_eps, self.o_norm.eps, self.lower_bound,
        )  # fmt: skip

    def _gate(self, x: mx.array) -> mx.array:
        if "g_proj" in self:
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[KDACache] = None) -> mx.array:
        """x: [B, T, hidden]; mask: [B, T] bool (True = real token) or None."""
        B, T, _ = x.shape
        qkv = self._qkv(x)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_state = cache.conv_state if cache is not None else None
        state = cache.recurrent_state if cache is not None else None
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel - 1, qkv.shape[-1]), dtype=qkv.dtype)
        if state is None:
            state = mx.zeros((B, self.num_heads, self.head_dim, self.head_dim), dtype=mx.float32)
        proj = KDAProjections(qkv, self.f_b_proj(self.f_a_proj(x)), self.b_proj(x), self._gate(x))
        # One decode step without padding runs as a single compiled graph (fewer, fused kernels).
        core = _kda_core_compiled if T == 1 and mask is None else _kda_core
        params, outs, a = self._core_params(), [], 0
        for b in (*(cache.cuts(T) if cache is not None else ()), T):  # a marked snapshot point: the state there
            part = proj if (a, b) == (0, T) else KDAProjections(*(p[:, a:b] for p in proj))
            o, conv_state, state = core(params, part, conv_state, state, None if mask is None else mask[:, a:b])
            if b < T:
                cache.keep(b, conv_state, state)
            outs.append(o)
            a = b
        o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)  # [B, T, H*D]
        if cache is not None:
            cache.conv_state, cache.recurrent_state = conv_state, state
            cache.advance(T)
        return self.o_proj(o.astype(x.dtype))


def _kda_core(
    p: KDACoreParams, proj: KDAProjections, conv_state: mx.array, state: mx.array, mask: Optional[mx.array]
) -> tuple[mx.array, mx.array, mx.array]:
    """Everything between the input projections and o_proj: short conv, KDA scan, gated RMSNorm.

    conv_state: [B, K-1, 3*H*D]; state: [B, H, D, D] float32; mask: [B, T] bool (True = real token) or None.
    Returns (o [B, T, H*D] float32, new conv_state, new state).
    """
    B, T, _ = proj.qkv.shape
    H = p.num_heads
    qkv, conv_state = short_conv(proj.qkv, p.conv_weight, conv_state)
    q, k, v = (t.reshape(B, T, H, -1) for t in mx.split(qkv, 3, axis=-1))
    D = q.shape[-1]
    o, state = kda_gated(
        q, k, v, proj.f.reshape(B, T, H, D), proj.b, p.A_log, p.dt_bias,
        lower_bound=p.lower_bound, l2_eps=p.l2_eps, state=state, mask=mask,
    )  # fmt: skip
    o = gated_rms_norm(o, proj.gate.reshape(B, T, H, D), p.norm_weight, p.norm_eps)
    return o.reshape(B, T, H * D), conv_state, state


def _gated_rms_norm(o: mx.array, gate: mx.array, weight: mx.array, eps: float) -> mx.array:
    """The KDA output: RMSNorm over the head dim times a sigmoid gate, in float32.

    o, gate: [B, T, H, D] (gate = output-gate logits); weight: [D]. Returns [B, T, H, D] float32.
    """
    return mx.fast.rms_norm(o.astype(mx.float32), weight.astype(mx.float32), eps) * mx.sigmoid(gate.astype(mx.float32))


# One fused kernel: MLX's CPU backend runs the uncompiled norm and gate as a dozen passes over [B, T, H, D].
gated_rms_norm = mx.compile(_gated_rms_norm)


_kda_core_compiled = mx.compile(_kda_core)
