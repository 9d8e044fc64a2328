"""Kimi-K3 (``KimiK3ForConditionalGeneration``), text model only: Kimi Linear's layers plus cross-layer attention
residuals (AttnRes), latent MoE, SiTU, the MLA output gate, the full-rank KDA gate and the lower-bound decay gate.

Parameter paths follow the official checkpoint and mlx-lm's ``kimi_k3``: ``language_model.model.layers.{i}.…``,
``language_model.lm_head``, per-layer ``{self_attention,mlp}_res_{norm,proj}`` and the model-level
``output_attn_res_{norm,proj}``. The vision tower and projector are not part of it (``kimi_mlx.vision``; ``load``
attaches them as ``model.image_encoder``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..config import KimiConfig
from ..convert.hf import kimi_k3_to_mlx
from ..layers.residual import AttnResStream, Boundary, ResidualMix
from .kimi_linear import DecoderLayer, KimiLinearModel, Model


class K3DecoderLayer(DecoderLayer):
    """Decoder layer on an ``AttnResStream`` (spec §2.3): each sublayer reads a ``ResidualMix`` of the block snapshots
    and the partial sum; the first layer of a block (``block_start``) stores the partial sum as a snapshot."""

    def __init__(self, cfg: KimiConfig, index: int, fused_qkv: bool = False):
        super().__init__(cfg, index, fused_qkv)
        self.block_start = index % cfg.attn_res_block_size == 0
        self.self_attention_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, stream: AttnResStream, mask, cache=None) -> AttnResStream:
        """mask: the KDA or MLA mask of ``layer_masks``; cache: this layer's cache or None."""
        x = stream.mix(self.self_attention_res)
        stream.add(self.self_attn(self.input_layernorm(x), mask, cache), new_block=self.block_start)
        stream.add(self.mlp(self.post_attention_layernorm(stream.mix(self.mlp_res))))
        return stream


class K3TextModel(KimiLinearModel):
    """Kimi-K3's text model with AttnRes (``attn_res_block_size`` set): ``K3DecoderLayer``s on an ``AttnResStream``,
    whose final hidden state is the ``output_attn_res`` mix. Without AttnRes, K3's text model is ``KimiLinearModel``
    (its layers take K3's features from the config)."""

    layer_class = K3DecoderLayer

    def __init__(self, cfg: KimiConfig, fused_qkv: bool = False):
        super().__init__(cfg, fused_qkv)
        self.output_attn_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_res_eps = cfg.rms_norm_eps

    def new_stream(self, h: mx.array) -> AttnResStream:
        return AttnResStream(h, self.attn_res_eps)

    def final_hidden(self, stream: AttnResStream) -> mx.array:
        return stream.mix(self.output_attn_res)

    def boundary(self, start: int) -> Boundary:
        blocks = sum(layer.block_start for layer in self.layers[:start])
        return replace(super().boundary(start), stream_type=AttnResStream, blocks=blocks, eps=self.attn_res_eps)


class K3LanguageModel(Model):
    @staticmethod
    def text_model(cfg: KimiConfig, fused_qkv: bool = False) -> KimiLinearModel:
        """``K3TextModel`` when the config sets ``attn_res_block_size``, else ``KimiLinearModel``."""
        return (KimiLinearModel if cfg.attn_res_block_size is None else K3TextModel)(cfg, fused_qkv)


class K3Model(nn.Module):
    """Top-level K3 model: ``language_model`` holds the text model and head (mlx-lm protocol via delegation)."""

    def __init__(self, cfg: KimiConfig, fused_qkv: bool = False):
        super().__init__()
        self.args = cfg
        self.model_type = cfg.model_type
        self.language_model = K3LanguageModel(cfg, fused_qkv)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        return self.language_model(inputs, cache, input_embeddings)

    def embed(self, inputs: mx.array) -> mx.array:
        return self.language_model.embed(inputs)

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
