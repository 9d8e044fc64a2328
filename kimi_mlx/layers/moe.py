"""Feed-forward blocks: dense SwiGLU MLP and the sigmoid-routed MoE with shared experts (spec §1.6).

Routed experts are stacked (``switch_mlp.{gate,up,down}_proj.weight: [E, out, in]``, mlx-lm's ``SwitchGLU``
layout, float or quantized).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from ..config import KimiLinearConfig


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def route(
    logits: mx.array,
    bias: mx.array,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[mx.array, mx.array]:
    """Sigmoid router in float32.

    logits: [..., E]; bias: [E] (e_score_correction_bias, used for selection only).
    Returns (indices [..., k] uint32, weights [..., k] float32): unbiased sigmoid scores of the chosen experts,
    renormalised to sum 1 (when ``renormalize`` and k > 1), then multiplied by ``scaling``.
    """
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores + bias.astype(mx.float32)
    if n_group > 1 and topk_group < n_group:
        grouped = mx.unflatten(choice, -1, (n_group, -1))
        group_score = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # [..., G]
        drop = mx.argpartition(group_score, kth=n_group - topk_group - 1, axis=-1)[..., : n_group - topk_group]
        keep = mx.put_along_axis(
            mx.ones(group_score.shape, mx.bool_), drop, mx.array(False), axis=-1
        )
        choice = mx.flatten(mx.where(keep[..., None], grouped, -mx.inf), -2, -1)
    inds = mx.stop_gradient(mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k])
    weights = mx.take_along_axis(scores, inds, axis=-1)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return inds.astype(mx.uint32), weights * scaling


class SparseMoE(nn.Module):
    """Routed SwiGLU experts + unweighted shared experts."""

    def __init__(self, cfg: KimiLinearConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.e_score_correction_bias = mx.zeros((cfg.num_experts,))
        self.switch_mlp = SwitchGLU(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts)
        if cfg.num_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)

    def __call__(self, x: mx.array) -> mx.array:
        c = self.cfg
        inds, weights = route(
            self.gate(x.astype(mx.float32)), self.e_score_correction_bias, c.num_experts_per_token,
            c.num_expert_group if c.use_grouped_topk else 1, c.topk_group, c.moe_renormalize,
            c.routed_scaling_factor,
        )
        y = self.switch_mlp(x, inds)  # [..., k, hidden]
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y
