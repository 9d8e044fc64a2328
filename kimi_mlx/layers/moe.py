"""Feed-forward blocks: gated MLP (SwiGLU, or K3's SiTU) and the sigmoid-routed MoE with shared experts
(spec §1.6), with K3's latent MoE (spec §2.4).

Routed experts are stacked (``switch_mlp.{gate,up,down}_proj.weight: [E, out, in]``, mlx-lm's ``SwitchGLU``
layout, float, MLX-quantized or GGML blocks: ``layers/ggml.py``).

Two ways to run the routed experts, same parameters, same result:
- mlx-lm's ``SwitchGLU``: ``gather_mm`` / ``gather_qmm`` per projection; from 64 pairs on it sorts the pairs by
  expert first (one row gather, one ``gather_mm`` with ``sorted_indices`` per projection, one unsort gather). On
  MLX's GPU backends that sorted ``gather_mm`` is one segmented matmul; MLX's CPU backend runs it one row at a time;
- ``sorted_switch_glu`` sorts the pairs by expert and runs every expert as one dense matmul over its contiguous rows
  (``quantized_matmul`` or dequantize + matmul on the expert's slice for quantized stacks, GGML blocks dequantized
  one expert at a time).
``switch_glu`` picks: on the CPU, ``sorted_switch_glu`` from ``SORTED_MIN_PAIRS`` pairs on, ``SwitchGLU`` below
(decode; where each path wins: bench/README.md, ``bench_switch_threshold.py``, ``bench_moe_experts.py``); on a GPU,
``SwitchGLU`` at any count for float and MLX-quantized experts, the sorted path for GGML blocks (their gather
dequantizes the expert once per pair).
The sorted path reads the per-expert counts on the host (one sync per MoE layer). It is differentiable (plain
slices, matmuls and gathers), so training goes through it too; inside ``mx.compile`` / ``mx.vmap`` (no host reads)
and for expert layers it does not know (DoRA wrappers, nvfp4 with a global scale) it falls back to SwitchGLU;
mlx-lm's per-expert ``LoRASwitchLinear`` runs sorted too (base expert matmul + its low-rank update).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import (
    QuantizedSwitchLinear,
    SwiGLU,
    SwitchGLU,
    SwitchLinear,
)
from mlx_lm.tuner.lora import LoRASwitchLinear

from ..config import KimiConfig
from ..ops.experts import expert_view
from ..ops.ggml import ggml_expert_matmul
from .ggml import GGMLSwitchLinear
from .norm import RMSNorm


@partial(mx.compile, shapeless=True)
def situ(up: mx.array, gate: mx.array, beta: float, linear_beta: Optional[float]) -> mx.array:
    """SiTU: [beta*tanh(gate/beta)*sigmoid(gate)] * [linear_beta*tanh(up/linear_beta)], in float32 (spec §2.5).

    ``linear_beta`` None leaves ``up`` unclipped. Output in ``up``'s dtype.
    """
    g = gate.astype(mx.float32)
    u = up.astype(mx.float32)
    if linear_beta is not None:
        u = linear_beta * mx.tanh(u / linear_beta)
    return (beta * mx.tanh(g / beta) * mx.sigmoid(g) * u).astype(up.dtype)


class SiTU(nn.Module):
    """Kimi-K3's gated activation, called like mlx-lm's ``SwiGLU``: ``act(up, gate)``."""

    def __init__(self, beta: float, linear_beta: Optional[float]):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        return situ(up, gate, self.beta, self.linear_beta)


def make_activation(cfg: KimiConfig) -> nn.Module:
    """SwiGLU for ``hidden_act: silu``, SiTU for ``situ``; both called as ``act(up, gate)``."""
    return SiTU(cfg.situ_beta, cfg.situ_linear_beta) if cfg.hidden_act == "situ" else SwiGLU()


class MLP(nn.Module):
    """Gated MLP: down(act(up(x), gate(x))) with SwiGLU or SiTU."""

    def __init__(self, hidden: int, intermediate: int, activation: nn.Module):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.activation = activation

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.activation(self.up_proj(x), self.gate_proj(x)))


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


_route_compiled = mx.compile(route)


# On the CPU, use the sorted dense-per-expert path from this many (token, slot) pairs on (tokens * top_k): below it
# the per-expert matmuls cost more than SwitchGLU's gather_mm saves (the crossover: bench/README.md,
# ``bench_switch_threshold.py``). Decode (1 token = top_k pairs) stays on SwitchGLU.
SORTED_MIN_PAIRS = 64
# Quantized experts with at least this many rows are dequantized (one expert at a time) and run as a dense matmul:
# the CPU quantized_matmul does not use BLAS, a dequantize + sgemm does.
DEQUANT_MIN_ROWS = 8


def _unwrapped(layer: nn.Module) -> nn.Module:
    """The expert stack under mlx-lm's per-expert ``LoRASwitchLinear`` (the layer itself otherwise)."""
    return _unwrapped(layer.linear) if type(layer) is LoRASwitchLinear else layer


def _sortable(layer: nn.Module) -> bool:
    layer = _unwrapped(layer)  # per-expert LoRA (training): base expert + its low-rank update
    if type(layer) in (SwitchLinear, GGMLSwitchLinear):
        return True
    return type(layer) is QuantizedSwitchLinear and getattr(layer, "global_scale", None) is None


def _expert_linear(layer: nn.Module, x: mx.array, e: int) -> mx.array:
    """x [n, in] through expert ``e`` of a (Quantized / GGML)SwitchLinear stack, or of mlx-lm's ``LoRASwitchLinear``
    (``y + scale * (dropout(x) @ lora_a[e]^T) @ lora_b[e]^T``) -> [n, out]."""
    if type(layer) is LoRASwitchLinear:
        z = (layer.dropout(x) @ expert_view(layer["lora_a"], e).T) @ expert_view(layer["lora_b"], e).T
        return _expert_linear(layer.linear, x, e) + (layer.scale * z).astype(x.dtype)
    if type(layer) is GGMLSwitchLinear:  # the expert's blocks dequantized in bounded row chunks, then matmuls
        y = ggml_expert_matmul(x, layer["weight"], layer.ggml_type, e)
    elif isinstance(layer, QuantizedSwitchLinear):
        w, scales, biases = expert_view(layer["weight"], e), expert_view(layer["scales"], e), layer.get("biases")
        biases = None if biases is None else expert_view(biases, e)
        q = dict(group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
        if x.shape[0] >= DEQUANT_MIN_ROWS:  # dequantize the one expert, then a BLAS matmul
            y = x @ mx.dequantize(w, scales, biases, **q).astype(x.dtype).T
        else:
            y = mx.quantized_matmul(x, w, scales, biases, transpose=True, **q)
    else:
        y = x @ expert_view(layer["weight"], e).T
    if "bias" in layer:
        y = y + expert_view(layer["bias"], e)
    return y


def sorted_switch_glu(switch: SwitchGLU, x: mx.array, inds: mx.array) -> mx.array:
    """Same as ``switch(x, inds)``: x [..., in], inds [..., k] -> [..., k, in], one dense matmul per used expert.

    Pairs are sorted by expert, each expert's rows go through gate/up/down as plain matmuls, and the
    result is put back in (token, slot) order. Experts that receive no rows are skipped.
    Raises ValueError inside ``mx.compile``/``mx.vmap`` (it reads the per-expert counts on the host).
    """
    lead, k = inds.shape[:-1], inds.shape[-1]
    n_experts = switch.gate_proj.num_experts
    flat = mx.stop_gradient(inds).flatten()
    order = mx.argsort(flat)
    counts = mx.zeros((n_experts,), mx.int32).at[flat].add(1)
    counts = counts.tolist()  # host sync
    xs = x.reshape(-1, x.shape[-1])[order // k]
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe = xs[start : start + n]
        start += n
        h = switch.activation(_expert_linear(switch.up_proj, xe, e), _expert_linear(switch.gate_proj, xe, e))
        outs.append(_expert_linear(switch.down_proj, h, e))
    y = mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    y = y[mx.argsort(order)]
    return y.reshape(*lead, k, y.shape[-1])


def _on_gpu() -> bool:
    return mx.default_device() != mx.cpu


def _gather_mm_unsupported(switch: SwitchGLU) -> bool:
    """MLX's CPU gather_mm runs float32 only: bf16/fp16 float experts must take the sorted (plain matmul) path."""
    w = switch.gate_proj.get("weight")
    return (
        type(switch.gate_proj) is SwitchLinear and w is not None and w.dtype != mx.float32 and not _on_gpu()
    )


def _segmented_gather(switch: SwitchGLU) -> bool:
    """Whether ``SwitchGLU``'s sorted ``gather_mm`` / ``gather_qmm`` is one segmented matmul per projection for these
    experts: on a GPU backend, float or MLX-quantized stacks (not GGML blocks, whose gather dequantizes per pair)."""
    projections = (switch.gate_proj, switch.up_proj, switch.down_proj)
    return _on_gpu() and not any(type(_unwrapped(p)) is GGMLSwitchLinear for p in projections)


def switch_glu(switch: SwitchGLU, x: mx.array, inds: mx.array, min_pairs: int = SORTED_MIN_PAIRS) -> mx.array:
    """Routed experts, x [..., in], inds [..., k] -> [..., k, in]: ``SwitchGLU`` where its sorted ``gather_mm`` is a
    segmented matmul (``_segmented_gather``: GPU, float or MLX-quantized experts); otherwise ``sorted_switch_glu``
    from ``min_pairs`` (token, slot) pairs on (and always for half-precision float experts on the CPU backend), else
    ``SwitchGLU``."""
    if (
        not _segmented_gather(switch)
        and (inds.size >= min_pairs or _gather_mm_unsupported(switch))
        and type(switch) is SwitchGLU
        and all(_sortable(p) for p in (switch.gate_proj, switch.up_proj, switch.down_proj))
    ):
        try:
            return sorted_switch_glu(switch, x, inds)
        except ValueError:  # inside mx.compile / mx.vmap: no host reads
            pass
    return switch(x, inds)


class SparseMoE(nn.Module):
    """Routed experts + unweighted shared experts; with ``routed_expert_hidden_size`` (K3's latent MoE) the routed
    experts run at the latent width between ``routed_expert_down_proj`` and ``routed_expert_up_proj``, with an
    optional RMSNorm on the weighted sum. The router and the shared experts always see the full-width x."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.cfg = cfg
        width = cfg.routed_expert_hidden_size or cfg.hidden_size
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.e_score_correction_bias = mx.zeros((cfg.num_experts,))
        self.switch_mlp = SwitchGLU(width, cfg.moe_intermediate_size, cfg.num_experts, activation=make_activation(cfg))
        if cfg.routed_expert_hidden_size:
            self.routed_expert_down_proj = nn.Linear(cfg.hidden_size, width, bias=False)
            self.routed_expert_up_proj = nn.Linear(width, cfg.hidden_size, bias=False)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(width, eps=cfg.rms_norm_eps)
        if cfg.num_shared_experts:
            self.shared_experts = MLP(
                cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts, make_activation(cfg)
            )

    def routing(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [..., hidden] -> (expert indices [..., k] uint32, routing weights [..., k] float32)."""
        c = self.cfg
        return _route_compiled(
            self.gate(x.astype(mx.float32)), self.e_score_correction_bias, c.num_experts_per_token,
            c.num_expert_group if c.use_grouped_topk else 1, c.topk_group, c.moe_renormalize,
            c.routed_scaling_factor,
        )

    def __call__(self, x: mx.array) -> mx.array:
        inds, weights = self.routing(x)
        z = self.routed_expert_down_proj(x) if "routed_expert_down_proj" in self else x
        y = switch_glu(self.switch_mlp, z, inds)  # [..., k, width]
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
        if "routed_expert_norm" in self:
            y = self.routed_expert_norm(y)
        if "routed_expert_up_proj" in self:
            y = self.routed_expert_up_proj(y)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y
