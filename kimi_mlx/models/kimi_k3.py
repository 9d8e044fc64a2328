"""Kimi-K3 (``KimiK3ForConditionalGeneration``), text model only: Kimi Linear's layers plus cross-layer attention
residuals (AttnRes), latent MoE, SiTU, the MLA output gate, the full-rank KDA gate and the lower-bound decay gate.

Parameter paths follow the official checkpoint and mlx-lm's ``kimi_k3``: ``language_model.model.layers.{i}.…``,
``language_model.lm_head``, per-layer ``{self_attention,mlp}_res_{norm,proj}`` and the model-level
``output_attn_res_{norm,proj}``. The vision tower and projector are not loaded (text-only).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..config import KimiConfig
from ..convert.hf import kimi_k3_to_mlx
from ..ops.attn_res import attn_res_mix, attn_res_mix_scored, inv_rms
from .kimi_linear import DecoderLayer, KimiLinearModel, Model, layer_masks


class Snapshots:
    """The completed AttnRes blocks of one forward pass, stacked: ``raw`` [K, B, T, d] and their ``inv_rms``
    [K, B, T, 1] float32, computed once when a block is stored (only the running partial sum is new at each mix
    point; the stacked layout is what the Metal mix kernel reads, without a copy per mix)."""

    def __init__(self, eps: float):
        self.eps = eps
        self.raw: Optional[mx.array] = None
        self.inv_rms: Optional[mx.array] = None

    def append(self, x: mx.array) -> None:
        r = inv_rms(x, self.eps)
        if self.raw is None:
            self.raw, self.inv_rms = x[None], r[None]
        else:
            self.raw = mx.concatenate([self.raw, x[None]])
            self.inv_rms = mx.concatenate([self.inv_rms, r[None]])

    def __bool__(self) -> bool:
        return self.raw is not None


class ResidualMix(nn.Module):
    """One AttnRes mix point: weightless RMSNorm of each source, scored by norm.weight * proj.weight."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.proj = nn.Linear(hidden, 1, bias=False)

    def __call__(self, blocks: Snapshots, partial: mx.array) -> mx.array:
        eps = self.norm.eps
        w_n = self.norm.weight.astype(mx.float32)
        if type(self.proj) is nn.Linear:  # a plain projection: fold both weights into one score vector
            w_eff = w_n * self.proj.weight[0].astype(mx.float32)
            return attn_res_mix(blocks.raw, blocks.inv_rms, partial, w_eff, eps)
        # a wrapped projection (e.g. LoRA) is called, never read
        return attn_res_mix_scored(blocks.raw, blocks.inv_rms, partial, lambda k: self.proj(k * w_n), eps)


class K3DecoderLayer(DecoderLayer):
    """Decoder layer whose residual stream is AttnRes over block snapshots (spec §2.3)."""

    def __init__(self, cfg: KimiConfig, index: int, fused_qkv: bool = False):
        super().__init__(cfg, index, fused_qkv)
        self.block_start = index % cfg.attn_res_block_size == 0
        self.self_attention_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, blocks: Snapshots, partial: mx.array, mask, cache=None) -> mx.array:
        """blocks: completed snapshots (appended to in place at a block start); partial: running sum [B, T, d]."""
        x = self.self_attention_res(blocks, partial) if blocks else partial
        if self.block_start:
            blocks.append(partial)
        a = self.self_attn(self.input_layernorm(x), mask, cache)
        partial = a if self.block_start else partial + a
        x = self.mlp_res(blocks, partial)
        return partial + self.mlp(self.post_attention_layernorm(x))


class K3TextModel(KimiLinearModel):
    def __init__(self, cfg: KimiConfig, fused_qkv: bool = False):
        super().__init__(cfg, fused_qkv)
        if cfg.attn_res_block_size is not None:
            self.layers = [K3DecoderLayer(cfg, i, fused_qkv) for i in range(cfg.num_hidden_layers)]
            self.output_attn_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        if "output_attn_res" not in self:
            return super().__call__(inputs, cache, input_embeddings)
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        kda_mask, attn_mask = layer_masks(h.shape[1], cache)
        blocks = Snapshots(self.output_attn_res.norm.eps)  # at most num_layers / block_size live in a forward
        for layer, layer_cache in zip(self.layers, cache or [None] * len(self.layers)):
            h = layer(blocks, h, kda_mask if layer.is_linear else attn_mask, layer_cache)
        return self.norm(self.output_attn_res(blocks, h))


class K3LanguageModel(Model):
    text_model = K3TextModel


class K3Model(nn.Module):
    """Top-level K3 model: ``language_model`` holds the text model and head (mlx-lm protocol via delegation)."""

    def __init__(self, cfg: KimiConfig, fused_qkv: bool = False):
        super().__init__()
        self.args = cfg
        self.model_type = cfg.model_type
        self.language_model = K3LanguageModel(cfg, fused_qkv)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        return self.language_model(inputs, cache, input_embeddings)

    @property
    def layers(self):
        return self.language_model.layers

    def make_cache(self, left_padding: Optional[list[int]] = None, max_checkpoints: int = 8,
                   kv_bits: Optional[int] = None, kv_group_size: int = 64):
        return self.language_model.make_cache(left_padding, max_checkpoints, kv_bits, kv_group_size)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Official K3 layout (``language_model.`` prefix, or none) -> this model's parameters; vision/MTP dropped."""
        return kimi_k3_to_mlx(weights, self.args)

    @property
    def cast_predicate(self):
        return self.language_model.cast_predicate

    @property
    def quant_predicate(self):
        return self.language_model.quant_predicate
